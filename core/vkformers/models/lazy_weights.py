"""Checkpoint weights read when they are used, one tensor at a time.

A :class:`LazyWeights` is a ``Mapping`` of name -> numpy array whose values are read (from the memory-mapped file,
widened, dequantized or packed) on each lookup and never kept: ``load_state_dict`` reads a tensor, uploads it and
drops it, so loading a checkpoint holds about one tensor in host memory, not the model. What loading does to a
checkpoint before that (renames, dropped tensors, a family's fused splits or stacked experts, quantization) acts on
the names and wraps the readers (:meth:`LazyWeights.renamed`, :meth:`LazyWeights.updated`, :func:`concatenated`,
:func:`stacked`, ...): nothing is read until a tensor is uploaded.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Iterator, Mapping

import numpy as np


class Weight:
    """One tensor not read yet: its shape (None where it is known only once read) and a function reading it;
    ``read_bfloat16``, where the file stores bfloat16: its bits (uint16) as ``to_bfloat16(read())`` would give
    them, without the float32 copy (a bfloat16 model loads from a bfloat16 file at half the host memory)."""

    __slots__ = ("shape", "read", "read_bfloat16")

    def __init__(self, shape, read: Callable[[], object], read_bfloat16: Callable[[], np.ndarray] | None = None):
        self.shape = None if shape is None else tuple(int(s) for s in shape)
        self.read = read
        self.read_bfloat16 = read_bfloat16

    @classmethod
    def of(cls, array) -> "Weight":
        """An array already in memory."""
        shape = getattr(array, "shape", None)
        return cls(shape, partial(_same, array))

    def converted(self, convert: Callable[[object], object], shape="same") -> "Weight":
        """This tensor as ``convert`` turns it when read; ``shape``: the result's, if not this one's."""
        return Weight(self.shape if shape == "same" else shape, partial(_apply, convert, self.read))


def _same(array):
    return array


def _apply(convert, read):
    return convert(read())


class LazyWeights(Mapping):
    """name -> array, each read (and converted) when looked up; iterating, ``in`` and :meth:`shape` read nothing.
    The derived mappings share the readers: none of them reads either."""

    def __init__(self, weights: Mapping[str, Weight] | None = None):
        self._weights = dict(weights or {})

    @classmethod
    def of(cls, arrays: Mapping) -> "LazyWeights":
        """``arrays`` as LazyWeights: as it is, or a dict's arrays (already in memory) or another mapping's
        values looked up when read."""
        if isinstance(arrays, LazyWeights):
            return arrays
        if isinstance(arrays, dict):
            return cls({name: Weight.of(array) for name, array in arrays.items()})
        return cls({name: Weight(None, partial(arrays.__getitem__, name)) for name in arrays})

    def __getitem__(self, name: str):
        return self._weights[name].read()

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def __contains__(self, name) -> bool:
        return name in self._weights

    def __repr__(self) -> str:
        return f"<LazyWeights of {len(self)} tensors>"

    def read_for(self, name: str, dtype) -> object:
        """Tensor ``name`` as it is uploaded in ``dtype`` (a vkformers DType): bfloat16 bits where the file stores
        bfloat16 and ``dtype`` is bfloat16, else as ``self[name]`` reads it."""
        weight = self._weights[name]
        if weight.read_bfloat16 is not None and getattr(dtype, "name", None) == "bfloat16":
            return weight.read_bfloat16()
        return weight.read()

    def weight(self, name: str) -> Weight:
        """The unread tensor ``name``."""
        return self._weights[name]

    def known_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of ``name`` where it is known without reading it."""
        return self._weights[name].shape

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of ``name`` (read once to learn it where unknown)."""
        shape = self._weights[name].shape
        return tuple(np.shape(self[name])) if shape is None else shape

    def renamed(self, rename: Callable[[str], str | None]) -> "LazyWeights":
        """Each tensor under ``rename(name)``, those it maps to None left out; a later tensor renamed onto an
        earlier one's name replaces it, as in a dict."""
        out = {}
        for name, weight in self._weights.items():
            new = rename(name)
            if new is not None:
                out[new] = weight
        return LazyWeights(out)

    def filtered(self, keep: Callable[[str], bool]) -> "LazyWeights":
        """The tensors whose names ``keep`` holds."""
        return LazyWeights({name: w for name, w in self._weights.items() if keep(name)})

    def updated(self, weights: Mapping) -> "LazyWeights":
        """These tensors with ``weights`` added or put in place (Weights, LazyWeights' tensors or arrays)."""
        out = dict(self._weights)
        if isinstance(weights, LazyWeights):
            out.update(weights._weights)
        else:
            out.update((name, w if isinstance(w, Weight) else Weight.of(w)) for name, w in weights.items())
        return LazyWeights(out)

    def without(self, names) -> "LazyWeights":
        names = set(names)
        return self.filtered(lambda name: name not in names)

    def converted(self, convert: Callable[[str, object], object]) -> "LazyWeights":
        """Each tensor as ``convert(name, array)`` returns it when read (the same shape)."""
        return LazyWeights({name: w.converted(partial(convert, name)) for name, w in self._weights.items()})


def concatenated(parts: list[Weight], axis: int = 0) -> Weight:
    """``np.concatenate`` of ``parts`` along ``axis``, read when it is."""
    shape = None
    if all(p.shape is not None for p in parts):
        shape = list(parts[0].shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
    return Weight(shape, partial(_concatenate, tuple(parts), axis))


def _concatenate(parts, axis):
    return np.concatenate([np.asarray(p.read()) for p in parts], axis=axis)


def stacked(parts: list[Weight]) -> Weight:
    """``np.stack`` of ``parts`` (a new first axis), read when it is: each part is written into the result as it
    is read, so only the result and one part are in memory at once."""
    shape = None if parts[0].shape is None else (len(parts), *parts[0].shape)
    return Weight(shape, partial(_stack, tuple(parts)))


def _stack(parts):
    first = np.asarray(parts[0].read())
    out = np.empty((len(parts), *first.shape), first.dtype)
    out[0] = first
    del first
    for i, part in enumerate(parts[1:], 1):
        array = np.asarray(part.read())
        if array.shape != out.shape[1:]:
            raise ValueError(f"stacking tensors of shapes {out.shape[1:]} and {array.shape}")
        out[i] = array
    return out


__all__ = ["LazyWeights", "Weight", "concatenated", "stacked"]
