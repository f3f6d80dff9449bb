"""vkformers-ssm: state-space models (Mamba, Falcon-Mamba) for vkformers."""
