"""The types of the config.json fields the architectures read, checked once when a model is built.

A field of the wrong type (``"hidden_size": "32"``) would otherwise fail deep inside a variant function with a
bare TypeError, or, worse, run: a float count of heads truncated, a string epsilon compared as text. Only fields
that are present are checked (each architecture has its own defaults), in the config the architecture reads (a
multimodal wrapper's nested text config; T5Gemma's nested ``encoder`` and ``decoder`` too).
"""
from __future__ import annotations

from vkformers.models.module import CheckpointError
from vkformers.runtime import dtypes as dt


class ConfigError(CheckpointError):
    """A config.json that is not an object, or a field the architecture reads holding a value of the wrong type."""


# sizes and counts: integers >= 0 (GLM-5 Next writes head_dim 0 for "derive it")
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "intermediate_size", "max_position_embeddings", "head_dim", "n_positions", "n_embd", "n_layer", "n_head",
         "n_inner", "n_ctx", "d_model", "d_ff", "d_kv", "num_layers", "num_heads", "num_decoder_layers",
         "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
         "encoder_ffn_dim", "decoder_ffn_dim", "ffn_dim", "type_vocab_size", "embedding_size",
         "moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
         "relative_attention_num_buckets", "relative_attention_max_distance",
         "local_radius", "global_block_size", "max_encoder_position_embeddings", "max_decoder_position_embeddings",
         "encoder_sparse_step", "decoder_sparse_step", "expert_capacity", "num_encoder_layers",
         "num_encoder_attention_heads", "num_decoder_attention_heads", "ngram", "num_buckets",
         "relative_max_distance",
         "num_landmarks",
         "segment_means_seq_len", "conv_kernel_size",
         "dim_head", "dim_ff", "prompt_length", "prompt_types", "segment_types", "position_bias_num_buckets",
         "position_bias_max_distance", "index_topk", "index_head_dim", "index_n_heads",
         "shared_experts_intermediate_size", "d_head", "d_inner", "mem_len")
# may be null ("use the default"): a null hidden_size is an error, a null head_dim is hidden_size / heads
NULLABLE = {"num_key_value_heads", "head_dim", "n_inner", "intermediate_size", "moe_intermediate_size",
            "num_experts", "num_local_experts", "num_experts_per_tok", "embedding_size", "type_vocab_size",
            "conv_kernel_size", "mem_len"}
NUMBERS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "rope_theta",
           "partial_rotary_factor", "moe_eval_capacity_token_fraction", "moe_token_dropout", "eps")
STRINGS = ("model_type", "hidden_act", "activation_function", "hidden_activation", "feed_forward_proj",
           "encoder_attention_type", "second_expert_policy", "router_dtype", "ff_activation", "attn_type")
BOOLEANS = ("tie_word_embeddings", "scale_embedding", "bi_data", "same_length")
# sizes that may also be one per layer (Gemma 3n's intermediate_size)
PER_LAYER_SIZES = {"intermediate_size"}


def check_config_object(config, where: str = "config") -> None:
    """A config is a JSON object whose model_type, if any, is a string (checked before the registry reads it)."""
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: expected a JSON object of settings, got a JSON {_kind(config)}")
    if "model_type" in config and not isinstance(config["model_type"], str):
        raise _wrong(where, "model_type", config["model_type"], "a string")


def check_config_fields(config, where: str = "config") -> None:
    """Raise :class:`ConfigError` naming the first field of ``config`` (the architecture's own config, or a
    model config nested in it) whose value has the wrong type."""
    check_config_object(config, where)
    for name in SIZES:
        if name in config and not (config[name] is None and name in NULLABLE):
            value = config[name]
            per_layer = name in PER_LAYER_SIZES and isinstance(value, list)
            if not all(_is_int(v) and v >= 0 for v in (value if per_layer else [value])):
                raise _wrong(where, name, value,
                             "an integer >= 0" + (" or a list of them" if name in PER_LAYER_SIZES else ""))
    for name in NUMBERS:
        if name in config and config[name] is not None and not _is_number(config[name]):
            raise _wrong(where, name, config[name], "a number")
    for name in STRINGS:
        if name in config and config[name] is not None and not isinstance(config[name], str):
            raise _wrong(where, name, config[name], "a string")
    for name in BOOLEANS:
        if name in config and config[name] is not None and not isinstance(config[name], bool):
            raise _wrong(where, name, config[name], "true or false")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv_heads) and heads > 0 and kv_heads > 0 and heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} "
                          f"(each key/value head serves a whole group of query heads); fix them in config.json")
    for name, value in config.items():
        if isinstance(value, dict) and isinstance(value.get("model_type"), str):  # a nested model's config
            check_config_fields(value, f"{where}.{name}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _wrong(where: str, name: str, value, expected: str) -> ConfigError:
    return ConfigError(f"{where}: {name} is {value!r} (a JSON {_kind(value)}), expected {expected}; "
                       f"fix {name} in config.json")


def model_dtype(config: dict, requested) -> dt.DType:
    """The requested dtype; "auto" takes the config's (5.x ``dtype`` or 4.x ``torch_dtype``)."""
    if requested in (None, "auto"):
        requested = config.get("dtype") or config.get("torch_dtype") or "float32"
    return dt.as_dtype(str(requested).replace("torch.", ""))
