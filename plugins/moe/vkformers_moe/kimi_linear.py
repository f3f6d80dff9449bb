"""Kimi Linear's decoder layer: the shared layer, reading the released checkpoints' dense MLPs.

Its dense MLPs are ``mlp.*`` in the released checkpoints and ``block_sparse_moe.*`` where transformers 5.24 saves
them (its rename of block_sparse_moe to mlp, reversed on save, also reaches the dense layers). The layer keeps
transformers' saved names and reads the released ones into them.
"""
from __future__ import annotations

from vkformers.models.decoder import DecoderLayer
from vkformers.models.lazy_weights import LazyWeights


def kimi_linear_layer(spec, index: int, alibi=None) -> "KimiLinearLayer":
    """DecoderSpec.make_layer: layer ``index``."""
    return KimiLinearLayer(spec, index, alibi)


class KimiLinearLayer(DecoderLayer):
    def convert_checkpoint(self, arrays: LazyWeights, path: str) -> LazyWeights:
        """Released dense MLPs (``<layer>.mlp.*``) under the saved names (``<layer>.<mlp path>.*``)."""
        released, saved = f"{path}.mlp.", f"{path}.{self.spec.mlp.path}."
        if released == saved or not any(name.startswith(released) for name in arrays):
            return arrays
        return arrays.renamed(lambda name: saved + name[len(released):] if name.startswith(released) else name)
