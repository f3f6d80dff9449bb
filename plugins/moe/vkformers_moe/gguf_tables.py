"""How llama.cpp ``.gguf`` files of the mixture-of-experts decoders map to their Hugging Face configs and checkpoints.

llama.cpp stacks each layer's experts into one 3-D tensor (``blk.N.ffn_gate_exps``: [experts, rows, cols]);
the names below carry ``{expert}`` and the reader splits them into HF's per-expert weights. Mixtral is
written as ``llama`` with experts (``llama.expert_count``).
"""
from __future__ import annotations

import numpy as np

from vkformers.models.gguf import (DERIVED_TENSORS, LLAMA_ROTARY_TRANSFORMS, GGUFArchitecture, GGUFMetadata,
                                   TensorTransform)

from vkformers_moe.variants import FAMILY

ATTENTION = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm"}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
EXPERTS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
           "ffn_up_exps": "mlp.experts.{expert}.up_proj", "ffn_down_exps": "mlp.experts.{expert}.down_proj"}


def _has_experts(metadata: GGUFMetadata) -> bool:
    return bool(metadata.get("expert_count"))


def _sparse_layers(metadata: GGUFMetadata, layers: int) -> list[int]:
    """The layers without a router: dense MLPs (Qwen-MoE's mlp_only_layers)."""
    return [i for i in range(layers) if not metadata.has_tensor(f"blk.{i}.ffn_gate_inp.weight")]


def _mixtral_config(metadata: GGUFMetadata) -> dict:
    config = {**metadata.common_config(), "num_local_experts": metadata.get("expert_count"),
              "num_experts_per_tok": metadata.get("expert_used_count")}
    window = metadata.get("attention.sliding_window")
    if window:
        config["sliding_window"] = window
    return config


def _qwen_moe_config(metadata: GGUFMetadata) -> dict:
    config = {**metadata.common_config(), "num_experts": metadata.get("expert_count"),
              "num_experts_per_tok": metadata.get("expert_used_count"),
              "moe_intermediate_size": metadata.get("expert_feed_forward_length"), "decoder_sparse_step": 1}
    config["mlp_only_layers"] = _sparse_layers(metadata, config["num_hidden_layers"])
    return config


def _qwen2_moe_config(metadata: GGUFMetadata) -> dict:
    return {**_qwen_moe_config(metadata), "norm_topk_prob": False, "use_sliding_window": False,
            "shared_expert_intermediate_size": metadata.get("expert_shared_feed_forward_length")}


def _qwen3_moe_config(metadata: GGUFMetadata) -> dict:
    return {**_qwen_moe_config(metadata), "norm_topk_prob": True,
            "attention_bias": metadata.has_tensor("blk.0.attn_q.bias")}


def _as_row(weight: np.ndarray, config: dict) -> np.ndarray:
    """The shared expert's gate: llama.cpp keeps a vector, HF a [1, hidden] linear."""
    return weight.reshape(1, -1)


def _deepseek2_config(metadata: GGUFMetadata) -> dict:
    common = metadata.common_config()
    rope = metadata.get("rope.dimension_count")
    key = metadata.get("attention.key_length")
    groups = metadata.get("expert_group_count") or 1
    config = {**common, "q_lora_rank": metadata.get("attention.q_lora_rank") or None,
              "kv_lora_rank": metadata.get("attention.kv_lora_rank"), "qk_rope_head_dim": rope,
              "qk_nope_head_dim": key - rope, "qk_head_dim": key, "head_dim": rope,
              "v_head_dim": metadata.get("attention.value_length"),
              "first_k_dense_replace": metadata.get("leading_dense_block_count", 0),
              "moe_intermediate_size": metadata.get("expert_feed_forward_length"),
              "n_routed_experts": metadata.get("expert_count"), "n_shared_experts": metadata.get("expert_shared_count"),
              "num_experts_per_tok": metadata.get("expert_used_count"),
              "routed_scaling_factor": metadata.get("expert_weights_scale", 1.0),
              "norm_topk_prob": bool(metadata.get("expert_weights_norm", False)),
              "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
              "n_group": groups, "topk_group": metadata.get("expert_group_used_count") or 1}
    return config


FAMILY.gguf(
    GGUFArchitecture("llama", "mixtral", "MixtralForCausalLM", _mixtral_config,
                     {**ATTENTION, "ffn_gate_inp": "block_sparse_moe.gate",
                      "ffn_gate_exps": "block_sparse_moe.experts.{expert}.w1",
                      "ffn_down_exps": "block_sparse_moe.experts.{expert}.w2",
                      "ffn_up_exps": "block_sparse_moe.experts.{expert}.w3"},
                     transforms=LLAMA_ROTARY_TRANSFORMS, applies=_has_experts),
    GGUFArchitecture("qwen2moe", "qwen2_moe", "Qwen2MoeForCausalLM", _qwen2_moe_config,
                     {**ATTENTION, **DENSE_MLP, **EXPERTS, "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                      "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                      "ffn_down_shexp": "mlp.shared_expert.down_proj"},
                     transforms={"ffn_gate_inp_shexp": TensorTransform(_as_row)}),
    GGUFArchitecture("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe_config,
                     {**ATTENTION, **QK_NORMS, **DENSE_MLP, **EXPERTS}),
    GGUFArchitecture("deepseek2", "deepseek_v2", "DeepseekV2ForCausalLM", _deepseek2_config,
                     {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj",
                      "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
                      "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
                      "attn_kv_b": "self_attn.kv_b_proj", "attn_output": "self_attn.o_proj",
                      "ffn_norm": "post_attention_layernorm", **DENSE_MLP, **EXPERTS,
                      "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
                      "ffn_down_shexp": "mlp.shared_experts.down_proj"},
                     # newer converters add attn_kv_b split per head (k transposed) for MLA's absorbed
                     # product, beside attn_kv_b itself: the same numbers twice
                     skipped=(*DERIVED_TENSORS, "attn_k_b", "attn_v_b")),
)
