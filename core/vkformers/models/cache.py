"""``KVCache``: per-layer keys and values kept on the device between forward passes.

Each layer owns two persistent tensors ``[batch, kv_heads, max_len, head_dim]`` in the
model dtype. An attention layer hands its new (already rotated) projections to
:meth:`KVCache.attend`, which records the cache write and the attention in the forward's
graph, and the model calls :meth:`KVCache.advance` once all layers ran::

    out = cache.attend(layer_index, q, k, v, scale=..., key_padding_mask=attention_mask)
    ...
    cache.advance(T)

The write position and the number of valid keys travel to the GPU as a small uint32
tensor uploaded with each step, and the key padding mask always spans ``max_len``, so every
decode step (one new token) builds the same graph: it is recorded once and replayed for
every later token.

The cache keeps a host copy of the attention mask over the positions it stores (1 = attend,
0 = padding). ``key_padding_mask`` given to ``attend`` may cover every stored position plus
the new ones (``[batch, position + T]``, the way Hugging Face's ``generate`` grows
``attention_mask``) or only the new tokens (``[batch, T]``); None means the new tokens are all
real. Pass it as numpy (or a tensor made from numpy): the cache reads it on the host.
"""
from __future__ import annotations

import math

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.lazy import realize
from vkformers.engine.ops.cache import decode_attention, write_kv
from vkformers.engine.tensor import Tensor, parameter, tensor, zero_parameter
from vkformers.errors import VkformersError
from vkformers.runtime import dtypes as dt
from vkformers.runtime.vulkan import Device, get_device


class CacheFullError(VkformersError, ValueError):
    """More tokens than the cache was created for."""


class RowStateError(VkformersError, ValueError):
    """A cache holding layer state besides keys and values asked to move rows."""


class CropError(VkformersError, ValueError):
    """A cache asked to forget tokens it cannot: more than it stores, or held in a recurrent layer state."""


# Layer state that lives per row and holds everything a row's tokens left behind (a recurrent state-space or
# linear-attention state: conv inputs and scan state): a dict {layer: tensors [batch, ...] or tuples of them} on the
# cache, which place_row moves row by row beside the keys and values. Other layer state (an indexer's keys, laid
# out by column) cannot move so.
ROW_STATES = {"linear_states"}


def register_row_state(name: str) -> None:
    """Declare the cache attribute ``name`` a per-row recurrent state (see ROW_STATES)."""
    ROW_STATES.add(name)


class InPlaceRowStates(dict):
    """A ROW_STATES mapping {layer: state} whose tensors live in persistent buffers, one per layer and part,
    overwritten in place by every write (``assign``): each decode step then reads and writes the same buffers, so
    that a batch's decode step can be recorded and replayed (models/decode_capture.py) as the keys and values' is.
    A layer restarting (popping its entry at position 0) hides the entry; its buffers take the next write."""

    def __init__(self, device: Device):
        super().__init__()
        self.device = device
        self._buffers: dict = {}

    def __setitem__(self, layer, value) -> None:
        stored = self._store(self._buffers.get(layer), value)
        self._buffers[layer] = stored
        super().__setitem__(layer, stored)

    def _store(self, held, value):
        if isinstance(value, (tuple, list)):
            held = held if isinstance(held, (tuple, list)) and len(held) == len(value) else [None] * len(value)
            return type(value)(self._store(h, v) for h, v in zip(held, value))
        if value is None:
            return None
        if held is None or tuple(held.shape) != tuple(value.shape) or held.dtype != value.dtype:
            held = zero_parameter(value.shape, value.dtype, self.device, "row_state")
        return held.assign(value)


class KVCache:
    paged = False  # PagedKVCache (models/paged_cache.py): keys and values in blocks, not [batch, kv_heads, max_len, dim]
    # True where the caller's padding only lays rows out in columns (a server's batch, models/batching.py): a model
    # whose layers otherwise run padding as tokens, as transformers' RWKV does, leaves it out of their state then
    padding_is_layout = False
    # True: a forward of several tokens after stored ones (assisted generation's verification of a draft) attends as
    # a decode step does, over the whole capacity with the stored count read on the GPU, so that its graph is the
    # same at every position and replays; False: over the stored keys sliced to their count (prefill kernels)
    chunks_replay = False

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype="float32", device: Device | None = None):
        for name, value in (("num_layers", num_layers), ("batch", batch), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("max_len", max_len)):
            if int(value) < (0 if name == "num_layers" else 1):  # no layers: a model of recurrent state only
                raise ValueError(f"KVCache: {name} must be >= 1, got {value}")
        self.num_layers, self.batch, self.kv_heads = int(num_layers), int(batch), int(kv_heads)
        self.head_dim, self.max_len = int(head_dim), int(max_len)
        self.dtype = dt.as_dtype(dtype)
        self.device = device or get_device()
        zeros = np.zeros((self.batch, self.kv_heads, self.max_len, self.head_dim), np.float32)
        self.keys = [parameter(zeros, self.dtype, requires_grad=False, device=self.device, name=f"k_cache.{i}")
                     for i in range(self.num_layers)]
        self.values = [parameter(zeros, self.dtype, requires_grad=False, device=self.device, name=f"v_cache.{i}")
                       for i in range(self.num_layers)]
        self.mask = np.ones((self.batch, self.max_len), np.uint8)  # host copy: 1 = attend
        self.position = 0
        self._step = None  # the current forward's device inputs, shared by its layers (and a dict of more)
        self.step_hosts = (None, None)  # host arrays of the last forward's bounds and mask leaves
        self._own_fields = frozenset(self.__dict__) | {"_own_fields"}

    def layer_state(self) -> list[str]:
        """Names of what a model's layers keep on this cache besides keys and values (a linear-attention or
        state-space layer's recurrent state, an indexer's keys): state that :meth:`place_row` cannot move."""
        return sorted(name for name, value in self.__dict__.items()
                      if name not in self._own_fields and name not in ("padding_is_layout", "chunks_replay")
                      and not (isinstance(value, InPlaceRowStates) and not value))

    def keep_states_in_place(self) -> None:
        """Keep the per-row recurrent states (ROW_STATES) the layers write in persistent buffers overwritten in
        place (InPlaceRowStates), so that decode steps on this cache build the same graph, reading and writing the
        same buffers: a server's batch and generate then replay them. States already held move into such buffers."""
        for name in ROW_STATES:
            held = self.__dict__.get(name)
            if not isinstance(held, InPlaceRowStates):
                states = self.__dict__[name] = InPlaceRowStates(self.device)
                for layer, value in (held or {}).items():
                    states[layer] = value

    def fixed_state(self) -> list[str]:
        """The layer state :meth:`place_row` cannot move (not a per-row recurrent state, ROW_STATES)."""
        return [name for name in self.layer_state() if name not in ROW_STATES]

    def check_place(self, source: "KVCache", source_row: int, row: int, rows: int) -> None:
        """What :meth:`place_row` refuses: rows or tokens that do not fit, another cache layout, and caches holding
        layer state that is not a per-row recurrent state (rows move keys, values and those)."""
        state = source.fixed_state() or self.fixed_state()
        if state:
            raise RowStateError(f"{type(self).__name__}.place_row: the model keeps {', '.join(state)} on its cache "
                                "besides keys and values, which rows cannot be moved with")
        count, end = source.position, self.position
        if not (0 <= row and row + rows <= self.batch and 0 <= source_row and source_row + rows <= source.batch
                and rows >= 1 and count <= end) or (source.num_layers, source.kv_heads, source.head_dim,
                                                    source.dtype) != (self.num_layers, self.kv_heads, self.head_dim,
                                                                      self.dtype):
            raise ValueError(f"{type(self).__name__}.place_row: {count} tokens of rows {source_row}.."
                             f"{source_row + rows - 1} do not fit rows {row}.. of a cache at position {end}")

    def reset(self) -> None:
        """Forget the stored tokens (the buffers stay allocated and are overwritten)."""
        self.position = 0
        self.mask[:] = 1  # ones past the stored tokens: chained decode steps (decode_capture.py) rely on it
        self._step = None

    def advance(self, count: int) -> None:
        """Called by the model once per forward, after every layer attended: ``count`` tokens are stored."""
        if self.position + count > self.max_len:
            raise CacheFullError(f"KVCache: {self.position} + {count} tokens exceed max_len {self.max_len}")
        self.position += int(count)
        self._step = None

    def rewind(self, count: int) -> None:
        """Forget the last ``count`` stored tokens (a prompt padded on the right for a reusable prefill: the
        padding's keys stay in the buffers and are overwritten by the tokens generated next)."""
        if not 0 <= count <= self.position:
            raise ValueError(f"KVCache: cannot rewind {count} of {self.position} stored tokens")
        self.position -= int(count)
        self._step = None

    def crop(self, length: int) -> None:
        """Keep the first ``length`` stored tokens and forget the rest, as transformers' ``DynamicCache.crop``: a
        negative ``length`` forgets that many, one at or beyond the stored count changes nothing; the draft tokens a
        verification rejected. Their keys stay in the buffers until new tokens overwrite them. Refused where layers
        keep a recurrent state on the cache, which holds every token it saw."""
        state = self.layer_state()
        if state:
            raise CropError(f"{type(self).__name__}.crop: the model keeps {', '.join(state)} on its cache besides "
                            "keys and values, which cannot forget tokens")
        length = int(length)
        if length < 0:
            length += self.position
        if length < 0:
            raise CropError(f"{type(self).__name__}.crop: cannot forget {self.position - length} of "
                            f"{self.position} stored tokens")
        if length < self.position:
            self.rewind(self.position - length)

    def place_row(self, source: "KVCache", source_row: int, row: int, rows: int = 1) -> None:
        """Make ``row`` (and the ``rows - 1`` after it) hold ``source``'s stored tokens of ``source_row`` (and the
        rows after it): keys, values and mask, ending at this cache's position. A sequence prefilled apart joins a
        running batch so; a batch moves to a larger cache so. The rows' earlier columns are masked out. The copy
        runs with the next realization."""
        self.check_place(source, source_row, row, rows)
        count, end = source.position, self.position
        start = tensor(np.array([end - count], np.uint32), dtype=dt.uint32, device=self.device)
        picked = slice(source_row, source_row + rows)
        for layer in range(self.num_layers):
            write_kv(self.keys[layer], self.values[layer], source.keys[layer][picked, :, :count],
                     source.values[layer][picked, :, :count], start, first_row=row)
        self.mask[row:row + rows, :end - count] = 0
        self.mask[row:row + rows, end - count:end] = source.mask[picked, :count]
        self.place_states(source, source_row, row, rows)
        self._step = None

    def reorder_rows(self, rows) -> None:
        """Make each row ``i`` hold what row ``rows[i]`` holds now (keys, values and mask): beam search following
        its beams from one step to the next. The copies run now (a replayed decode step reads the buffers)."""
        state = self.layer_state()
        if state:
            raise RowStateError(f"{type(self).__name__}.reorder_rows: the model keeps {', '.join(state)} on its cache "
                                "besides keys and values, which rows cannot be reordered with")
        rows = np.asarray(rows, np.int64)
        if rows.shape != (self.batch,) or rows.min() < 0 or rows.max() >= self.batch:
            raise ValueError(f"{type(self).__name__}.reorder_rows: {rows.shape[0]} rows of 0..{self.batch - 1} needed")
        if (rows == np.arange(self.batch)).all():
            return
        index = tensor(rows.astype(np.int32), dtype=dt.int32, device=self.device)
        for held in (*self.keys, *self.values):
            held.assign(F.embedding(index, held.reshape(self.batch, -1)).reshape(held.shape))
        realize([held.lazy for held in (*self.keys, *self.values)])
        self.mask[:] = self.mask[rows]
        self._step = None

    def place_states(self, source: "KVCache", source_row: int, row: int, rows: int) -> None:
        """place_row's move of the per-row recurrent states (ROW_STATES) of ``source``'s rows into ``row``..: a
        state holds all its row's tokens, wherever they sit in the columns."""
        for name in source.layer_state():
            held = self.__dict__.setdefault(name, {})
            for layer, value in source.__dict__[name].items():
                held[layer] = self._place_state(held.get(layer), value, source_row, row, rows)

    def _place_state(self, held, value, source_row: int, row: int, rows: int):
        if isinstance(value, (tuple, list)):
            held = held if isinstance(held, (tuple, list)) and len(held) == len(value) else [None] * len(value)
            return type(value)(self._place_state(h, v, source_row, row, rows) for h, v in zip(held, value))
        if value is None:
            return held
        shape = (self.batch, *value.shape[1:])
        if held is None or tuple(held.shape) != shape or held.dtype != value.dtype:
            held = tensor(np.zeros(shape, np.float32), dtype=value.dtype, device=self.device)
        parts = [held[:row], value[source_row:source_row + rows], held[row + rows:]]
        parts = [part for part in parts if part.shape[0]]
        return F.cat(parts, 0) if len(parts) > 1 else parts[0]

    # -- one forward's inputs

    def step_arrays(self, new: int, key_padding_mask=None):
        """Host values of one forward's cache inputs: ``[start, end]`` as uint32, and the key padding mask
        as bool (spanning max_len for a decode step, None when every key is attended). Stores the new
        tokens' mask. A captured decode step (generation.py) writes these into its recorded plan."""
        start, end = self.position, self.position + new
        if end > self.max_len:
            raise CacheFullError(f"KVCache: {start} stored + {new} new tokens exceed max_len {self.max_len}")
        self._store_mask(start, end, key_padding_mask)
        mask = None
        if not self.mask[:, :end].all():
            # decode: the mask spans max_len, so that every decode step has the same graph signature
            mask = (self.mask if self._attends_as_decode(new) else self.mask[:, :end]).astype(bool)
        return np.array([start, end], np.uint32), mask

    def _attends_as_decode(self, new: int) -> bool:
        """Whether a forward of ``new`` tokens attends over the whole capacity, the stored count read on the GPU."""
        return new == 1 or (self.chunks_replay and self.position > 0)

    def step_inputs(self, new: int, key_padding_mask=None):
        """([start, end] as a uint32 tensor, device mask or None) for this forward, built by its first attend()."""
        if self._step is not None and self._step[0] == new:
            return self._step[1], self._step[2]
        bounds, mask = self.step_arrays(new, key_padding_mask)
        bounds = tensor(bounds, dtype=dt.uint32, device=self.device)
        mask = None if mask is None else tensor(mask, device=self.device)
        self._step = (new, bounds, mask, {})
        # the arrays the input leaves hold, for generation to recognise them in the recorded plan
        self.step_hosts = (bounds.lazy.base.host, None if mask is None else mask.lazy.base.host)
        return bounds, mask

    def _store_mask(self, start: int, end: int, key_padding_mask) -> None:
        if key_padding_mask is None:
            self.mask[:, start:end] = 1
            return
        mask = (_host_array(key_padding_mask) != 0).astype(np.uint8)
        if mask.ndim != 2 or mask.shape[0] != self.batch or mask.shape[1] not in (end - start, end):
            raise ValueError(f"KVCache: key_padding_mask must be [batch, new tokens] ({self.batch}, {end - start}) "
                             f"or [batch, stored + new] ({self.batch}, {end}), got {mask.shape}")
        self.mask[:, end - mask.shape[1]:end] = mask

    # -- the attention layer's call

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, window: int = 0,
               softcap: float = 0.0, alibi_slopes: Tensor | None = None, key_padding_mask=None,
               return_lse: bool = False):
        """Store k, v ([B, KVH, T, D]) at the current position; attention of q ([B, H, T, D]) over all stored keys.

        T == 1 runs the decode kernel (kv_len read on the GPU); T > 1 (prefill) runs causal attention,
        over the new keys alone when the cache was empty and over the stored ones plus the new ones
        otherwise. Returns [B, H, T, D] (and with ``return_lse`` each row's logsumexp, float32 [B, H, T]).
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"KVCache: layer {layer} out of range 0..{self.num_layers - 1}")
        batch, heads, new, head_dim = q.shape
        expected = (self.batch, self.kv_heads, new, self.head_dim)
        if k.shape != expected or v.shape != expected or batch != self.batch or head_dim != self.head_dim:
            raise ValueError(f"KVCache.attend: q {q.shape}, k {k.shape}, v {v.shape} do not fit the cache "
                             f"(k and v must be {expected})")
        bounds, mask = self.step_inputs(new, key_padding_mask)
        k_cache, v_cache = self.keys[layer], self.values[layer]
        write_kv(k_cache, v_cache, k, v, bounds[0:1])
        if self._attends_as_decode(new):
            return self.attend_stored(layer, q, scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                      key_padding_mask=key_padding_mask, return_lse=return_lse)
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        flags = dict(scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes, key_padding_mask=mask,
                     return_lse=return_lse)
        if self.position == 0:  # prefill into an empty cache: the new keys are all there is
            return F.scaled_dot_product_attention(q, k.cast(self.dtype), v.cast(self.dtype), causal=True, **flags)
        end = self.position + new  # chunked prefill: the stored keys and the new ones, read from the cache
        return F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], causal=True, **flags)

    def attend_stored(self, layer: int, q: Tensor, *, scale: float | None = None, window: int = 0,
                      softcap: float = 0.0, alibi_slopes: Tensor | None = None, key_padding_mask=None,
                      return_lse: bool = False):
        """Decode attention of q ([B, H, T, D]: one new token, or several with ``chunks_replay``) over the stored
        keys, the new tokens' included (from ``step_inputs(T)[0][0]`` on: written by attend(), or by the layer
        itself, as a fused projection does, engine/ops/decode.py)."""
        bounds, mask = self.step_inputs(q.shape[2], key_padding_mask)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return decode_attention(q, self.keys[layer], self.values[layer], bounds[1:2], scale=scale, window=window,
                                softcap=softcap, alibi_slopes=alibi_slopes, key_padding_mask=mask,
                                return_lse=return_lse)


class EncoderDecoderCache(KVCache):
    """An encoder-decoder's decoder cache: the self-attention keys and values (this KVCache), and ``cross``, each
    decoder layer's cross-attention keys and values over the encoder's states, computed once per generation
    (:meth:`fill_cross`), so that every decode step builds the same graph and replays one recorded plan."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int, dtype="float32",
                 device: Device | None = None, encoder_states=None, encoder_mask: np.ndarray | None = None):
        self.encoder_states, self.encoder_mask = encoder_states, encoder_mask
        self.cross: list = []
        super().__init__(num_layers, batch, kv_heads, head_dim, max_len, dtype, device)

    def fill_cross(self, keys_values) -> None:
        """Store each layer's (keys, values) of the encoder's states ([batch, heads, sources, head_dim] each), all
        computed in one submission."""
        self.cross = [tuple(t.contiguous() for t in pair) for pair in keys_values]
        realize([t.lazy for pair in self.cross for t in pair])


def _host_array(mask) -> np.ndarray:
    """``mask`` as numpy. A tensor made from host data is read from that data without a realization:
    realizing here would also run the cache writes already pending, splitting the step's graph."""
    if not isinstance(mask, Tensor):
        return np.asarray(mask)
    base, view = mask.lazy.base, mask.lazy.view
    if base.node is None and base.host is not None:
        flat = base.host.reshape(-1)
        return np.lib.stride_tricks.as_strided(flat[view.offset:], shape=view.shape,
                                               strides=tuple(s * flat.itemsize for s in view.strides)).copy()
    return mask.numpy()
