"""vkformers-moe: mixture-of-experts causal decoders (Mixtral, DeepSeek-V3, Qwen-MoE, ...)."""
