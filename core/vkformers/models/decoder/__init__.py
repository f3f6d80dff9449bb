"""The decoder kit: the shared causal decoder that decoder-only plugins configure rather than rewrite.

- :mod:`~vkformers.models.decoder.spec`: :class:`DecoderSpec`, every option of the block, and the config
  readers a plugin's variant functions fill it with (``first_of``, ``refuse``, ``sliding_windows``, ...).
- :mod:`~vkformers.models.decoder.layer`: :class:`DecoderLayer` (attention and MLP with the spec's norms and
  residual wiring), the per-forward :class:`Context`, and the pieces a plugin composes its own layers from.
- :mod:`~vkformers.models.decoder.model`: :class:`DecoderForCausalLM`; a plugin subclasses it and sets
  ``decoder_spec`` to the reader of its variants.
- :mod:`~vkformers.models.decoder.norms` (:func:`make_norm`),
  :mod:`~vkformers.models.decoder.gated_deltanet` (linear attention layers) and
  :mod:`~vkformers.models.decoder.short_conv` (gated short convolutions, a recurrent mixer for the same slot),
  :mod:`~vkformers.models.decoder.rglru` (Griffin's recurrent block, another) and
  :mod:`~vkformers.models.decoder.shared_block` (one transformer block several layers run: Zamba's).

docs/guide.md ("The decoder kit") walks through what a plugin composes.
"""
from vkformers.models.decoder.gated_deltanet import GatedDeltaNet
from vkformers.models.decoder.layer import Context, DecoderLayer, HeadwiseNorm, make_projection
from vkformers.models.decoder.model import IGNORED_CHECKPOINT_KEYS, DecoderForCausalLM
from vkformers.models.decoder.norms import make_norm
from vkformers.models.decoder.short_conv import ShortConv
from vkformers.models.decoder.spec import DecoderSpec, UnsupportedConfigError, first_of, refuse

__all__ = ["Context", "DecoderForCausalLM", "DecoderLayer", "DecoderSpec", "GatedDeltaNet", "HeadwiseNorm",
           "IGNORED_CHECKPOINT_KEYS", "ShortConv", "UnsupportedConfigError", "first_of", "make_norm", "make_projection", "refuse"]
