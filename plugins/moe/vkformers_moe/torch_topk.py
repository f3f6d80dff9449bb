"""Which entries torch.topk (CPU, largest) keeps when scores tie at the cut, on the host.

Indexers choose their top-k blocks or entries with torch.topk, whose choice among equal scores is not "lowest index
first" but whatever its selection algorithm leaves in front: per row, libstdc++'s std::nth_element over
(score, index) pairs compared by score alone (std::partial_sort where k * 64 <= n), as ATen's topk_impl_loop does.
Ties are not rare there: in a left-padded row every pad token has the same key, so blocks of padding score alike.
:func:`topk_mask` gives the same set: rows without a tie at the cut are vectorised, the others replay the algorithm.
"""
from __future__ import annotations

import numpy as np


def topk_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """bool mask over the last axis of ``scores``: the k entries torch.topk(scores, k) returns (no NaN)."""
    scores = np.asarray(scores)
    n = scores.shape[-1]
    if k >= n:
        return np.ones(scores.shape, bool)
    if k <= 0:
        return np.zeros(scores.shape, bool)
    rows = scores.reshape(-1, n)
    cut = -np.partition(-rows, k - 1, axis=-1)[:, k - 1:k]  # the k-th largest score per row
    mask = rows > cut
    ties = rows == cut
    # rows whose entries equal to the cut all fit are unambiguous
    ambiguous = np.nonzero(mask.sum(-1) + ties.sum(-1) > k)[0]
    mask |= ties
    for r in ambiguous:
        mask[r] = False
        mask[r, _torch_topk_indices(rows[r].tolist(), k)] = True
    return mask.reshape(scores.shape)


def _torch_topk_indices(values: list, k: int) -> list[int]:
    queue = [(v, i) for i, v in enumerate(values)]
    if k * 64 <= len(queue):
        _heap_select(queue, 0, k, len(queue))
    else:
        _introselect(queue, 0, k - 1, len(queue), 2 * (len(queue).bit_length() - 1))
    return [i for _, i in queue[:k]]


def _before(a, b) -> bool:  # torch's comparator for largest=True
    return a[0] > b[0]


def _introselect(q, first, nth, last, depth):
    while last - first > 3:
        if depth == 0:
            _heap_select(q, first, nth + 1, last)
            q[first], q[nth] = q[nth], q[first]
            return
        depth -= 1
        cut = _partition_pivot(q, first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(q, first, last)


def _partition_pivot(q, first, last):
    mid = first + (last - first) // 2
    a, b, c = first + 1, mid, last - 1
    if _before(q[a], q[b]):
        pick = b if _before(q[b], q[c]) else (c if _before(q[a], q[c]) else a)
    else:
        pick = a if _before(q[a], q[c]) else (c if _before(q[b], q[c]) else b)
    q[first], q[pick] = q[pick], q[first]
    lo, hi, pivot = first + 1, last, q[first]
    while True:
        while _before(q[lo], pivot):
            lo += 1
        hi -= 1
        while _before(pivot, q[hi]):
            hi -= 1
        if not lo < hi:
            return lo
        q[lo], q[hi] = q[hi], q[lo]
        lo += 1


def _insertion_sort(q, first, last):
    for i in range(first + 1, last):
        value = q[i]
        if _before(value, q[first]):
            q[first + 1:i + 1] = q[first:i]
            q[first] = value
        else:
            j = i
            while _before(value, q[j - 1]):
                q[j] = q[j - 1]
                j -= 1
            q[j] = value


def _heap_select(q, first, middle, last):
    length = middle - first
    if length >= 2:
        parent = (length - 2) // 2
        while True:
            _adjust_heap(q, first, parent, length, q[first + parent])
            if parent == 0:
                break
            parent -= 1
    for i in range(middle, last):
        if _before(q[i], q[first]):
            value, q[i] = q[i], q[first]
            _adjust_heap(q, first, 0, length, value)


def _adjust_heap(q, first, hole, length, value):
    top, child = hole, hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if _before(q[first + child], q[first + child - 1]):
            child -= 1
        q[first + hole] = q[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        q[first + hole] = q[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and _before(q[first + parent], value):
        q[first + hole] = q[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    q[first + hole] = value
