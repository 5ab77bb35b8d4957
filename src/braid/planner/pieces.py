"""How the copy engines' pipelined reduction cuts its chunks into pieces (pure; no torch).

`collectives/ce_reduce.py` runs it on GPUs and `sim/collectives.py` models it, both from here.

Every chunk goes in MIN_PIECES pieces, within [MIN_PIECE_BYTES, MAX_PIECE_BYTES]. More pieces do
not buy bandwidth: the pipeline's peer copies run one after the other on the incoming NVLink
direction whatever the count (GPU timeline, 2 x H200, 2026-11-22), and each piece costs host-side
launches (~50 us: with 16 pieces at 64 MiB the calls were CPU-bound). Measured at 1 GiB on 2 GPUs:
4 pieces 3106 us of GPU time per all_reduce, 16 pieces 3227 us.
"""
from __future__ import annotations

MAX_PIECES = 64                  # counter space per call (ce_reduce: base = seq * MAX_PIECES)
MIN_PIECES = 4
MIN_PIECE_BYTES = 4 << 20
MAX_PIECE_BYTES = 256 << 20
PAGE = 4096


def piece_elems(longest: int, esz: int, piece_mb: int = 0, max_pieces: int = MAX_PIECES) -> int:
    """Elements per piece for a largest chunk of `longest` bytes (`piece_mb` > 0 overrides the
    size): whole pages, and at most `max_pieces` pieces in that chunk. A pure function of agreed
    sizes, so every rank computes the same."""
    if piece_mb > 0:
        want = piece_mb << 20
    else:
        want = min(max(-(-longest // MIN_PIECES), MIN_PIECE_BYTES), MAX_PIECE_BYTES)
    want = -(-want // PAGE) * PAGE
    per = max(1, want // esz)
    while longest and -(-longest // (per * esz)) > max_pieces:
        per *= 2
    return per


def pieces(n: int, per: int) -> list[tuple[int, int]]:
    """[a, b) element ranges of a chunk of n elements in pieces of `per`."""
    return [(a, min(n, a + per)) for a in range(0, n, per)]
