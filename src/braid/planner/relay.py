"""The relay lane's chunk schedule: rank s -> rank v -> rank d through a bounded buffer on v.

A relayed transfer (`Transfer.via = v`) is cut into chunks no larger than one slot of v's staging
buffer. Each relay rank v owns one ring of `num_slots` slots; the chunks of every transfer that
goes through v share that ring. Chunks of a ring are numbered g = 0, 1, 2, ... for the life of the
communicator and chunk g sits in slot g % num_slots. Counters (monotonic u32 in the node segment):

    full[v]          = g + 1 once chunk g is in its slot of v's buffer
    done[v][c]       = g + 1 once consumer c has copied chunk g out of it
    arrive[s], finish[v] = the lane's call number (GPU: s's input is ready / v stopped reading inputs)

Who does what, per chunk g of ring v (src s, destinations d...):

    stage:   wait done[v][c] >= h + 1 for every consumer c of chunk h = g - num_slots (slot reuse)
             copy the chunk into slot g % num_slots of v's buffer
             write full[v] = g + 1
    consume: wait full[v] >= g + 1; copy the slot into the output; write done[v][d] = g + 1
    drain:   at the end of a call v waits until every consumer read its last chunk of the call,
             so once a call is over on every rank no buffer of it is in use.

On GPUs v stages (its copy engines pull from s's input through CUDA IPC, after arrive[s]; s waits
finish[v] before its call ends). On CPUs no process can read another's private memory, so s
stages into v's slot in the shared segment itself; chunks of one ring then have several writers,
so the writer of chunk g first waits full[v] >= g (the ring publishes in order). Everything else
(chunk cuts, slots, counter values, reuse and drain waits) is this module's, shared by both.

The order: all relayed chunks of a call in one global order (round-robin over the transfers, so
every flow advances), which every rank derives from the plan alone. Each rank stages its chunks
in that order and consumes its chunks in that order. Deadlock freedom: a stage step waits only on
consume steps of earlier chunks (reuse) and on the stage of the previous chunk of its ring (in
order); a consume step waits on the stage of its own chunk. Every wait points to an earlier chunk
or to the same chunk's stage, so the earliest unfinished step can always run. (Per-ring consumer
orders, as the host rings use, are not enough here: two consumers that visit two rings in
opposite orders can each hold a slot the other's next chunk needs.)

Slots: 4, each a quarter of the buffer (BRAID_RELAY_BUFFER_MB, default 64 MiB: 16 MiB slots, the
geometry of the 4 x 16 MiB host pipeline that reached 53-54 GB/s GPU -> host -> GPU on 2 x H200, 2026-11-22). Two stages
(s -> v, v -> d) need two slots to overlap; four let v run ahead of a lagging reader. A transfer is
cut into about TARGET_CHUNKS chunks (at least MIN_CHUNK_BYTES, at most one slot) so that a 16 MiB
transfer still pipelines instead of paying twice its copy time.

Pure python, no torch.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .plan import Transfer

NUM_SLOTS = 4
TARGET_CHUNKS = 8
MIN_CHUNK_BYTES = 1 << 20
ALIGN = 4096


def geometry(buffer_bytes: int) -> tuple[int, int]:
    """(num_slots, slot_bytes) of a relay buffer of `buffer_bytes` (slots whole pages)."""
    slot = max(ALIGN, buffer_bytes // NUM_SLOTS // ALIGN * ALIGN)
    return NUM_SLOTS, slot


def chunk_bytes(nbytes: int, slot_bytes: int, min_chunk: int = MIN_CHUNK_BYTES) -> int:
    """Chunk size of a relayed transfer of `nbytes`: about nbytes / TARGET_CHUNKS in whole pages,
    at least min(min_chunk, slot_bytes) and at most one slot."""
    want = -(-nbytes // TARGET_CHUNKS)
    want = -(-want // ALIGN) * ALIGN
    return max(min(min_chunk, slot_bytes), min(want, slot_bytes))


@dataclass
class RelayCursor:
    """What every rank remembers about one relay ring between calls."""
    num_slots: int
    next_g: int = 0
    last_writer: int = -1           # who staged the previous chunk (error messages)
    recent: deque = field(default_factory=deque)   # (g, consumers) of the last num_slots chunks


@dataclass(frozen=True)
class RelayChunk:
    ring: int                                  # the relay rank v
    g: int
    slot: int
    src: int
    src_off: int
    nbytes: int
    dsts: tuple[tuple[int, int, int], ...]     # (rank, output buffer index, byte offset)
    reuse: tuple[tuple[int, int], ...]         # (consumer, done value needed) before staging
    prev_writer: int                           # who staged chunk g - 1 of this ring (-1: none)

    def consumers(self) -> tuple[int, ...]:
        return tuple(sorted({d for d, _, _ in self.dsts}))


@dataclass
class RelaySchedule:
    chunks: list[RelayChunk]                         # the global order
    relays: tuple[int, ...]                          # rings used in this call
    sources: dict[int, tuple[int, ...]]              # relay v -> ranks whose input v reads
    drain: dict[int, tuple[tuple[int, int], ...]]    # relay v -> (consumer, done value) at the end

    def staged_by(self, rank: int, stager: str) -> list[RelayChunk]:
        """The chunks `rank` stages: `stager` "relay" (GPU: v pulls) or "source" (CPU: s pushes)."""
        if stager == "relay":
            return [c for c in self.chunks if c.ring == rank]
        return [c for c in self.chunks if c.src == rank]

    def consumed_by(self, rank: int) -> list[tuple[RelayChunk, tuple[tuple[int, int], ...]]]:
        """(chunk, ((buffer, offset), ...) on `rank`) for every chunk `rank` receives, in order."""
        out = []
        for c in self.chunks:
            here = tuple((b, off) for d, b, off in c.dsts if d == rank)
            if here:
                out.append((c, here))
        return out

    def readers_of(self, rank: int) -> tuple[int, ...]:
        """The relays that read `rank`'s input in this call (GPU: wait for their finish)."""
        return tuple(v for v in self.relays if rank in self.sources[v])


def check_transfer(t: Transfer, world_size: int) -> None:
    """A relayed transfer is well formed (ValueError otherwise)."""
    if not 0 <= t.via < world_size:
        raise ValueError(f"relayed transfer {t}: via={t.via} is not a rank of a world of {world_size}")
    if t.via == t.src:
        raise ValueError(f"relayed transfer {t}: via equals src ({t.src}); a direct transfer has via=-1")
    if not 0 <= t.src < world_size or t.nbytes < 0 or t.src_off < 0:
        raise ValueError(f"relayed transfer {t}: bad src, offset or size")
    if not t.dsts:
        raise ValueError(f"relayed transfer {t}: no destination")
    for d, b, off in t.dsts:
        if not 0 <= d < world_size or b < 0 or off < 0:
            raise ValueError(f"relayed transfer {t}: bad destination {(d, b, off)}")


def schedule(transfers: list[Transfer], world_size: int, slot_bytes: int,
             cursors: dict[int, RelayCursor], min_chunk: int = MIN_CHUNK_BYTES) -> RelaySchedule:
    """The relay lane's part of one call, for every rank at once, and advance the cursors.

    Every rank calls this with the same transfers and equal cursors, so all agree on every
    chunk's slot and counter values. `cursors[v]` must exist for every relay v used."""
    queues = []
    for t in transfers:
        check_transfer(t, world_size)
        step = chunk_bytes(t.nbytes, slot_bytes, min_chunk)
        pieces = [t.piece(a, min(a + step, t.nbytes)) for a in range(0, t.nbytes, step)]
        if pieces:
            queues.append(deque(pieces))
    order: list[Transfer] = []
    while queues:
        for q in list(queues):
            order.append(q.popleft())
            if not q:
                queues.remove(q)
    chunks: list[RelayChunk] = []
    sources: dict[int, list[int]] = {}
    last: dict[int, dict[int, int]] = {}
    for p in order:
        v = p.via
        cur = cursors[v]
        g = cur.next_g
        cur.next_g += 1
        reuse: tuple[tuple[int, int], ...] = ()
        if len(cur.recent) == cur.num_slots:
            old_g, old_consumers = cur.recent[0]
            reuse = tuple((c, old_g + 1) for c in old_consumers)
        chunk = RelayChunk(v, g, g % cur.num_slots, p.src, p.src_off, p.nbytes, p.dsts, reuse, cur.last_writer)
        cur.last_writer = p.src
        cur.recent.append((g, chunk.consumers()))
        while len(cur.recent) > cur.num_slots:
            cur.recent.popleft()
        chunks.append(chunk)
        srcs = sources.setdefault(v, [])
        if p.src not in srcs:
            srcs.append(p.src)
        for c in chunk.consumers():
            last.setdefault(v, {})[c] = g + 1
    relays = tuple(sorted(sources))
    return RelaySchedule(chunks, relays, {v: tuple(s) for v, s in sources.items()},
                         {v: tuple(sorted(last[v].items())) for v in relays})
