"""The shared model of the state-space variants (``vkformers_ssm/variants.py``: Mamba, Falcon-Mamba, Mamba-2)
under Hugging Face's parameter names (backbone.embeddings, backbone.layers.N.norm / .mixer.*, backbone.norm_f,
lm_head), and :class:`HybridForCausalLM`, the decoder kit's model for the hybrids (Bamba, Falcon-H1, Nemotron-H,
Jamba, GraniteMoeHybrid). The mixers themselves are ``vkformers_ssm/mixers.py``.

In a 16-bit model the residual stream is float32 where the config says residual_in_fp32 (transformers' order of
roundings: see MambaBlock.forward); the scans run in float32 from 16-bit inputs.

Generation keeps, per layer, the last kernel - 1 inputs of the conv and the scan's state on a KV cache without
key/value layers (``attention_free``; a hybrid's on its KV cache), in persistent buffers overwritten in place
(KVCache.keep_states_in_place); a decode step is the same forward over one token from those states, recorded once by
generate and replayed (models/decode_capture.py), as a server's batch does.
"""
from __future__ import annotations

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.errors import VkformersError
from vkformers.models.decoder import DecoderForCausalLM
from vkformers.models.generation import GenerationMixin, kept_positions
from vkformers.models.inputs import InputLimits
from vkformers.models.layers import Embedding, Linear, ModuleList, RMSNorm
from vkformers.models.lazy_weights import LazyWeights
from vkformers.models.lm_loss import causal_lm_loss, target_count
from vkformers.models.loading import CausalLMOutput
from vkformers.models.module import Module
from vkformers.runtime import dtypes as dt

from vkformers_ssm.mixers import CacheStates, Mamba2Mixer, MambaMixer
from vkformers_ssm.variants import MambaSpec, mamba_spec



class MambaBlock(Module):
    def __init__(self, spec: MambaSpec):
        super().__init__()
        self.residual_in_fp32 = spec.residual_in_fp32
        self.norm = RMSNorm(spec.hidden_size, eps=spec.norm_eps)
        self.mixer = Mamba2Mixer(spec) if spec.mamba2 else MambaMixer(spec)

    def forward(self, h, keep, cache, index):
        """h: the residual stream, float32 after the first block of a 16-bit model with residual_in_fp32 (as
        transformers: the norm reads it rounded to the weights' dtype, the mixer's output adds to it in float32)."""
        out = self.mixer(self.norm(h.cast(self.norm.weight.dtype)), keep, cache, index)
        if self.residual_in_fp32:
            return h.float() + out.float()
        return h + out


class MambaBackbone(Module):
    def __init__(self, spec: MambaSpec):
        super().__init__()
        self.embeddings = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = ModuleList(MambaBlock(spec) for _ in range(spec.num_layers))
        self.norm_f = RMSNorm(spec.hidden_size, eps=spec.norm_eps)


class MambaForCausalLM(Module, GenerationMixin):
    """Mamba and its variants (:data:`vkformers_ssm.variants.VARIANTS`)."""

    supports_gradient_checkpointing = True
    max_position_embeddings = 1 << 30  # no position table: generate may capture decode steps at any length
    # no keys or values: its states ride per row on a KVCache of no key/value layers (generate's, a server's batch)
    attention_free = True
    accepts_logits_to_keep = True

    def __init__(self, config: dict, architecture):
        super().__init__()
        name = getattr(architecture, "name", architecture)
        self.config, self.architecture_name = config, name
        self.spec = mamba_spec(config, name)
        self.dtype = dt.float32  # from_pretrained sets the loaded dtype
        self.backbone = MambaBackbone(self.spec)
        object.__setattr__(self, "embed", self.backbone.embeddings)  # the token table, as the shared decoder names it
        self.lm_head = Linear(self.spec.hidden_size, self.spec.vocab_size, bias=False)
        if self.spec.tie_embeddings:
            self.tie("lm_head.weight", "backbone.embeddings.weight")

    def load_state_dict(self, arrays, *args, **kwargs):
        # early checkpoints name the table backbone.embedding (transformers renames it on load too)
        arrays = LazyWeights.of(arrays).renamed(lambda n: n.replace("backbone.embedding.", "backbone.embeddings."))
        super().load_state_dict(arrays, *args, **kwargs)

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    def input_limits(self) -> InputLimits:
        return InputLimits(vocab_size=self.spec.vocab_size)

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None, cache=None, logits_to_keep=0):
        ids = input_ids if isinstance(input_ids, Tensor) else Tensor(np.asarray(input_ids, dtype=np.int32))
        if ids.dtype is not dt.int32:
            ids = ids.cast(dt.int32)
        length = ids.shape[1]
        mask = attention_mask.numpy() if isinstance(attention_mask, Tensor) else attention_mask
        keep = None
        if mask is not None:
            mask = np.asarray(mask)[:, -length:]
            if not mask.all():
                keep = Tensor(mask.astype(np.float32)[:, :, None])
        x = self.backbone.embeddings(ids)
        if keep is not None:
            keep = keep.cast(x.dtype)
        states = CacheStates(cache) if cache is not None else None
        count = len(self.backbone.layers)
        per_part = self.layers_per_part(x, count)
        for index, layer in enumerate(self.backbone.layers):
            x = self.call_layer(layer, x, keep, states, index)
            self.submit_part(x, index + 1, count, per_part)
        x = kept_positions(x, logits_to_keep)
        norm_f = self.backbone.norm_f
        if x.dtype is norm_f.weight.dtype:
            x = norm_f(x)
        else:  # a float32 residual stream: normalised in float32 (the weight widened), then rounded for lm_head
            x = F.rms_norm(x, None, eps=norm_f.eps) * norm_f.weight.float()
        logits = self.lm_logits(x)
        if labels is not None and logits.shape[1] != length:
            raise VkformersError("labels need the logits of every position: leave logits_to_keep at 0")
        if cache is not None:
            cache.advance(length)
        loss = None
        if labels is not None:  # transformers' ForCausalLMLoss in float32, in chunks of tokens at a large vocabulary
            loss = causal_lm_loss(x, self.lm_logits, labels, logits=logits, widen=True)
        return CausalLMOutput(logits=logits, loss=loss)

    def loss_target_count(self, labels) -> int:
        return target_count(labels)

    def lm_logits(self, x):
        """Final hidden states -> logits (lm_head in its dtype)."""
        return self.lm_head(x.cast(self.lm_head.weight.dtype))


class HybridForCausalLM(DecoderForCausalLM):
    """The decoder kit's causal LM over this plugin's hybrid variants (attention and Mamba layers,
    ``vkformers_ssm/variants.py``); their state-space layers are :class:`~vkformers_ssm.mixers.HybridMamba2Mixer`."""

    decoder_spec = staticmethod(mamba_spec)
    keeps_row_states = True  # the mixers' states (ssm_states), also in layers the spec composes itself

    def __init__(self, config: dict, architecture):
        super().__init__(config, architecture)
        # the mixers' states live on the cache, read and overwritten by each step: replayed only where they stay in
        # persistent buffers (capture_decode_with_row_states, which generate's and a server's caches keep)
        self.capture_decode = False
