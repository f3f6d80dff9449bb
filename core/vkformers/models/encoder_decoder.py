"""transformers' EncoderDecoderModel: any registered encoder and any registered decoder that attends to it.

Core composes the two from the registry, never by importing a plugin: the config's ``encoder`` sub-config builds
its architecture's ``"base"`` model (the encoder without a head, as transformers' ``AutoModel``), the ``decoder``
sub-config the ``"cross-decoder"`` model its plugin gives (a causal LM whose layers attend to the encoder's states:
``forward(ids, attention_mask=None, encoder_hidden_states=..., encoder_attention_mask=...)`` returning
``.logits``). A plugin offers that task for the architectures its decoders take ``add_cross_attention`` for.

Parameters keep transformers' names: ``encoder.<the base model's names without its prefix>`` and
``decoder.<the causal LM's names>``. With labels and no decoder inputs the decoder reads the labels shifted right
(decoder_start_token_id first, -100 -> pad), whose pad tokens the decoder then does not attend to; the loss is the mean cross-entropy over labels != -100, as
EncoderDecoderModel computes it. ``generate`` (Seq2SeqGenerationMixin) runs the encoder once and the decoder one
token per step over the cache the decoder gives: ``encoder_decoder_cache(batch, max_len, encoder_states,
encoder_mask)``, an EncoderDecoderCache holding its self-attention keys and values and, computed once, each layer's
cross-attention keys and values, which its ``forward(..., cache=...)`` then reads and advances.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import tensor
from vkformers.errors import VkformersError
from vkformers.models.config_check import model_dtype
from vkformers.models.heads import complete_weights
from vkformers.models.inputs import InputLimits, id_array
from vkformers.models.layers import LayerNorm, Linear
from vkformers.models.lazy_weights import LazyWeights
from vkformers.models.loading import AutoModel, AutoModelForSeq2SeqLM, load_config, read_weights, resolve_checkpoint
from vkformers.models.module import Module
from vkformers.models.plugins import plugin_manager, registry
from vkformers.models.seq2seq_generation import Seq2SeqGenerationMixin
from vkformers.runtime import dtypes as dt

IGNORE_INDEX = -100
DECODER_TASK = "cross-decoder"


class UnsupportedEncoderDecoder(VkformersError, ValueError):
    """An encoder-decoder config whose encoder or decoder the registered plugins cannot compose."""


@dataclass
class EncoderDecoderOutput:
    logits: object = None
    loss: object = None
    encoder_last_hidden_state: object = None


def _sub_model(config: dict, role: str, task: str, **options) -> Module:
    sub = config.get(role)
    if not isinstance(sub, dict) or "model_type" not in sub:
        raise UnsupportedEncoderDecoder(f"encoder-decoder: the config needs an {role} sub-config with a model_type")
    architecture = registry().resolve(sub)
    if role == "decoder" and not (sub.get("is_decoder") and sub.get("add_cross_attention")):
        raise UnsupportedEncoderDecoder("encoder-decoder: the decoder config needs is_decoder and add_cross_attention "
                                        "(transformers sets both when it builds the model)")
    model_class = plugin_manager().hook.vkformers_model_class(architecture=architecture, task=task)
    if model_class is None:
        what = "an encoder's base model" if role == "encoder" else "a decoder with cross-attention"
        raise UnsupportedEncoderDecoder(f"encoder-decoder: {role} {architecture.name!r} (plugin "
                                        f"vkformers-{architecture.family}) has no {what} in vkformers yet")
    model = model_class(sub, architecture, **options)
    model.config = sub
    return model


def _width(config: dict):
    """hidden_size under the names configs give it (transformers' attribute maps: GPT-2's n_embd, T5's d_model)."""
    return next((config[key] for key in ("hidden_size", "n_embd", "d_model") if config.get(key) is not None), None)


class EncoderDecoderModel(Seq2SeqGenerationMixin, Module):
    """An encoder's base model and a decoder with cross-attention, as transformers' EncoderDecoderModel."""

    def __init__(self, config: dict, architecture=None):
        super().__init__()
        self.config, self.architecture_name, self.dtype = config, "encoder-decoder", dt.float32
        encoder = _sub_model(config, "encoder", "base", add_pooling_layer=True)
        decoder = _sub_model(config, "decoder", DECODER_TASK)
        if decoder.config.get("cross_attention_hidden_size") is not None:
            raise UnsupportedEncoderDecoder("encoder-decoder: the decoder's cross_attention_hidden_size is not "
                                            "supported; leave it unset (enc_to_dec_proj then maps the widths)")
        encoder_width, decoder_width = _width(encoder.config), _width(decoder.config)
        prefix = getattr(encoder, "base_model_prefix", "")
        if set(encoder._modules) != {prefix}:
            raise UnsupportedEncoderDecoder(f"encoder-decoder: encoder {encoder.architecture_name!r}'s base model is "
                                            "not one module under its prefix")
        # transformers' names: the base model's modules directly under encoder., the causal LM under decoder.
        self.add("encoder", encoder._modules[prefix])
        self.add("decoder", decoder)
        # widths that differ: transformers maps the encoder's states to the decoder's width
        projection = self.add("enc_to_dec_proj", Linear(encoder_width, decoder_width)) \
            if encoder_width != decoder_width else None
        object.__setattr__(self, "enc_to_dec_proj", projection)
        object.__setattr__(self, "encoder_model", encoder)   # plain references: its forward and loading
        object.__setattr__(self, "decoder_model", decoder)
        self.encoder_prefix = prefix
        self.pad_token_id = config.get("pad_token_id")
        self.decoder_start_token_id = config.get("decoder_start_token_id")

    @classmethod
    def from_pretrained(cls, name_or_path, **options) -> "EncoderDecoderModel":
        """A saved EncoderDecoderModel (its config.json has model_type encoder-decoder)."""
        model = AutoModelForSeq2SeqLM.from_pretrained(name_or_path, **options)
        if not isinstance(model, cls):
            raise UnsupportedEncoderDecoder(f"{name_or_path}: not an encoder-decoder checkpoint (model_type "
                                            f"{model.config.get('model_type')!r}); use AutoModelForSeq2SeqLM")
        return model

    @classmethod
    def from_encoder_decoder_pretrained(cls, encoder_pretrained_model_name_or_path,
                                        decoder_pretrained_model_name_or_path, *, dtype="float32",
                                        requires_grad: bool = True, revision: str | None = None, cache_dir=None,
                                        decoder_start_token_id: int | None = None, pad_token_id: int | None = None,
                                        seed: int = 0) -> "EncoderDecoderModel":
        """An encoder-decoder from two pretrained checkpoints, as transformers' method of that name: the encoder's
        base model (a checkpoint with or without its head), the decoder loaded with is_decoder and
        add_cross_attention set, its cross-attention (which its checkpoint lacks), any other missing weight and, for
        widths that differ, enc_to_dec_proj initialised as transformers does (normal(0, initializer_range), zero biases, LayerNorms at one; ``seed``),
        said on stderr. Set ``decoder_start_token_id`` and ``pad_token_id`` (transformers leaves them to the user)
        to train with labels."""
        folders = [resolve_checkpoint(path, revision=revision, cache_dir=cache_dir)
                   for path in (encoder_pretrained_model_name_or_path, decoder_pretrained_model_name_or_path)]
        encoder_config, decoder_config = (load_config(folder) for folder in folders)
        decoder_config = dict(decoder_config, is_decoder=True, add_cross_attention=True)
        config = {"model_type": "encoder-decoder", "is_encoder_decoder": True, "encoder": encoder_config,
                  "decoder": decoder_config, "decoder_start_token_id": decoder_start_token_id,
                  "pad_token_id": pad_token_id, "tie_word_embeddings": False}
        model = cls(config)
        encoder_arrays, _ = AutoModel.fit_checkpoint(model.encoder_model, read_weights(folders[0]),
                                                     f"at {encoder_pretrained_model_name_or_path}")
        prefix = model.encoder_prefix + "."
        arrays = encoder_arrays.renamed(lambda name: f"encoder.{name[len(prefix):]}" if name.startswith(prefix)
                                        else None)
        decoder_arrays = read_weights(folders[1])
        decoder = model.decoder_model
        missing = {path: module for path, module in decoder.named_modules()
                   if isinstance(module, (Linear, LayerNorm)) and any(
                       f"{path}.{slot}" not in decoder_arrays and module._slots[slot].tied_to is None
                       for slot in module._slots)}
        decoder_arrays = complete_weights(decoder, missing, decoder_arrays,
                                          f"at {decoder_pretrained_model_name_or_path}", seed=seed)
        arrays = arrays.updated(decoder_arrays.renamed(lambda name: f"decoder.{name}"))
        if model.enc_to_dec_proj is not None:  # a new projection between the two widths
            arrays = complete_weights(model, {"enc_to_dec_proj": model.enc_to_dec_proj}, arrays, seed=seed)
        model.load_state_dict(arrays, dtype=model_dtype(encoder_config, dtype), strict=False,
                              requires_grad=requires_grad)
        return model

    def load_state_dict(self, arrays, dtype="float32", strict: bool = True, requires_grad: bool = True, ignore=()):
        """Each part loads its own tensors (their renames, ties and ignored keys are its own)."""
        arrays = LazyWeights.of(arrays)
        parts = {role: arrays.renamed(lambda name, role=role: name[len(role):] if name.startswith(role) else None)
                 for role in ("encoder.", "decoder.", "enc_to_dec_proj.")}
        unexpected = [name for name in arrays if not name.startswith(tuple(parts))]
        projection = parts.pop("enc_to_dec_proj.")
        if self.enc_to_dec_proj is None:
            unexpected += [f"enc_to_dec_proj.{name}" for name in projection]
        else:
            self.enc_to_dec_proj.load_state_dict(projection, dtype=dtype, strict=strict, requires_grad=requires_grad)
        if unexpected and strict:
            raise VkformersError(f"encoder-decoder: checkpoint tensors outside encoder. and decoder.: "
                                 f"{', '.join(unexpected[:8])}")
        encoder_arrays = parts["encoder."].renamed(lambda name: f"{self.encoder_prefix}.{name}")
        for model, part in ((self.encoder_model, encoder_arrays), (self.decoder_model, parts["decoder."])):
            model.load_state_dict(part, dtype=dtype, strict=strict, requires_grad=requires_grad,
                                  ignore=getattr(model, "ignored_checkpoint_keys", ()))
        self.dtype = dt.as_dtype(dtype)

    def input_limits(self) -> InputLimits:
        encoder, decoder = self.encoder_model.input_limits(), self.decoder_model.input_limits()
        return InputLimits(vocab_size=encoder.vocab_size, decoder_vocab_size=decoder.vocab_size,
                           label_classes=decoder.vocab_size, max_length=encoder.max_length,
                           decoder_max_length=decoder.max_length, labels_like="decoder_input_ids",
                           one_dimensional_ok=True)

    # -- pieces

    def encode(self, input_ids, attention_mask=None):
        """The encoder's last hidden state [B, S, hidden]."""
        return self.encoder_model.encode(id_array(input_ids), None if attention_mask is None else id_array(attention_mask))

    def to_decoder_width(self, encoder_states):
        """The encoder's states as the decoder's cross-attention reads them (through enc_to_dec_proj where the widths
        differ)."""
        return encoder_states if self.enc_to_dec_proj is None else self.enc_to_dec_proj(encoder_states)

    def decode(self, decoder_ids, encoder_states, encoder_mask=None, decoder_mask=None):
        """Logits [B, T, vocab] of the decoder tokens, attending to the encoder's states (and, with ``decoder_mask``,
        not to the decoder tokens it marks 0)."""
        return self.decoder_model.forward(id_array(decoder_ids), attention_mask=decoder_mask,
                                          encoder_hidden_states=encoder_states,
                                          encoder_attention_mask=encoder_mask).logits

    def shift_right(self, labels: np.ndarray) -> np.ndarray:
        """transformers' shift_tokens_right: decoder_start_token_id first, -100 replaced by pad."""
        if self.decoder_start_token_id is None or self.pad_token_id is None:
            raise VkformersError("encoder-decoder: the config needs decoder_start_token_id and pad_token_id to shift "
                                 "labels into decoder inputs")
        shifted = np.empty_like(labels)
        shifted[:, 1:] = labels[:, :-1]
        shifted[:, 0] = self.decoder_start_token_id
        return np.where(shifted == IGNORE_INDEX, self.pad_token_id, shifted)

    # -- forward

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, labels=None,
                decoder_attention_mask=None, encoder_outputs=None):
        mask = None if attention_mask is None else id_array(attention_mask)
        if decoder_attention_mask is not None and not id_array(decoder_attention_mask).all():
            raise VkformersError("decoder_attention_mask with zeros is not supported (the decoder attends causally "
                                 "to every decoder token)")
        label_array = None if labels is None else id_array(labels)
        decoder_mask = None
        if decoder_input_ids is not None:
            decoder_ids = id_array(decoder_input_ids)
        elif label_array is not None:
            decoder_ids = self.shift_right(label_array)
            # transformers then hides the pad decoder tokens (the shifted -100s) from the decoder's attention
            if decoder_attention_mask is None and (decoder_ids == self.pad_token_id).any():
                decoder_mask = (decoder_ids != self.pad_token_id).astype(np.int64)
        else:
            raise VkformersError("encoder-decoder: give decoder_input_ids or labels")
        encoder_states = encoder_outputs if encoder_outputs is not None else self.encode(input_ids, mask)
        logits = self.decode(decoder_ids, self.to_decoder_width(encoder_states), mask, decoder_mask)
        loss = None
        if label_array is not None:
            loss = F.cross_entropy(logits.float(), tensor(label_array.astype(np.int32)), ignore_index=IGNORE_INDEX)
        return EncoderDecoderOutput(logits=logits, loss=loss, encoder_last_hidden_state=encoder_states)

    # -- generation (Seq2SeqGenerationMixin's loop)

    def generation_configs(self) -> tuple:
        return (*super().generation_configs(), self.decoder_model.config)

    def generation_encoder_states(self, ids: np.ndarray, mask: np.ndarray):
        return self.to_decoder_width(self.encode(ids, mask)).realize()

    def generation_cache(self, batch: int, max_len: int, encoder_states, mask: np.ndarray):
        decoder = self.decoder_model
        if not hasattr(decoder, "encoder_decoder_cache"):
            raise UnsupportedEncoderDecoder(f"encoder-decoder: decoder {decoder.architecture_name!r} keeps no "
                                            "generation cache (encoder_decoder_cache) in vkformers yet")
        return decoder.encoder_decoder_cache(batch, max_len, encoder_states, mask)

    def generation_step(self, ids: np.ndarray, encoder_states, mask: np.ndarray, cache):
        return self.decoder_model.forward(ids, encoder_hidden_states=encoder_states, encoder_attention_mask=mask,
                                          cache=cache).logits
