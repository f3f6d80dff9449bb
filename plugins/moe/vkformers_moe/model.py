"""The mixture-of-experts causal LM: the llama plugin's shared decoder, configured by this plugin's variants."""
from __future__ import annotations

from functools import partial

import numpy as np
from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.lazy_weights import LazyWeights, Weight
from vkformers.models.module import add_param, get_param, place
from vkformers.models.decoder import IGNORED_CHECKPOINT_KEYS, DecoderForCausalLM

from vkformers_llama.gemma3n import add_per_layer_inputs, per_layer_inputs

from vkformers_moe.deepseek_v4 import _collapse, _hyper_weights
from vkformers_moe.gemma4 import per_layer_shapes
from vkformers_moe.qwen4_exp import GatedResidual
from vkformers_moe.variants import decoder_spec


class MoeDecoderForCausalLM(DecoderForCausalLM):
    """A causal decoder of any architecture in :data:`vkformers_moe.variants.VARIANTS`. An architecture whose
    residual stream is not one hidden state (DeepSeek-V4's streams) declares its own subclass as its
    ``model_class``."""

    decoder_spec = staticmethod(decoder_spec)

    def __init__(self, config: dict, architecture):
        super().__init__(config, architecture)
        # a composed layer may build inputs on the host from the position (Llama 4's chunk mask)
        self.capture_decode = self.capture_decode and all(getattr(layer, "capture_decode", True)
                                                          for layer in self.layers)

    @property
    def num_layers(self) -> int:
        """KV-cache slots: one per layer, or what a composed layer asks for (LongCat: two)."""
        return sum(getattr(layer, "cache_slots", 1) for layer in self.layers)

    def load_state_dict(self, arrays, *args, **kwargs):
        # weights a block declares but never runs (LongCat's identity experts): zeros when the checkpoint lacks them
        arrays = LazyWeights.of(arrays)
        zeros = {f"{path}.{name}": (module.moe.expert_size, module.hidden)
                 for path, module in self.named_modules() for name in getattr(module, "unused_weights", ())}
        super().load_state_dict(arrays.updated({n: Weight(shape, partial(np.zeros, shape, np.float32))
                                                for n, shape in zeros.items() if n not in arrays}), *args, **kwargs)


class DeepseekV4ForCausalLM(MoeDecoderForCausalLM):
    """The shared causal LM whose residual stream is hc_mult streams between the embedding and the final norm."""

    def __init__(self, config: dict, architecture):
        super().__init__(config, architecture)
        n, d = self.spec.make_layer.hc_mult, self.spec.hidden_size
        add_param(self, "model.hc_head.hc_fn", (n, n * d))
        add_param(self, "model.hc_head.hc_base", (n,))
        add_param(self, "model.hc_head.hc_scale", (1,))
        # routing buffers, read by the sparse blocks (load_buffers), not parameters
        self.ignored_checkpoint_keys = IGNORED_CHECKPOINT_KEYS + (".ffn.gate.bias", ".ffn.gate.tid2eid")
        self.capture_decode = False  # hash routing and the compressed entries read host token ids and positions
        self._input_ids = self._host_positions = None

    def forward(self, input_ids, *args, **kwargs):
        ids = input_ids.numpy() if isinstance(input_ids, Tensor) else np.asarray(input_ids)
        self._input_ids = ids.astype(np.int64)  # hash routing reads the token ids
        return super().forward(input_ids, *args, **kwargs)

    def _positions(self, *args):
        self._host_positions = super()._positions(*args)
        return self._host_positions

    def run_layers(self, x, ctx):
        o, (b, t, d) = self.spec.make_layer, x.shape
        ctx.input_ids, ctx.host_positions = self._input_ids, np.asarray(self._host_positions)
        pad = self.config.get("pad_token_id")
        if pad is not None and (self._input_ids == pad).any():
            # the embedding's padding_idx row gets no gradient (the compressed entries read padded tokens)
            x = F.where(Tensor((self._input_ids == pad)[:, :, None]), x.detach(), x)
        streams = x.reshape(b, t, 1, d).expand(b, t, o.hc_mult, d).contiguous()
        for layer in self.layers:
            streams = self.call_layer(layer, streams, ctx)
        pre, _ = _hyper_weights(streams, get_param(self, "model.hc_head.hc_fn"),
                                get_param(self, "model.hc_head.hc_base"), get_param(self, "model.hc_head.hc_scale"),
                                o.hc_eps, self.spec.norms.eps)
        return _collapse(streams, pre)


class Qwen4ExpForCausalLM(MoeDecoderForCausalLM):
    """The shared causal LM whose residual stream is hc_count streams, collapsed by the hyper-connection mixer
    (there is no final norm)."""

    def __init__(self, config: dict, architecture):
        super().__init__(config, architecture)
        o, d = self.spec.make_layer, self.spec.hidden_size
        object.__setattr__(self, "mixer", place(self, "model.hyper_connection_mixer",
                                                 GatedResidual(o.hc_count, d, o.hc_lowrank, self.spec.norms.eps,
                                                               combine=False)))
        # hash constants: derived from the config, read by PerLayerEmbedding.load_buffers
        self.ignored_checkpoint_keys = self.ignored_checkpoint_keys + (
            ".layer_multipliers", ".ngram_heads_vocab_sizes", ".ngram_heads_offsets")
        self.capture_decode = False  # the per-layer embeddings hash each step's token ids on the host
        self._input_ids = None

    def forward(self, input_ids, *args, **kwargs):
        ids = input_ids.numpy() if isinstance(input_ids, Tensor) else np.asarray(input_ids)
        self._input_ids = ids.astype(np.int64)  # PLE hashes the token ids
        return super().forward(input_ids, *args, **kwargs)

    def run_layers(self, x, ctx):
        n, (b, t, d) = self.spec.make_layer.hc_count, x.shape
        ctx.input_ids = self._input_ids
        streams = x.reshape(b, t, 1, d).expand(b, t, n, d).contiguous().reshape(b, t, n * d)
        count = len(self.layers)
        per_part = self.layers_per_part(streams, count)
        for i, layer in enumerate(self.layers):
            streams = self.call_layer(layer, streams, ctx)
            self.submit_part(streams, i + 1, count, per_part)
        return self.mixer(streams)


class Glm5NextForCausalLM(MoeDecoderForCausalLM):
    """The shared causal LM on hc_mult streams between the embedding and the final norm, collapsed by their mean."""

    def run_layers(self, x, ctx):
        n, (b, t, d) = self.spec.make_layer.hc_mult, x.shape
        streams = x.reshape(b, t, 1, d).expand(b, t, n, d).contiguous()
        for layer in self.layers:
            streams = self.call_layer(layer, streams, ctx)
        return streams.sum(2) * (1.0 / n)


class Gemma4ForCausalLM(MoeDecoderForCausalLM):
    """Gemma 4's text model: its layers (vkformers_moe.gemma4) read per-layer inputs built from the token ids and
    embeddings (Gemma 3n's), and the last ones the keys and values of earlier ones. One cache holds every layer's
    keys and values at the largest head size and KV head count (the narrower layers' padded)."""

    def __init__(self, config: dict, architecture):
        super().__init__(config, architecture)
        o = self.spec.make_layer
        if o.per_layer_width:
            add_per_layer_inputs(self, self.spec, o.per_layer_width, int(self.spec.extra["per_layer_vocab"]))
        self.ignored_checkpoint_keys = self.ignored_checkpoint_keys + (".layer_scalar",)  # load_buffers reads it

    @property
    def num_kv_heads(self) -> int:
        return per_layer_shapes(self.layers)[0]

    @property
    def head_dim(self) -> int:
        return per_layer_shapes(self.layers)[1]

    def run_layers(self, x, ctx):
        if self.spec.make_layer.per_layer_width:
            ctx.per_layer_inputs = per_layer_inputs(self, ctx.token_ids, x)
        ctx.shared_kv = {}
        for layer in self.layers:
            # a layer whose keys and values later layers read is not recomputed under gradient checkpointing: their
            # recomputations read its keys and values from the first forward, which must keep its graph
            x = layer(x, ctx) if layer.stores_kv else self.call_layer(layer, x, ctx)
        return x


class Dots3NoteForCausalLM(MoeDecoderForCausalLM):
    """dots3-note's text decoder (vkformers_moe.dots3), whose layers' keys and values differ in shape: the KV cache
    holds each layer's flattened into one head of the widest layer's width."""

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def head_dim(self) -> int:
        return self.spec.make_layer.cache_width
