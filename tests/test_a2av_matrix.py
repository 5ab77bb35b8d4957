"""The uneven all_to_all's round on the copy engines (comm/a2av.py): the matrix every rank reads
from the round's values, and the check that what each rank sends me is what I expect. The GPU
part (pulls, mappings) runs in tests/gpu/test_gpu_uneven_a2a.py."""
from __future__ import annotations

import random

import pytest

from braid.comm.a2av import check_columns, matrix_of
from braid.errors import PeerMismatchError


def _round(matrix):
    """Every rank's posted values: [largest demand, word, agreement, its row...]."""
    return [[max(row), 1000 + r, 7] + list(row) for r, row in enumerate(matrix)]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_the_matrix_is_every_ranks_row_in_rank_order(world):
    rng = random.Random(world)
    m = [[rng.randrange(0, 1 << 30) for _ in range(world)] for _ in range(world)]
    assert matrix_of(_round(m), world) == m
    for me in range(world):
        check_columns(m, me, [m[s][me] for s in range(world)], "all_to_all_single")   # agrees: no error


def test_a_rank_that_expects_other_bytes_is_named():
    m = [[0, 300, 5], [40, 0, 0], [7, 7, 7]]
    with pytest.raises(PeerMismatchError, match=r"rank 0 sends 300 bytes to rank 1, but rank 1 expects 301"):
        check_columns(m, 1, [300 + 1, 0, 7], "all_to_all_single")
    with pytest.raises(PeerMismatchError, match="split sizes disagree"):
        check_columns(m, 2, [5, 0, 6], "all_to_all_single")
