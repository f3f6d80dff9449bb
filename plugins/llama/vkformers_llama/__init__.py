"""vkformers-llama: dense causal decoders (Llama, GPT-2, Qwen, Gemma, ...)."""
