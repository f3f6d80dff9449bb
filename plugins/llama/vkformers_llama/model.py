"""The dense causal LM: the decoder kit's model, configured by this plugin's variants."""
from __future__ import annotations

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.decoder import DecoderForCausalLM
from vkformers.models.layers import Linear
from vkformers.models.module import place

from vkformers_llama.gemma3n import add_per_layer_inputs, per_layer_inputs
from vkformers_llama.variants import decoder_spec


class DenseDecoderForCausalLM(DecoderForCausalLM):
    """A dense causal decoder of any architecture in :data:`vkformers_llama.variants.VARIANTS`."""

    decoder_spec = staticmethod(decoder_spec)


class Gemma3nForCausalLM(DenseDecoderForCausalLM):
    """Gemma 3n's text model: the layers (vkformers_llama.gemma3n) run on altup_num_inputs residual streams, the
    first the token embeddings, the others projections of them rescaled to their RMS; after the last layer the others
    are projected back, rescaled to the first's RMS, and the streams averaged. Each layer also reads its per-layer
    input: (RMS-normed per_layer_model_projection(embeddings) / sqrt(D) + embed_tokens_per_layer(ids) * sqrt(P))
    / sqrt(2), ids past vocab_size_per_layer_input reading row 0."""

    def __init__(self, config: dict, architecture):
        super().__init__(config, architecture)
        o, s = self.spec.make_layer, self.spec
        d = s.hidden_size
        add_per_layer_inputs(self, s, o.per_layer_width, int(s.extra["per_layer_vocab"]))
        refs = dict(
            altup_projections=[place(self, f"model.altup_projections.{i}", Linear(d, d, bias=False))
                               for i in range(o.altup_inputs - 1)],
            altup_unembed_projections=[place(self, f"model.altup_unembed_projections.{i}", Linear(d, d, bias=False))
                                       for i in range(o.altup_inputs - 1)])
        for name, value in refs.items():
            object.__setattr__(self, name, value)
        self.capture_decode = False  # the per-layer inputs are looked up on the host from each step's token ids
        self._input_ids = None

    def forward(self, input_ids, *args, **kwargs):
        # the per-layer embeddings read the token ids: the caller's array itself (a captured step replaces it)
        self._input_ids = input_ids.numpy() if isinstance(input_ids, Tensor) else np.asarray(input_ids)
        return super().forward(input_ids, *args, **kwargs)

    @staticmethod
    def _rescaled(x, magnitude):
        return x * magnitude / (x * x).mean(-1, keepdim=True).maximum(1e-5).sqrt()

    def run_layers(self, x, ctx):
        o = self.spec.make_layer
        ctx.per_layer_inputs = per_layer_inputs(self, self._input_ids, x)
        ctx.shared_kv = {}
        magnitude = (x * x).mean(-1, keepdim=True).sqrt()
        streams = F.stack([x] + [self._rescaled(p(x), magnitude) for p in self.altup_projections], dim=0)
        for layer in self.layers:
            # a layer whose keys and values later layers read is not recomputed under gradient checkpointing: their
            # recomputations read its keys and values from the first forward, which must keep its graph
            streams = layer(streams, ctx) if layer.stores_kv else self.call_layer(layer, streams, ctx)
        first = streams[0]
        magnitude = (first * first).mean(-1, keepdim=True).sqrt()
        unembedded = [self._rescaled(p(streams[i + 1]), magnitude) for i, p in enumerate(self.altup_unembed_projections)]
        total = first
        for u in unembedded:
            total = total + u
        return total * (1.0 / o.altup_inputs)
