"""Chunk schedules for the host-memory lanes (GPU `host`, CPU `shm`).

Each rank owns rings of slots in the node's shared host segment:
- its collective ring, which any rank may read (a chunk can have several consumers: the host lane
  stages an all_gather piece once and every peer reads it);
- one pair ring per peer, for send/recv, read by that peer only (a pair's chunks must not depend on
  what the sender does with other ranks, which the receiver cannot know).

Chunks of a ring are numbered g = 0, 1, 2, ... for the life of the communicator; chunk g sits in
slot g % num_slots. Counters (monotonic, in host memory):
    full[ring]            = g + 1 once the producer has staged chunk g
    done[ring][consumer]  = g + 1 once that consumer has read chunk g
Before staging chunk g the producer waits until every consumer of chunk g - num_slots has read it.
A consumer reads its chunks of a ring in g order, so done[ring][c] >= g + 1 means c has read every
chunk of that ring up to g that was addressed to it: waits are simple >= comparisons, which both the
GPU (stream memory operations) and the CPU (polling) can do.

Deadlock freedom: producers wait only on consumers and consumers only on producers, and every
consumer visits each ring's chunks in that ring's order, so no cycle of waits can form.

Pure python, no torch.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .plan import Transfer

COLL = "coll"
PAIR = "pair"


def ring_id(kind: str, src: int, dst: int | None = None) -> tuple:
    return (COLL, src) if kind == COLL else (PAIR, src, dst)


@dataclass
class RingCursor:
    """What every rank remembers about one ring between ops."""
    num_slots: int
    next_g: int = 0
    # consumers of the last num_slots chunks (producer side: whom to wait for before reuse)
    recent: deque = field(default_factory=deque)


@dataclass(frozen=True)
class ProduceStep:
    ring: tuple
    g: int
    slot: int
    src_off: int
    nbytes: int
    wait_for: tuple[tuple[int, int], ...]   # (consumer rank, done value needed)


@dataclass(frozen=True)
class ConsumeStep:
    ring: tuple
    producer: int
    g: int
    slot: int
    nbytes: int
    dsts: tuple[tuple[int, int], ...]       # (output buffer index, byte offset) on this rank


def chunk_transfers(transfers: list[Transfer], chunk: int) -> list[Transfer]:
    """A producer's transfers cut into chunks, round-robin across transfers so that every
    consumer receives a steady stream instead of waiting for the transfers before its own."""
    queues = []
    for t in transfers:
        pieces = [t.piece(a, min(a + chunk, t.nbytes)) for a in range(0, t.nbytes, chunk)]
        queues.append(deque(pieces))
    out = []
    while queues:
        for q in list(queues):
            out.append(q.popleft())
            if not q:
                queues.remove(q)
    return out


def schedule(transfers: list[Transfer], rank: int, world_size: int, chunk: int,
             cursors: dict[tuple, RingCursor], p2p: bool) -> tuple[list[ProduceStep], list[ConsumeStep]]:
    """This rank's produce and consume steps for the host lane's part of one op, and advance the
    ring cursors (every participating rank calls this with the same transfers, so every rank's
    cursors stay equal)."""
    by_ring: dict[tuple, list[Transfer]] = {}
    for t in transfers:
        if p2p:
            for d, b, off in t.dsts:
                single = Transfer(t.src, t.src_off, t.nbytes, ((d, b, off),))
                by_ring.setdefault(ring_id(PAIR, t.src, d), []).append(single)
        else:
            by_ring.setdefault(ring_id(COLL, t.src), []).append(t)
    produce: list[ProduceStep] = []
    consume_lists: list[list[ConsumeStep]] = []
    for rid in sorted(by_ring):
        cur = cursors[rid]
        mine: list[ConsumeStep] = []
        for piece in chunk_transfers(by_ring[rid], chunk):
            g = cur.next_g
            cur.next_g += 1
            consumers = tuple(sorted({d for d, _, _ in piece.dsts}))
            if piece.src == rank:
                wait = ()
                if len(cur.recent) == cur.num_slots:
                    old_g, old_consumers = cur.recent[0]
                    wait = tuple((c, old_g + 1) for c in old_consumers)
                produce.append(ProduceStep(rid, g, g % cur.num_slots, piece.src_off, piece.nbytes, wait))
            cur.recent.append((g, consumers))
            while len(cur.recent) > cur.num_slots:
                cur.recent.popleft()
            here = tuple((b, off) for d, b, off in piece.dsts if d == rank)
            if here:
                mine.append(ConsumeStep(rid, piece.src, g, g % cur.num_slots, piece.nbytes, here))
        consume_lists.append(mine)
    # interleave consumption across producers (round-robin), keeping each ring's order
    return produce, round_robin(consume_lists)


def round_robin(lists: list[list]) -> list:
    """One item of each list in turn (each list's own order kept) until all are used up."""
    out = []
    queues = [deque(c) for c in lists if c]
    while queues:
        for q in list(queues):
            out.append(q.popleft())
            if not q:
                queues.remove(q)
    return out


# captured programs ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GraphProduce:
    slot: int
    src_off: int
    nbytes: int
    free: tuple[int, ...]            # readers of the slot's previous use in this call (wait for each)
    readers: tuple[int, ...]         # readers of this chunk (tell each)


@dataclass(frozen=True)
class GraphConsume:
    producer: int
    slot: int
    nbytes: int
    dsts: tuple[tuple[int, int], ...]   # (output buffer index, byte offset) on this rank


def graph_schedule(transfers: list[Transfer], rank: int, chunk: int, slots: int
                   ) -> tuple[list[GraphProduce], list[GraphConsume], tuple[tuple[int, tuple[int, ...]], ...]]:
    """The host lane's part of one collective call as a program that can run again unchanged
    (a CUDA graph): each producer's chunks go through its graph ring from slot 0 in every call,
    handed over by per-slot, per-reader flags instead of counters that rise from call to call.
    Returns this rank's produce steps, its consume steps (round-robin over producers, each
    producer's chunks in order) and the tail: for each slot of its own ring, the readers of its
    last use, which the producer waits for before its program ends (so that the next call, or
    the next program, finds every slot free and every flag back at rest)."""
    by_src: dict[int, list[Transfer]] = {}
    for t in transfers:
        by_src.setdefault(t.src, []).append(t)
    produce: list[GraphProduce] = []
    consume_lists: list[list[GraphConsume]] = []
    tail: tuple = ()
    for src in sorted(by_src):
        last: dict[int, tuple[int, ...]] = {}
        mine: list[GraphConsume] = []
        for g, piece in enumerate(chunk_transfers(by_src[src], chunk)):
            slot = g % slots
            readers = tuple(sorted({d for d, _, _ in piece.dsts}))
            if src == rank:
                produce.append(GraphProduce(slot, piece.src_off, piece.nbytes, last.get(slot, ()), readers))
            last[slot] = readers
            here = tuple((b, off) for d, b, off in piece.dsts if d == rank)
            if here:
                mine.append(GraphConsume(src, slot, piece.nbytes, here))
        if src == rank:
            tail = tuple((s, r) for s, r in sorted(last.items()) if r)
        consume_lists.append(mine)
    return produce, round_robin(consume_lists), tail
