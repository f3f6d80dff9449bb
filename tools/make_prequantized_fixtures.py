"""Write tests/fixtures/prequantized/{fp8,gptq,awq}: a tiny Llama saved as pre-quantized checkpoints are published.

tests/test_prequantized.py loads them (models/prequantized.py) with no torch. Each folder holds config.json (with
its ``quantization_config``), model.safetensors and meta.json: the sum and sum of squares (float64) of every
quantized weight as the reference dequantizes it, computed here with torch from the stored tensors the way
transformers (FP8: float8 times its block's scale_inv), auto-gptq (codes and zeros shifted out of int32 words,
zeros + 1) and AutoAWQ (the same, nibbles reordered 0, 4, 1, 5, 2, 6, 3, 7, zeros as stored) dequantize; and for
FP8 the 256 values torch gives float8_e4m3fn.

- fp8: FineGrainedFP8 with weight_block_size [48, 32], so most weights end on partial blocks.
- gptq: 4 bits, group_size 64, sym false, desc_act false, checkpoint_format "gptq" (stored zeros are z - 1; a
  stored 15 reads as 16).
- awq: 4 bits, group_size 32, version "gemm", zero_point true.

    /tmp/tfvenv/bin/python tools/make_prequantized_fixtures.py
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "prequantized"
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
          "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj"]
FP8_BLOCK = [48, 32]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]       # the column each nibble of a word holds, as AutoAWQ packs
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]     # as AutoAWQ unpacks


def shapes(intermediate: int) -> dict[str, tuple[int, int]]:
    h, kv = CONFIG["hidden_size"], CONFIG["head_dim"] * CONFIG["num_key_value_heads"]
    out_in = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (intermediate, h), "mlp.up_proj": (intermediate, h),
              "mlp.down_proj": (h, intermediate)}
    return {f"model.layers.0.{m}": out_in[m] for m in LINEARS}


def float_tensors(generator, dtype) -> dict[str, torch.Tensor]:
    h, v = CONFIG["hidden_size"], CONFIG["vocab_size"]
    tensors = {"model.embed_tokens.weight": 0.5 * torch.randn(v, h, generator=generator)}
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.post_attention_layernorm.weight"):
        tensors[name] = 1 + 0.1 * torch.randn(h, generator=generator)
    return {k: t.to(dtype).contiguous() for k, t in tensors.items()}


def stats(weight: torch.Tensor) -> list[float]:
    w = weight.to(torch.float64)
    return [float(w.sum()), float((w * w).sum())]


def write(name: str, config: dict, tensors: dict, meta: dict) -> None:
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(folder, (folder / "model.safetensors").stat().st_size, "bytes")


def fp8() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors, meta = float_tensors(generator, torch.bfloat16), {"reference_stats": {}}
    for stem, (rows, cols) in shapes(CONFIG["intermediate_size"]).items():
        weight = 0.2 * torch.randn(rows, cols, generator=generator)
        grid = (-(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))
        padded = torch.zeros(grid[0] * FP8_BLOCK[0], grid[1] * FP8_BLOCK[1])
        padded[:rows, :cols] = weight
        blocks = padded.reshape(grid[0], FP8_BLOCK[0], grid[1], FP8_BLOCK[1])
        scale_inv = blocks.abs().amax(dim=(1, 3)) / 448.0
        expanded = scale_inv.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)[:rows, :cols]
        codes = (weight / expanded).to(torch.float8_e4m3fn)
        tensors[stem + ".weight"], tensors[stem + ".weight_scale_inv"] = codes, scale_inv.float().contiguous()
        meta["reference_stats"][stem + ".weight"] = stats(codes.float() * expanded)  # transformers' dequantization
    table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    meta["e4m3fn_values"] = ["nan" if v != v else v for v in table]
    config = dict(CONFIG, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                               "weight_block_size": FP8_BLOCK, "modules_to_not_convert": ["lm_head"]})
    write("fp8", config, tensors, meta)


def random_codes(generator, n_in, n_out, group_size):
    n_groups = -(-n_in // group_size)
    codes = torch.randint(0, 16, (n_in, n_out), generator=generator, dtype=torch.int32)
    stored_zeros = torch.randint(0, 16, (n_groups, n_out), generator=generator, dtype=torch.int32)
    scales = (0.005 + 0.02 * torch.rand(n_groups, n_out, generator=generator)).half()
    return codes, stored_zeros, scales


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[8n, m] nibbles -> int32 [n, m]: row 8r + k in bits 4k of row r."""
    words = torch.zeros(values.shape[0] // 8, values.shape[1], dtype=torch.int64)
    for k in range(8):
        words |= values[k::8].to(torch.int64) << (4 * k)
    return as_int32(words)


def pack_columns(values: torch.Tensor, order=range(8)) -> torch.Tensor:
    """[n, 8m] nibbles -> int32 [n, m]: nibble k of word c holds column 8c + order[k]."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for k, column in enumerate(order):
        words |= values[:, column::8].to(torch.int64) << (4 * k)
    return as_int32(words)


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """32-bit words held in int64 -> int32 with the same bits."""
    return torch.from_numpy((words.numpy() & 0xFFFFFFFF).astype(np.uint32).view(np.int32).copy())


def gptq_reference(qweight, qzeros, scales, g_idx) -> torch.Tensor:
    """auto-gptq's torch dequantization of the classic format: [out, in]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    zeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).bitwise_and(15)
    zeros = zeros.reshape(qzeros.shape[0], -1) + 1
    codes = torch.bitwise_right_shift(qweight[:, None, :], shifts[None, :, None]).bitwise_and(15)
    codes = codes.reshape(-1, qweight.shape[1])
    return (scales.float()[g_idx] * (codes - zeros[g_idx]).float()).T


def awq_reference(qweight, qzeros, scales, group_size) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm: [out, in]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).bitwise_and(15)
    zeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).bitwise_and(15)
    reverse = torch.arange(qweight.shape[1] * 8).view(-1, 8)[:, AWQ_REVERSE].reshape(-1)
    codes = codes.reshape(qweight.shape[0], -1)[:, reverse]
    zeros = zeros.reshape(qzeros.shape[0], -1)[:, reverse]
    groups = torch.arange(qweight.shape[0]) // group_size
    return ((codes - zeros[groups]).float() * scales.float()[groups]).T


def int4(method: str, group_size: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    config = dict(CONFIG, intermediate_size=128, torch_dtype="float16")
    tensors, meta = float_tensors(generator, torch.float16), {"reference_stats": {}}
    for stem, (n_out, n_in) in shapes(config["intermediate_size"]).items():
        codes, stored_zeros, scales = random_codes(generator, n_in, n_out, group_size)
        if method == "gptq":
            zeros = stored_zeros + 1  # the classic format keeps z - 1: what it reads back
            qweight, qzeros = pack_rows(codes), pack_columns(stored_zeros)
            g_idx = (torch.arange(n_in) // group_size).to(torch.int32)
            tensors.update({stem + ".qweight": qweight, stem + ".qzeros": qzeros, stem + ".scales": scales,
                            stem + ".g_idx": g_idx})
            got = gptq_reference(qweight, qzeros, scales, g_idx.long())
        else:
            zeros = stored_zeros
            qweight, qzeros = pack_columns(codes, AWQ_ORDER), pack_columns(stored_zeros, AWQ_ORDER)
            tensors.update({stem + ".qweight": qweight, stem + ".qzeros": qzeros, stem + ".scales": scales})
            got = awq_reference(qweight, qzeros, scales, group_size)
        groups = torch.arange(n_in) // group_size
        known = ((codes - zeros[groups]).float() * scales.float()[groups]).T
        assert torch.equal(got, known), stem  # the reference reads back the values packed
        meta["reference_stats"][stem + ".weight"] = stats(known)
    if method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                         "desc_act": False, "sym": False, "checkpoint_format": "gptq"}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "version": "gemm", "zero_point": True}
    write(method, config, tensors, meta)


if __name__ == "__main__":
    fp8()
    int4("gptq", 64, 1)
    int4("awq", 32, 2)
