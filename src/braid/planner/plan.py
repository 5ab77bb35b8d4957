"""Plans as data: which bytes of which buffer go from which rank to which, on which lane.

Every data-movement op (send/recv, broadcast, all_gather, all_to_all_single) is written as a list
of `Transfer`s between flat byte buffers: rank `src` sends `nbytes` from offset `src_off` of its
input to one or more destinations `(rank, buf, off)`, where `buf` indexes the destination rank's
list of output buffers. A transfer with several destinations is a multicast (the host lane stages
it in host memory once and every destination reads it). Copies a rank makes to itself are kept
apart as `LocalCopy`s: no lane is needed for them.

`split()` cuts every transfer into contiguous pieces, one per lane, in proportion to the shares.
Plans round-trip to JSON so the executor, the simulator and the tests read the same object.

No torch import here (tests/test_planner_pure.py enforces it).
"""
from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field


class LaneKind(str, enum.Enum):
    """The mechanisms braid can move bytes with. Order = tie-break order in plans."""
    CE = "ce"        # copy engines over NVLink, CUDA IPC peer views
    NCCL = "nccl"    # NCCL kernels over NVLink
    HOST = "host"    # copy engines through pinned shared host memory (PCIe)
    SHM = "shm"      # CPU: memcpy through POSIX shared memory
    GLOO = "gloo"    # CPU: gloo point-to-point
    RELAY = "relay"  # through a third rank's bounded buffer (routed plans only, never by shares)

    def __str__(self) -> str:  # plain name in tables and JSON
        return self.value


LANE_ORDER = list(LaneKind)
GPU_LANES = (LaneKind.CE, LaneKind.NCCL, LaneKind.HOST)
CPU_LANES = (LaneKind.SHM, LaneKind.GLOO)

# Lanes that drive the same physical links: adding a second lane of one group adds no bandwidth
# (probes on 4 x H200, 2026-11-22: NVLink tops out at ~390 GB/s per GPU whether SMs or copy engines
# drive it).
LINK_GROUP = {
    LaneKind.CE: "nvlink",
    LaneKind.NCCL: "nvlink",
    LaneKind.HOST: "pcie",
    LaneKind.SHM: "memory",
    LaneKind.GLOO: "socket",
    # a relay loads the links of two hops (s->v, v->d) and v's copy engines; the router accounts
    # for those links itself, so for share-based grouping it is a group of its own
    LaneKind.RELAY: "relay",
}


@dataclass(frozen=True)
class Transfer:
    src: int
    src_off: int
    nbytes: int
    dsts: tuple[tuple[int, int, int], ...]  # (rank, output buffer index, byte offset)
    via: int = -1                           # relay rank (the `relay` lane); -1: direct

    def piece(self, start: int, stop: int) -> "Transfer":
        return Transfer(self.src, self.src_off + start, stop - start,
                        tuple((r, b, off + start) for r, b, off in self.dsts), self.via)


@dataclass(frozen=True)
class LocalCopy:
    rank: int
    src_off: int
    nbytes: int
    buf: int
    dst_off: int


@dataclass
class Movement:
    """An op written as transfers. `p2p` marks ops between a pair only (send/recv)."""
    op: str
    world_size: int
    transfers: list[Transfer]
    local: list[LocalCopy] = field(default_factory=list)
    p2p: bool = False

    def total_bytes(self) -> int:
        return sum(t.nbytes * len(t.dsts) for t in self.transfers)


@dataclass
class Plan:
    """A movement cut across lanes. `lanes[k]` are the transfers lane k carries."""
    op: str
    world_size: int
    nbytes: int                       # the op's size as the bench reports it
    shares: dict[str, float]
    lanes: dict[str, list[Transfer]]
    local: list[LocalCopy]
    p2p: bool = False

    def lane_bytes(self) -> dict[str, int]:
        return {k: sum(t.nbytes * len(t.dsts) for t in v) for k, v in self.lanes.items()}

    def to_json(self) -> str:
        return json.dumps({
            "op": self.op, "world_size": self.world_size, "nbytes": self.nbytes,
            "shares": self.shares, "p2p": self.p2p,
            "lanes": {k: [asdict(t) for t in v] for k, v in self.lanes.items()},
            "local": [asdict(c) for c in self.local],
        }, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Plan":
        obj = json.loads(text)

        def transfer(d: dict) -> Transfer:
            return Transfer(d["src"], d["src_off"], d["nbytes"], tuple(tuple(x) for x in d["dsts"]),
                            d.get("via", -1))

        return Plan(obj["op"], obj["world_size"], obj["nbytes"], obj["shares"],
                    {k: [transfer(t) for t in v] for k, v in obj["lanes"].items()},
                    [LocalCopy(**c) for c in obj["local"]], obj["p2p"])


# ---------------------------------------------------------------------------------------------
# ops as movements
# ---------------------------------------------------------------------------------------------

def all_gather_movement(world_size: int, nbytes: int, into_list: bool) -> Movement:
    """Every rank's input (nbytes) lands at slot r of every rank's output. Into one tensor the
    slot is offset r*nbytes of buffer 0; into a list it is buffer r at offset 0."""
    transfers, local = [], []
    for r in range(world_size):
        def dst(d: int) -> tuple[int, int, int]:
            return (d, r, 0) if into_list else (d, 0, r * nbytes)
        if nbytes:
            others = tuple(dst(d) for d in range(world_size) if d != r)
            if others:
                transfers.append(Transfer(r, 0, nbytes, others))
            _, b, off = dst(r)
            local.append(LocalCopy(r, 0, nbytes, b, off))
    return Movement("all_gather", world_size, transfers, local)


def broadcast_movement(world_size: int, nbytes: int, root: int) -> Movement:
    """The root's buffer to buffer 0 of every other rank (in place on the root)."""
    others = tuple((d, 0, 0) for d in range(world_size) if d != root)
    transfers = [Transfer(root, 0, nbytes, others)] if nbytes and others else []
    return Movement("broadcast", world_size, transfers, [])


def all_to_all_movement(matrix: list[list[int]]) -> Movement:
    """matrix[s][d] = bytes rank s sends to rank d. Rank s's input holds its rows in d order,
    rank d's output holds what it receives in s order (all_to_all_single's layout)."""
    world = len(matrix)
    transfers, local = [], []
    in_off = [[0] * world for _ in range(world)]
    out_off = [[0] * world for _ in range(world)]
    for s in range(world):
        acc = 0
        for d in range(world):
            in_off[s][d] = acc
            acc += matrix[s][d]
    for d in range(world):
        acc = 0
        for s in range(world):
            out_off[s][d] = acc
            acc += matrix[s][d]
    for s in range(world):
        for d in range(world):
            n = matrix[s][d]
            if not n:
                continue
            if s == d:
                local.append(LocalCopy(s, in_off[s][d], n, 0, out_off[s][d]))
            else:
                transfers.append(Transfer(s, in_off[s][d], n, ((d, 0, out_off[s][d]),)))
    return Movement("all_to_all_single", world, transfers, local)


def p2p_movement(world_size: int, src: int, dst: int, nbytes: int) -> Movement:
    transfers = [Transfer(src, 0, nbytes, ((dst, 0, 0),))] if nbytes else []
    return Movement("send_recv", world_size, transfers, [], p2p=True)


# ---------------------------------------------------------------------------------------------
# splitting by shares
# ---------------------------------------------------------------------------------------------

def normalise_shares(shares: dict[str, float]) -> dict[str, float]:
    positive = {str(k): float(v) for k, v in shares.items() if v > 0}
    if not positive:
        raise ValueError(f"shares need at least one positive entry, got {shares}")
    total = sum(positive.values())
    order = {k.value: i for i, k in enumerate(LANE_ORDER)}
    return {k: positive[k] / total for k in sorted(positive, key=lambda k: order.get(k, 99))}


def cut_points(nbytes: int, fractions: list[float], align: int) -> list[int]:
    """Boundaries 0 = p0 <= p1 <= ... <= pk = nbytes, each inner one a multiple of `align`,
    so piece i holds about fractions[i] of the bytes."""
    points, acc = [0], 0.0
    for frac in fractions[:-1]:
        acc += frac
        p = int(round(acc * nbytes / align)) * align
        points.append(min(max(p, points[-1]), nbytes))
    points.append(nbytes)
    return points


def ce_cut(chunks: list[tuple[int, int]], ce_f: float, others: bool, esz: int, align: int = 4096,
           every: bool = False) -> list[int]:
    """Elements of each reduction chunk ((offset, length) in elements) that the copy engines'
    pipelined reduction takes, from the front: a page-aligned `ce_f` of it beside other lanes
    (`others`), all of it alone, none where ce_f is 0. `every` (a reduce, whose pipeline pushes
    every rank's reduced chunk to the root): every chunk gets some, or none does."""
    if ce_f > 0 and others:
        cut = [cut_points(n * esz, [ce_f, 1.0 - ce_f], align)[1] // esz for _, n in chunks]
    else:
        cut = [n if ce_f > 0 else 0 for _, n in chunks]
    return cut if not every or all(cut) else [0] * len(chunks)


def split(movement: Movement, shares: dict[str, float], nbytes: int,
          align: int = 256, min_split: int = 256 << 10) -> Plan:
    """Cut every transfer into one contiguous piece per lane, sized by the shares.

    A transfer shorter than `min_split` is not cut: it goes whole to the lane with the largest
    share. Pieces keep their byte order, so a destination gets every byte exactly once.
    """
    shares = normalise_shares(shares)
    names = list(shares)
    fracs = [shares[k] for k in names]
    biggest = max(names, key=lambda k: shares[k])
    lanes: dict[str, list[Transfer]] = {k: [] for k in names}
    for t in movement.transfers:
        if len(names) == 1 or t.nbytes < min_split:
            lanes[biggest].append(t)
            continue
        pts = cut_points(t.nbytes, fracs, align)
        for k, a, b in zip(names, pts[:-1], pts[1:]):
            if b > a:
                lanes[k].append(t.piece(a, b))
    return Plan(movement.op, movement.world_size, nbytes, shares, lanes, list(movement.local),
                movement.p2p)


# ---------------------------------------------------------------------------------------------
# reductions: reduce-scatter into slots, then reduce on the device, then gather the chunks
# ---------------------------------------------------------------------------------------------

def chunk_bounds(numel: int, world_size: int, elem_bytes: int) -> list[int]:
    """Byte offsets b_0=0 <= ... <= b_N of each rank's chunk of a reduction: numel elements cut
    into world_size chunks as equal as possible (the first `numel % N` chunks one element longer)."""
    base, extra = divmod(numel, world_size)
    bounds, acc = [0], 0
    for r in range(world_size):
        acc += base + (1 if r < extra else 0)
        bounds.append(acc * elem_bytes)
    return bounds


def reduce_scatter_movement(world_size: int, bounds: list[int]) -> Movement:
    """reduce_scatter_chunks over contiguous chunks: chunk d is bytes [bounds[d], bounds[d+1])."""
    return reduce_scatter_chunks(world_size, [(bounds[d], bounds[d + 1] - bounds[d]) for d in range(world_size)])


def reduce_scatter_chunks(world_size: int, chunks: list[tuple[int, int]]) -> Movement:
    """Rank s's bytes of chunk d (`chunks[d]` = (byte offset in every rank's input, size)) land in
    slot s of rank d's scratch (buffer 1), laid out as world_size slots of that chunk's size. A
    rank's own contribution is a local copy into its slot, so the reduction reads one
    [world_size, chunk] array in rank order."""
    transfers, local = [], []
    for d, (off, size) in enumerate(chunks):
        if not size:
            continue
        for s in range(world_size):
            if s == d:
                local.append(LocalCopy(d, off, size, 1, d * size))
            else:
                transfers.append(Transfer(s, off, size, ((d, 1, s * size),)))
    return Movement("reduce_scatter", world_size, transfers, local)


def gather_chunks_movement(world_size: int, bounds: list[int], root: int | None) -> Movement:
    """gather_chunks over contiguous chunks: chunk d is bytes [bounds[d], bounds[d+1])."""
    return gather_chunks(world_size, [(bounds[d], bounds[d + 1] - bounds[d]) for d in range(world_size)], root)


def gather_chunks(world_size: int, chunks: list[tuple[int, int]], root: int | None) -> Movement:
    """Rank d's reduced chunk (its input at chunks[d] = (byte offset, size)) to the same place in
    every other rank's buffer 0 (root None: the all_reduce's all-gather) or in the root's only
    (reduce)."""
    transfers = []
    for d, (off, size) in enumerate(chunks):
        if not size:
            continue
        dsts = tuple((q, 0, off) for q in range(world_size)
                     if q != d and (root is None or q == root))
        if dsts:
            transfers.append(Transfer(d, off, size, dsts))
    return Movement("gather_chunks", world_size, transfers, [])
