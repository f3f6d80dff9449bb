"""The dense causal LM: the decoder kit's model, configured by this plugin's variants."""
from __future__ import annotations

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine import lazy
from vkformers.engine.tensor import Tensor
from vkformers.errors import InputError
from vkformers.models.decoder import DecoderForCausalLM
from vkformers.models.decoder.layer import Context
from vkformers.models.layers import Embedding, Linear
from vkformers.models.module import add_param, get_param, place

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

    @staticmethod
    def _rescaled(x, magnitude):
        return x * magnitude / (x * x).mean(-1, keepdim=True).maximum(1e-5).sqrt()

    def run_layers(self, x, ctx):
        o = self.spec.make_layer
        ctx.per_layer_inputs = per_layer_inputs(self, ctx.token_ids, x)
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


class CpmAntForCausalLM(DenseDecoderForCausalLM):
    """CPM-Ant (vkformers_llama.cpmant): the prompt tokens before the text, segment embeddings added to the token
    embeddings, and each forward's attention bias (position and segment buckets of one learned table) and mask built
    from the ids, which decide the padding (id 0) as transformers' CpmAntModel does; the attention_mask is not read.
    The prompt positions' outputs are dropped before the final norm."""

    def __init__(self, config: dict, architecture):
        super().__init__(config, architecture)
        o, s = self.spec.extra["cpmant"], self.spec
        object.__setattr__(self, "inputs", o)
        object.__setattr__(self, "segment_embed", place(self, "cpmant.segment_embedding",
                                                        Embedding(o.segment_types, s.hidden_size)))
        add_param(self, "cpmant.position_bias.relative_attention_bias",
                  (o.segment_types * o.segment_types + o.num_buckets, s.num_heads))
        self.capture_decode = False

    def generation_positions(self, mask, tokens, prompt_length):
        return np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).copy()  # not read: CPM-Ant counts columns

    def residual_stream(self, input_ids, attention_mask=None, position_ids=None, cache=None, encoder=None):
        if encoder is not None:
            raise InputError("CPM-Ant has no cross-attention: call it without encoder states")
        o, s = self.inputs, self.spec
        source = input_ids.numpy() if isinstance(input_ids, Tensor) else np.asarray(input_ids)
        batch, length = source.shape
        past = cache.position if cache is not None else 0
        prompt = o.prompt_length if past == 0 else 0
        first = s.vocab_size + 2 * o.prompt_length

        def with_prompt(ids):
            ids = np.asarray(ids).astype(np.int32)
            if not prompt:
                return ids
            return np.concatenate([np.broadcast_to(np.arange(first, first + prompt, dtype=np.int32),
                                                   (ids.shape[0], prompt)), ids], axis=1)

        if cache is None:
            def layout(ids):
                return o.layout(np.asarray(ids), length, True)
            parts = layout(source)
            derived = [lazy.derived_input(a, source, lambda ids, i=i: layout(ids)[i])
                       for i, a in enumerate(parts)]
            ids = lazy.derived_input(with_prompt(source), source, with_prompt)
        else:  # generation: the text ids so far stay on the cache (the padding rule counts them all)
            history = source if past == 0 else np.concatenate([cache.__dict__["text_ids"], source], axis=1)
            cache.__dict__["text_ids"] = history
            derived = o.layout(history, length, bool(prompt))
            ids = with_prompt(source)
        segments, buckets, mask, query_valid = derived
        x = F.embedding(Tensor(ids), self.embed.weight) + F.embedding(Tensor(segments), self.segment_embed.weight)
        table = get_param(self, "cpmant.position_bias.relative_attention_bias").float()
        bias = F.embedding(Tensor(buckets), table).permute(0, 3, 1, 2) + Tensor(mask)
        ctx = Context(Tensor(np.zeros(ids.shape, np.int32)), None, None, cache)
        ctx.attention_bias, ctx.query_valid, ctx.prompt_columns = bias, Tensor(query_valid), prompt
        x = self.run_layers(x, ctx)
        return x[:, prompt:].contiguous() if prompt else x
