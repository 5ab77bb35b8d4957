"""How the copy engines' pipelined reduction cuts its chunks into pieces (pure; no torch).

`collectives/ce_reduce.py` runs it on GPUs and `sim/collectives.py` models it, both from here.

Every chunk goes in MIN_PIECES pieces, within [MIN_PIECE_BYTES, MAX_PIECE_BYTES]. More pieces do
not buy bandwidth: the pipeline's peer copies run one after the other on the incoming NVLink
direction whatever the count (GPU timeline, 2 x H200, 2026-11-22). And each piece costs GPU time of
its own, even replayed from a graph, where the host no longer posts it: an all_reduce on the copy
engines alone (2 x H200, 2026-11-26, graphs) took 243 / 583 us at 64 MiB in pieces of 8 / 1 MiB
(~12 us per piece more), 141 against 80 us at 16 MiB; 64 MiB in two pieces of 16 MiB took 220 us.
So a piece is at least MIN_PIECE_BYTES (BRAID_CE_MIN_PIECE_MB): chunks up to 16 MiB go whole.
Measured at 1 GiB on 2 GPUs: 4 pieces 3106 us of GPU time per all_reduce, 16 pieces 3227 us.
"""
from __future__ import annotations

MAX_PIECES = 64                  # counter space per call (ce_reduce: base = seq * MAX_PIECES)
MIN_PIECES = 4
TAIL_PIECES = 6                  # at most this many tapered pieces at a chunk's end (`pieces`)
TAPER_FROM_BYTES = 64 << 20      # pieces this large get a tapered end (`tail_elems`)
MIN_PIECE_BYTES = 16 << 20       # a copy-engine copy costs ~5-10 us to start: see the docstring
MAX_PIECE_BYTES = 256 << 20
PAGE = 4096


def piece_elems(longest: int, esz: int, piece_mb: int = 0, max_pieces: int = MAX_PIECES - TAIL_PIECES,
                min_piece: int = MIN_PIECE_BYTES) -> int:
    """Elements per piece for a largest chunk of `longest` bytes (`piece_mb` > 0 overrides the
    size; `min_piece`: the smallest piece in bytes): whole pages, and at most `max_pieces` pieces
    in that chunk (the counter space keeps room for a tapered tail). A pure function of agreed
    sizes, so every rank computes the same."""
    if piece_mb > 0:
        want = piece_mb << 20
    else:
        want = min(max(-(-longest // MIN_PIECES), min_piece), MAX_PIECE_BYTES)
    want = -(-want // PAGE) * PAGE
    per = max(1, want // esz)
    while longest and -(-longest // (per * esz)) > max_pieces:
        per *= 2
    return per


def tail_elems(per: int, esz: int, from_bytes: int = TAPER_FROM_BYTES) -> int:
    """The smallest piece of a chunk's tapered end for pieces of `per` elements: an eighth of a
    piece (so the taper is 4 pieces, 1/2, 1/4, 1/8, 1/8 of one), and only for pieces of at least
    TAPER_FROM_BYTES, where the last piece's reduction (~140 us for 118 MiB of bf16 on H200) is
    worth 3 more pieces of host-side posting (~30 us each on the VM here, 2026-11-22); 0: none.

    Measured (GPUs 0-1 of the 4 x H200 machine, reduce_scatter 1 GiB, alternating windows in one
    process, 2026-11-22): copy engines alone 1669 us even, 1616 tapered; ce 0.92 + host 0.08 1589 and
    1558; NCCL 2026-2034. `from_bytes`: the smallest piece that gets a taper (tests lower it to
    reach the taper at small sizes)."""
    if per * esz < from_bytes:
        return 0
    return max(1, (per // 8) * esz // PAGE * PAGE // esz)


def pieces(n: int, per: int, tail: int = 0) -> list[tuple[int, int]]:
    """[a, b) element ranges of a chunk of n elements in pieces of `per`.

    `tail` > 0 tapers the end: the last `per` or so of the chunk goes in pieces that halve down
    to `tail` elements (..., 4t, 2t, t, t), so what waits for the last pull (its reduction, and
    in an all_reduce the peers' gather of it) is a small piece instead of a full one. At most
    TAIL_PIECES more pieces. A pure function of (n, per, tail): every rank cuts alike."""
    if tail <= 0 or n <= per or 2 * tail > per:
        return [(a, min(n, a + per)) for a in range(0, n, per)]
    parts, total, s = [tail], tail, tail
    while total + s <= per and len(parts) < TAIL_PIECES:
        parts.append(s)
        total += s
        s *= 2
    head = n - total
    out = [(a, min(head, a + per)) for a in range(0, head, per)]
    a = head
    for s in reversed(parts):
        out.append((a, a + s))
        a += s
    return out
