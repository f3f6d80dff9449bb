"""Write tests/data/gguf/<case>.<type>.gguf: tiny fixtures (tests/fixtures/<name>) as llama.cpp would convert them.

The names, metadata keys and tensor changes follow llama.cpp's convert_hf_to_gguf conventions, spelled out here
from HF to GGUF independently of the plugins' GGUF tables (which map back): q/k rows of llama-family
attention permuted to adjacent rotary pairs, Gemma norms stored as 1 + w, GPT-2 Conv1D weights transposed,
experts stacked into one 3-D tensor per projection. Two files per case: F32, and "Q8_0" (matrices whose rows
are whole Q8_0 blocks quantized, the others F16, norms F32, as llama.cpp does).

Then, where transformers' own GGUF loader knows the architecture, it loads the F32 file and its logits are
compared with the fixture's reference (an implementation of the name tables other than vkformers'); the result
is written to tests/data/gguf/transformers_check.json.

    /tmp/tfvenv/bin/python tools/make_gguf_fixtures.py      # needs gguf, safetensors, torch, transformers
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
OUT = ROOT / "tests" / "data" / "gguf"

# case: (fixture folder, GGUF general.architecture)
CASES = {
    "llama": ("llama", "llama"), "llama3_rope": ("llama_rope_llama3", "llama"), "mistral": ("mistral", "llama"), "mixtral": ("mixtral", "llama"),
    "qwen2": ("qwen2", "qwen2"), "qwen3": ("qwen3", "qwen3"), "qwen2moe": ("qwen2_moe", "qwen2moe"),
    "qwen3moe": ("qwen3_moe", "qwen3moe"), "gemma": ("gemma", "gemma"), "gemma2": ("gemma2", "gemma2"),
    "gemma3": ("gemma3_text", "gemma3"), "phi3": ("phi3", "phi3"), "phi3_longrope": ("phi3_longrope", "phi3"), "starcoder2": ("starcoder2", "starcoder2"),
    "gpt2": ("gpt2", "gpt2"), "falcon": ("falcon", "falcon"),
    "falcon_new_arch": ("falcon_new_arch", "falcon"), "deepseek2": ("deepseek_v2_moe", "deepseek2"),
}
# transformers' GGUF loader (5.24) reads these GGUF architectures (its name for them where it differs)
TRANSFORMERS_READS = {"llama", "llama3_rope", "mistral", "mixtral", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3", "phi3_longrope", "starcoder2",
                      "gpt2", "falcon", "falcon_new_arch"}

# config keys transformers' GGUF loader leaves at its defaults for these fixtures' unusual sizes
CONFIG_OVERRIDES = ("head_dim", "pad_token_id", "n_inner", "n_positions", "ffn_hidden_size", "moe_intermediate_size",
                    "shared_expert_intermediate_size", "intermediate_size", "num_kv_heads", "multi_query",
                    "new_decoder_architecture")
# HF per-layer name (after model.layers.N. / transformer.h.N.) -> GGUF stem (after blk.N.)
COMMON = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
          "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
          "block_sparse_moe.gate": "ffn_gate_inp"}
LAYERS = {
    "gemma2": {**COMMON, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {**COMMON, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "starcoder2": {**COMMON, "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"},
    "gpt2": {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"},
    "falcon": {"input_layernorm": "attn_norm", "self_attention.query_key_value": "attn_qkv",
               "self_attention.dense": "attn_output", "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down",
               "ln_attn": "attn_norm", "ln_mlp": "attn_norm_2"},
    "deepseek2": {**COMMON, "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
                  "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
                  "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b"},
}
LAYERS["gemma3"] = LAYERS["gemma2"]
GLOBALS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
           "transformer.wte": "token_embd", "transformer.wpe": "position_embd", "transformer.ln_f": "output_norm",
           "transformer.word_embeddings": "token_embd"}
EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)")
EXPERT_STEMS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def llama_cpp_permute(weight, heads):
    """convert_hf_to_gguf's LlamaModel.permute: half-split rotary rows -> adjacent pairs."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def falcon_qkv_ungrouped(weight, heads, kv_heads):
    """convert_hf_to_gguf's Falcon QKV: HF's per-KV-group [q.. | k | v] blocks -> [all q | all k | all v]."""
    qkv = weight.reshape(kv_heads, heads // kv_heads + 2, -1, weight.shape[-1])
    return np.concatenate([qkv[:, :-2].reshape(-1, weight.shape[-1]), qkv[:, [-2]].reshape(-1, weight.shape[-1]),
                           qkv[:, [-1]].reshape(-1, weight.shape[-1])])


def gguf_tensors(arch: str, config: dict, weights: dict) -> dict[str, np.ndarray]:
    layers = LAYERS.get(arch, COMMON)
    heads = config.get("num_attention_heads") or config.get("n_head")
    kv_heads = config.get("num_key_value_heads", heads)
    if arch == "falcon":
        kv_heads = config["num_kv_heads"] if config.get("new_decoder_architecture") else 1
    out, experts = {}, {}
    for name, array in weights.items():
        array = np.asarray(array, dtype=np.float32)
        stem, _, suffix = name.rpartition(".")
        layer = re.fullmatch(r"(?:model\.layers|transformer\.h)\.(\d+)\.(.+)", stem)
        if layer:
            index, rest = layer.groups()
            expert = EXPERT.fullmatch(rest)
            if expert:
                experts.setdefault(f"blk.{index}.{EXPERT_STEMS[expert.group(2)]}.{suffix}", {})[
                    int(expert.group(1))] = array
                continue
            target = f"blk.{index}.{layers[rest]}"
        else:
            target = GLOBALS[stem]
        if arch == "llama" and target.endswith(".attn_q"):
            array = llama_cpp_permute(array, heads)
        elif arch == "llama" and target.endswith(".attn_k"):
            array = llama_cpp_permute(array, kv_heads)
        if arch.startswith("gemma") and target.endswith("norm"):
            array = array + 1.0
        if arch == "gpt2" and array.ndim == 2 and target != "token_embd" and target != "position_embd":
            array = array.T
        if arch == "falcon" and target.endswith(".attn_qkv"):
            array = falcon_qkv_ungrouped(array, heads, kv_heads)
        if target.endswith("ffn_gate_inp_shexp"):
            array = array.reshape(-1)
        out[f"{target}.{suffix}"] = np.ascontiguousarray(array)
    for name, per_expert in experts.items():
        out[name] = np.stack([per_expert[e] for e in sorted(per_expert)])
    if arch == "deepseek2":  # newer converters also write kv_b split per head for MLA's absorbed product
        nope, v_dim = config["qk_nope_head_dim"], config["v_head_dim"]
        for name in [n for n in out if n.endswith(".attn_kv_b.weight")]:
            per_head = out[name].reshape(heads, nope + v_dim, -1)
            out[name.replace("attn_kv_b", "attn_k_b")] = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
            out[name.replace("attn_kv_b", "attn_v_b")] = np.ascontiguousarray(per_head[:, nope:])
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors: the divisor of each frequency
        dim = config.get("head_dim") or config["hidden_size"] // heads
        factors = []
        for freq in rope["rope_theta"] ** (-np.arange(0, dim, 2) / dim):
            wavelen = 2 * np.pi / freq
            old = rope["original_max_position_embeddings"]
            if wavelen < old / rope["high_freq_factor"]:
                factors.append(1.0)
            elif wavelen > old / rope["low_freq_factor"]:
                factors.append(rope["factor"])
            else:
                smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
                factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
        out["rope_freqs.weight"] = np.array(factors, dtype=np.float32)
    if rope.get("rope_type") == "longrope":  # Phi3MiniModel.generate_extra_tensors
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    if arch == "gpt2":
        out["output.weight"] = out["token_embd.weight"]  # the converter repeats the tied embedding
    return out


def write(path: Path, case: str, arch: str, config: dict, tensors: dict, quantized: bool) -> None:
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    get = lambda *keys, default=None: next((config[k] for k in keys if config.get(k) is not None), default)
    hidden = get("hidden_size", "n_embd")
    heads = get("num_attention_heads", "n_head")
    w.add_block_count(get("num_hidden_layers", "n_layer"))
    w.add_context_length(get("max_position_embeddings", "n_positions", default=2048))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(get("intermediate_size", "n_inner", "ffn_hidden_size", default=4 * hidden))
    w.add_head_count(heads)
    old_falcon = arch == "falcon" and not config.get("new_decoder_architecture")
    kv = 1 if old_falcon and config.get("multi_query") else get("num_key_value_heads", "num_kv_heads", default=heads)
    w.add_head_count_kv(kv)
    w.add_vocab_size(config["vocab_size"])
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", (rope.get("full_attention") or {}).get("rope_theta", 10000.0))
    w.add_rope_freq_base(float(theta))
    if arch in ("gpt2", "falcon", "starcoder2"):
        w.add_layer_norm_eps(float(get("layer_norm_epsilon", "norm_epsilon", default=1e-5)))
    else:
        w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    if config.get("head_dim") and arch not in ("deepseek2",):
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    if config.get("sliding_window") and case in ("mistral", "mixtral", "phi3", "starcoder2", "gemma2", "gemma3"):
        w.add_sliding_window(config["sliding_window"])
    if rope.get("original_max_position_embeddings") and arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch in ("gemma2", "gemma3"):
        w.add_float32(f"{arch}.attention.scale", float(config["query_pre_attn_scalar"]) ** -0.5)
        if config.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
            w.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "gemma3":
        w.add_array(f"{arch}.attention.sliding_window_pattern",
                    [t == "sliding_attention" for t in config["layer_types"]])
    experts = get("num_local_experts", "num_experts", "n_routed_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "deepseek2":
        w.add_leading_dense_block_count(config["first_k_dense_replace"])
        w.add_q_lora_rank(config["q_lora_rank"])
        w.add_kv_lora_rank(config["kv_lora_rank"])
        w.add_key_length(config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
        w.add_value_length(config["v_head_dim"])
        w.add_rope_dimension_count(config["qk_rope_head_dim"])
        w.add_expert_shared_count(config["n_shared_experts"])
        w.add_expert_weights_scale(float(config["routed_scaling_factor"]))
        w.add_expert_weights_norm(bool(config["norm_topk_prob"]))
        if config.get("topk_method") == "group_limited_greedy":
            w.add_uint32(f"{arch}.expert_group_count", config["n_group"])
            w.add_uint32(f"{arch}.expert_group_used_count", config["topk_group"])
    w.add_tokenizer_model("gpt2")  # a placeholder vocabulary of the fixture's size (transformers sizes from it)
    w.add_token_list([f"<t{i}>" for i in range(config["vocab_size"])])
    w.add_token_types([1] * config["vocab_size"])
    w.add_token_merges([])
    w.add_bos_token_id(config.get("bos_token_id", 1))
    w.add_eos_token_id(config.get("eos_token_id", 2))
    for name, array in tensors.items():
        kind = gguf.GGMLQuantizationType.F32
        if quantized and array.ndim >= 2 and "norm" not in name:
            kind = gguf.GGMLQuantizationType.Q8_0 if array.shape[-1] % 32 == 0 else gguf.GGMLQuantizationType.F16
        data = array if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(array, kind)
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def transformers_check(case: str, path: Path, fixture: Path) -> str | dict:
    """transformers loading the GGUF file: the largest difference of its weights from the fixture's (by HF
    name: the check of the name tables), and of its logits from the reference over the attended positions
    (also checks the config it derives, which its loader fills with defaults where GGUF keys are missing)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM
    ref = load_file(fixture / "reference.safetensors")
    overrides = {}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception:  # sizes its loader does not read from GGUF keys (it assumes the usual ones): given here
        config = json.loads((fixture / "config.json").read_text())
        overrides = {k: config[k] for k in CONFIG_OVERRIDES if k in config}
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                         **overrides)
        except Exception as exc:  # an architecture or option its loader lacks
            return f"not loaded: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    model.eval()
    weights = load_file(fixture / "model.safetensors")
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    missing = sorted(set(weights) - set(state))
    weight_error = max((float(np.abs(state[k] - weights[k]).max()) if state[k].shape == weights[k].shape
                        else float("inf")) for k in weights if k in state)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ref["input_ids"]).long(),
                       attention_mask=torch.tensor(ref["attention_mask"]).long()).logits.numpy()
    mask = ref["attention_mask"].astype(bool)
    return {"config_overrides": sorted(overrides), "weights_max_abs_diff": weight_error, "weights_missing": missing[:4],
            "logits_max_abs_diff": float(np.abs(logits - ref["logits"])[mask].max())}


def main(cases: list[str]) -> None:
    from safetensors.numpy import load_file
    OUT.mkdir(parents=True, exist_ok=True)
    report_path = OUT / "transformers_check.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    for case in cases:
        folder, arch = CASES[case]
        config = json.loads((FIXTURES / folder / "config.json").read_text())
        tensors = gguf_tensors(arch, config, load_file(FIXTURES / folder / "model.safetensors"))
        for quantized in (False, True):
            write(OUT / f"{case}.{'Q8_0' if quantized else 'F32'}.gguf", case, arch, config, tensors, quantized)
        if case in TRANSFORMERS_READS:
            report[case] = transformers_check(case, OUT / f"{case}.F32.gguf", FIXTURES / folder)
        else:
            report[case] = f"transformers {__import__('transformers').__version__} reads no {arch!r} GGUF"
        print(case, report[case])
    report_path.write_text(json.dumps(dict(sorted(report.items())), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
