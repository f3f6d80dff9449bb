"""vkformers_moe.torch_topk against the entries torch.topk (CPU, torch 2.13) returned for these rows: which of equal
scores it keeps follows its selection algorithm (std::nth_element; std::partial_sort when k * 64 <= n), not the
index order. Checked against torch on 3,000 random tie-heavy rows when written; these rows pin the cases down."""
import numpy as np
import pytest

from vkformers_moe.torch_topk import topk_mask

INF = float("inf")
CASES = [  # (scores, k, the indices torch.topk(scores, k) returned)
    ([0.044, -2.1, -1.8, -0.26, 0.0, 0.0, -0.85, 0.158], 3, [0, 5, 7]),  # the tie at the cut: 5, not 4
    ([0.0] * 4, 2, [2, 3]),
    ([1.0, 0.0, 0.0, 0.0, 0.0], 2, [0, 2]),
    ([0.0] * 20, 2, [12, 14]),
    ([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0], 3, [1, 5, 6]),
    ([0.0] * 200, 2, [0, 1]),  # k * 64 <= n: the heap path
    ([INF, INF, 0.0, 0.0, 0.0, -INF, 0.0, 0.0, 0.0], 4, [0, 1, 7, 8]),
]


@pytest.mark.parametrize("scores, k, expected", CASES)
def test_ties_resolved_as_torch(scores, k, expected):
    mask = topk_mask(np.asarray(scores, np.float32), k)
    assert np.nonzero(mask)[0].tolist() == expected


def test_rows_and_shapes():
    scores = np.array([[[3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]]], np.float32)  # [1, 2, 4]
    mask = topk_mask(scores, 2)
    assert mask.shape == scores.shape
    assert mask[0, 0].tolist() == [True, False, True, False]  # no tie: the two largest
    assert mask[0, 1].tolist() == [False, False, True, True]  # all tied: torch's pick
    assert topk_mask(scores, 4).all() and not topk_mask(scores, 0).any()
