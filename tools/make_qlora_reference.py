"""Write tests/fixtures/qlora: a LoRA adapter vkformers trained on an NF4 base, and PEFT's logits with it.

tests/test_qlora.py checks vkformers against these files, so CI needs neither torch nor PEFT.

A tiny random Llama whose every Linear is 64 wide (NF4's block) is quantized to NF4 as vkformers loads it. Its
dequantized weights are written as model.safetensors: a float checkpoint that NF4 packs back to the very same
values, so it is at once the QLoRA base (loaded with quantization="nf4") and the float model PEFT runs on.
vkformers' Trainer (gradient checkpointing on) trains LoRA adapters on the NF4 model for a few steps and saves
them (adapter_config.json, adapter_model.safetensors); PEFT then loads that adapter over the dequantized base in
transformers, and its logits on a fixed batch go into peft_reference.safetensors.

Run with the python that has vkformers; the PEFT half runs in a subprocess under a python with torch,
transformers and peft (no network needed):

    python tools/make_qlora_reference.py                                   # PEFT under /tmp/tfvenv/bin/python
    python tools/make_qlora_reference.py --reference-python PY --out DIR
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "qlora"
TEXT = ROOT / "examples" / "data" / "shakespeare.txt"
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 257, "hidden_size": 64,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
          "bos_token_id": 1, "eos_token_id": 256}  # vocab 257: the byte tokenizer's (bytes, then EOS)
LORA = {"r": 4, "lora_alpha": 8, "base_model_name_or_path": "tests/fixtures/qlora",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
TRAINING = {"steps": 10, "batch_size": 2, "seq_len": 32, "lr": 1e-2, "schedule": "constant", "seed": 0,
            "gradient_checkpointing": True}
TEXT_CHARS = 4000  # the head of the bundled Shakespeare text
INPUT_TEXT = ["To be, or not to be: that is", "Now is the winter of our dis"]  # 28 bytes each


def random_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights (norms near 1, the rest N(0, 0.1))."""
    rng = np.random.default_rng(seed)
    h, f, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    kv = CONFIG["head_dim"] * CONFIG["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    return {name: ((1.0 if name.endswith("norm.weight") else 0.0) + 0.1 * rng.standard_normal(shape))
            .astype(np.float32) for name, shape in shapes.items()}


def input_ids() -> np.ndarray:
    return np.array([list(t.encode()) for t in INPUT_TEXT], np.int64)


def vkformers_half(out: Path, reference_python: str) -> None:
    from vkformers.engine.quantized import QuantizedTensor
    from vkformers.models.loading import AutoModelForCausalLM
    from vkformers.models.lora import LoraConfig, apply_lora
    from vkformers.models.safetensors_io import write_safetensors
    from vkformers.training import Batches, ByteTokenizer, Trainer, TrainingConfig
    from vkformers.training.data import PackedDataset

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "source"
        source.mkdir()
        (source / "config.json").write_text(json.dumps(CONFIG))
        write_safetensors(source / "model.safetensors", random_weights())
        packed = AutoModelForCausalLM.from_pretrained(source, quantization="nf4", requires_grad=False)
        base = {name: t.numpy().astype(np.float32) for name, t in packed.named_parameters()}
        (out / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
        write_safetensors(out / "model.safetensors", base)

        model = AutoModelForCausalLM.from_pretrained(out, quantization="nf4")
        quantized = [n for n, t in model.named_parameters() if isinstance(t, QuantizedTensor)]
        assert len(quantized) == 7 * CONFIG["num_hidden_layers"], quantized
        for name in quantized:  # NF4 of the dequantized values gives them back exactly
            assert np.array_equal(dict(model.named_parameters())[name].numpy(), base[name]), name
        apply_lora(model, LoraConfig(**LORA), seed=0)
        tokens = np.array(ByteTokenizer().encode(TEXT.read_text()[:TEXT_CHARS]), np.int64)
        dataset = PackedDataset(tokens, tokens, TRAINING["seq_len"])
        trainer = Trainer(model.train(), TrainingConfig(**TRAINING),
                          Batches(dataset, TRAINING["batch_size"], seed=TRAINING["seed"]))
        trainer.train()
        trainer.save_final(out)
        losses = [round(h["loss"], 4) for h in trainer.history if "loss" in h]
        logits = model.eval()(input_ids().astype(np.int32)).logits.numpy()

    subprocess.run([reference_python, __file__, "--peft", str(out)], check=True)
    from vkformers.models.safetensors_io import read_safetensors
    reference = read_safetensors(out / "peft_reference.safetensors")["logits"].as_float()
    meta = json.loads((out / "meta.json").read_text())
    meta.update(lora=LORA, training=TRAINING, text=f"{TEXT.relative_to(ROOT)}[:{TEXT_CHARS}]", training_losses=losses,
                quantized_weights=quantized,
                checks={"vkformers_nf4_vs_peft_logits_max_abs_diff": float(f"{np.abs(logits - reference).max():.3g}")})
    (out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}: losses {losses[0]} -> {losses[-1]}, {meta['checks']}")


def peft_half(folder: Path) -> None:
    import peft
    import torch
    import transformers
    from peft import PeftModel
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:  # the base alone: transformers would load an adapter beside it
        for name in ("config.json", "model.safetensors"):
            (Path(tmp) / name).write_bytes((folder / name).read_bytes())
        base = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    ids = torch.from_numpy(input_ids())
    with torch.no_grad():
        plain = base(ids).logits.numpy()
        model = PeftModel.from_pretrained(base, folder).eval()
        logits = model(ids).logits.numpy().astype(np.float32)
    save_file({"input_ids": input_ids(), "logits": logits}, str(folder / "peft_reference.safetensors"))
    meta = {"generator": "tools/make_qlora_reference.py", "transformers_version": transformers.__version__,
            "torch_version": torch.__version__, "peft_version": peft.__version__,
            "adapter_effect_max_abs": float(f"{np.abs(logits - plain).max():.3g}")}
    (folder / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--reference-python", default="/tmp/tfvenv/bin/python",
                        help="a python with torch, transformers and peft")
    parser.add_argument("--peft", type=Path, metavar="FOLDER", help=argparse.SUPPRESS)  # the subprocess's half
    args = parser.parse_args()
    if args.peft:
        peft_half(args.peft)
    else:
        vkformers_half(args.out, args.reference_python)


if __name__ == "__main__":
    sys.exit(main())
