"""vkformers-ssm: state-space models (Mamba, Falcon-Mamba, Mamba-2) for vkformers."""
