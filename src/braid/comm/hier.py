"""A world of several nodes: braid's lanes inside each node, NCCL (gloo on CPU) between nodes.

Ranks are grouped by host (hostname + boot id; BRAID_FAKE_NODES cuts one host into pretend
nodes for tests). With BRAID_HIER=1 (off by default: every call of a multi-node world then goes
to NCCL whole), where the nodes are regular (N nodes of G ranks, rank = node * G + local
index, as torchrun numbers them), every rank of the world builds, in the same order:
- one braid Communicator per node (its own segment and lanes; ranks 0..G-1 within the node),
- one rail group per local index i: the ranks (a, i) of every node a, on NCCL (GPU) or gloo
  (CPU), as NCCL's own hierarchical algorithms use them: NIC i of every node carries rail i.
A large call then runs as node steps on braid's lanes and one rail step per rank:
    all_reduce       node reduce_scatter -> rail all_reduce of the shard -> node all_gather
    all_gather       rail all_gather -> node all_gather -> reorder to world order
    reduce_scatter   reorder -> node reduce_scatter -> rail reduce_scatter
    broadcast        rail broadcast (the root's rail) -> node broadcast from the root's index
    all_to_all       reorder -> node all_to_all -> reorder -> rail all_to_all (equal splits)
Each rank moves (N - 1) / N of its data across nodes once, on its own rail (the minimum).
Data-movement ops give the same bits as a one-node call; reductions add in another order
(within the node first), as NCCL's own hierarchical algorithms do. AVG is summed and divided once
at the end (integers truncate toward zero, as NCCL). Calls below BRAID_HIER_MIN_BYTES, other
reduction ops, uneven all_to_all, reduce, gather, scatter and send/recv go to the native
library whole (the step overheads outweigh the gain there; every op stays correct).

The steps run one after another and the call returns done (async_op gets a completed handle):
correctness and the bytes each link carries are the point here; overlapping the steps is left
for when a multi-node GPU machine can measure it.
"""
from __future__ import annotations

import datetime
import functools
import itertools
import logging
import math
import threading

import torch
import torch.distributed as dist

from .. import envs
from ..collectives.reduce import REDUCE_DTYPES, divide
from ..errors import BraidError, BraidTimeoutError, LaneFailureError
from ..executor import Handle

log = logging.getLogger("braid")

_HIER_REDS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MIN: "min",
              dist.ReduceOp.MAX: "max", dist.ReduceOp.PRODUCT: "product"}


_MAX_PIECES = 8      # all_reduce's pieces at most (BRAID_HIER_PIECE_KB sets their size)
_WORLDS = itertools.count()     # multi-node worlds made by this process: every rank counts alike


def _counted(op):
    """An op of the Hierarchy, counted in `in_call` while it runs."""
    @functools.wraps(op)
    def run(self, *args, **kwargs):
        self.in_call += 1
        try:
            return op(self, *args, **kwargs)
        finally:
            self.in_call -= 1
    return run


class _Beacon:
    """Faults across nodes. A node's communicator learns of a peer that died, aborted or timed
    out through its node segment, which the other nodes cannot see; their ranks may sit in a rail
    step on NCCL or in GPU waits of their own node that nothing on their node will release. So a
    thread per rank looks every PERIOD_S: once this rank's node has given up, it writes the cause
    under the world's key in the process group's store (every rank of every node reaches it) and
    aborts the world's rail and NCCL groups; once another rank wrote it, it aborts this rank's
    node (its peers raise at once, its GPU waits are released) and the same groups. One store
    look per PERIOD_S per rank; nothing on the calls' path."""

    PERIOD_S = 1.0

    def __init__(self, hier: "Hierarchy", store, key: str):
        self._hier, self._store, self._key = hier, store, key
        self._posted = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="braid-beacon", daemon=True)
        self._thread.start()

    def post(self, why: str) -> None:
        """This rank gives up on the world (a node step failed here, which its node's peers
        may have seen alike and gone on from, while the other nodes wait in a rail step): the
        thread tells every node at its next look."""
        self._posted = self._posted or why

    def _run(self) -> None:
        hier = self._hier
        store_ok = True
        while not self._stop.wait(self.PERIOD_S):
            try:
                node, world = hier.node, hier.world
                why = self._posted or node.aborted or (node.watchdog.failed if node.watchdog is not None else "")
                if why:                      # this node gave up: tell the others
                    world._faults.abort_native(why, False)
                    self._tell(f"rank {world.rank}: {why}")
                    break
                try:
                    cause = self._store.get(self._key).decode(errors="replace") \
                        if store_ok and self._store.check([self._key]) else None
                except Exception as exc:     # noqa: BLE001  the store's host is gone: local faults only
                    log.debug("braid: the cross-node fault check lost the store: %s", exc)
                    store_ok, cause = False, None
                if cause is not None:
                    why = f"a rank on another node gave up ({cause})"
                    world._faults.abort_native(why, False)
                    node.abort(why, wait=False)
                    break
            except Exception as exc:     # noqa: BLE001  a communicator is gone: stop looking
                log.debug("braid: the cross-node fault check stopped: %s", exc)
                return
        else:
            return
        if hier.world.cuda:               # as a node's watchdog does, and for the rail steps too
            from .ledger import keep_released
            keep_released(hier.node.segment, self._stop, hier.world.rank, why, self.PERIOD_S,
                          busy=lambda: hier.in_call > 0)

    def _tell(self, why: str) -> None:
        try:
            self._store.set(self._key, why)
        except Exception as exc:         # noqa: BLE001  the store's host is gone: this node only
            log.debug("braid: could not tell the other nodes: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)


def _merged(steps: list) -> list:
    """Steps of the same name as one (a call in pieces repeats them): bytes summed, shares
    weighted by each repeat's bytes."""
    total: dict[str, int] = {}
    for name, _, nbytes in steps:
        total[name] = total.get(name, 0) + nbytes
    shares: dict[str, dict[str, float]] = {}
    for name, where, nbytes in steps:
        acc = shares.setdefault(name, {})
        for lane, f in where.items():
            acc[lane] = acc.get(lane, 0.0) + f * nbytes / (total[name] or 1)
    return [(name, shares[name], total[name]) for name in total]


class HierHandle(Handle):
    """A multi-node call that ran as steps (done when returned). `steps` says where each ran:
    (step, {lane: share}, bytes per rank), e.g. ("node reduce_scatter", {"shm": 0.62, "gloo": 0.38},
    4 MiB) or ("rail all_reduce", {"rail-nccl": 1.0}, 1 MiB)."""

    def __init__(self, steps: list[tuple[str, dict, int]], shares: dict[str, float]):
        super().__init__()
        self._waited = True
        self.steps = steps
        self._shares = shares

    @property
    def shares(self) -> dict[str, float]:
        return dict(self._shares)


def node_layout(hosts: list) -> tuple[list[list[int]], str]:
    """The world's ranks per node (nodes in order of their first rank), and why the layout is
    not regular ("" when it is: equal node sizes, each node's ranks consecutive)."""
    order: dict = {}
    for r, h in enumerate(hosts):
        order.setdefault(h, []).append(r)
    nodes = list(order.values())
    g = len(nodes[0])
    if any(len(m) != g for m in nodes):
        return nodes, f"nodes have different rank counts ({sorted({len(m) for m in nodes})})"
    if any(m != list(range(a * g, (a + 1) * g)) for a, m in enumerate(nodes)):
        return nodes, "a node's ranks are not consecutive (rank = node * ranks_per_node + local index)"
    return nodes, ""


class Hierarchy:
    """The node communicator and rail group of this rank, and the multi-node ops (see the
    module text). Built by the world's Communicator on every rank."""

    def __init__(self, world, nodes: list[list[int]], make_node):
        self.world = world
        self.num_nodes, self.per_node = len(nodes), len(nodes[0])
        self.node_index, self.local = divmod(world.rank, self.per_node)
        cuda = world.cuda
        # every group below gives up after BRAID_TIMEOUT_S, as braid's own waits do: a rank that
        # fails or leaves mid-call cannot leave its peers on other nodes in a gloo call for the
        # groups' default half hour (gloo cannot be interrupted; NCCL's watchdog ends the process)
        limit = datetime.timedelta(seconds=envs.get("BRAID_TIMEOUT_S"))
        self.agree_group = dist.new_group(backend="gloo", timeout=limit)   # small agreements (hier_a2a)
        mine = {}
        for a, members in enumerate(nodes):          # every rank makes every group, in one order
            groups = {"gloo": dist.new_group(members, backend="gloo", timeout=limit)}
            if cuda:
                groups["nccl"] = dist.new_group(members, backend="nccl", timeout=limit)
            if a == self.node_index:
                mine = groups
        self.rail_group = None
        for i in range(self.per_node):
            g = dist.new_group([a * self.per_node + i for a in range(self.num_nodes)],
                               backend="nccl" if cuda else "gloo", timeout=limit)
            if i == self.local:
                self.rail_group = g
        self.rail_lib = "nccl" if cuda else "gloo"
        lanes = sorted(world.wanted) if world.wanted is not None else None
        self.node = make_node(lanes, mine)     # braid's Communicator of this rank's node
        # read once, as the communicator reads its settings (the same on every rank)
        self.min_bytes = max(1, envs.get("BRAID_HIER_MIN_BYTES"))
        self.piece_bytes = envs.get("BRAID_HIER_PIECE_KB") << 10
        self._a2av = None                      # uneven all_to_all over every rail (hier_a2a.py)
        self.in_call = 0                       # calls inside an op here (the beacon's last resort)
        key = f"braid/abort/{next(_WORLDS)}"
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:                      # noqa: BLE001  no store: faults stay within a node
            store = None
        self._beacon = _Beacon(self, store, key) if store is not None else None

    @classmethod
    def build(cls, world, hosts: list, make_node) -> "Hierarchy | None":
        """The hierarchy of a world whose ranks sit on `hosts` (one key per rank), or None when
        the world is one node or its nodes are not regular. make_node(lanes, groups) makes the
        node's Communicator over the node's groups."""
        nodes, why = node_layout(hosts)
        if len(nodes) < 2:
            return None
        if why:
            log.warning("braid: %d nodes, but %s: every call goes to %s whole", len(nodes), why,
                        "NCCL" if world.cuda else "gloo")
            return None
        return cls(world, nodes, make_node)

    def close(self) -> None:
        if self._beacon is not None:
            self._beacon.stop()
        self.node.close()

    # the decision ---------------------------------------------------------------------------
    def _takes(self, nbytes: int, *tensors) -> bool:
        """Steps for this call? From facts every rank shares when the calls match (size, dtype);
        contiguous tensors of the world's device type."""
        if nbytes < self.min_bytes:
            return False
        for t in tensors:
            if type(t) is not torch.Tensor or t.is_cuda is not self.world.cuda or not t.is_contiguous():
                return False
        return True

    def wants(self, op: str, nbytes: int) -> bool:
        """Would a call of this op and size run as steps (the fast path then leaves it alone)?"""
        return op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single") \
            and nbytes >= self.min_bytes

    def _done(self, op, steps, async_op):
        """The call's handle (the caller returns it where async_op): every step's lane shares
        weighted by its bytes (rail steps as 'rail-nccl' / 'rail-gloo')."""
        total = sum(b for _, _, b in steps) or 1
        shares: dict[str, float] = {}
        for _, where, b in steps:
            for lane, f in where.items():
                shares[lane] = shares.get(lane, 0.0) + f * b / total
        h = HierHandle(steps, shares)
        self.world.last_handle = h
        self.world.ledger.count((op, total, None, "steps"))
        return h

    def _node_step(self, name: str, fn, nbytes: int, steps: list) -> None:
        try:
            fn()
        except BraidError as exc:
            err = self.in_node(name, exc)
            if self._beacon is not None:        # the other nodes wait for this one in a rail step
                self._beacon.post(str(err))
            raise err from exc
        h = self.node.last_handle
        steps.append((f"node {name}", (h.shares if h is not None else {}) or {"node": 1.0}, nbytes))

    def _rail_step(self, name: str, fn, nbytes: int, steps: list) -> None:
        try:
            fn()
        except BraidError:
            raise
        except RuntimeError as exc:        # gloo/NCCL: a peer that left, a timeout
            raise self.failed(f"rail {name}", exc) from exc
        steps.append((f"rail {name}", {f"rail-{self.rail_lib}": 1.0}, nbytes))

    def in_node(self, step: str, exc: BraidError) -> BraidError:
        """A node step's error, its ranks (the node's own, 0..G-1) translated for the reader."""
        first = self.node_index * self.per_node
        text = (f"rank {self.world.rank}, node step {step} on node {self.node_index} (node ranks 0-"
                f"{self.per_node - 1} are world ranks {first}-{first + self.per_node - 1}): {exc}")
        try:
            return type(exc)(text)
        except TypeError:              # an error type with other arguments: keep it as it is
            return exc

    def _rail_start(self, name: str, fn):
        """Post a rail step (async_op=True); _rail_wait ends it. Errors as _rail_step's."""
        try:
            return fn()
        except BraidError:
            raise
        except RuntimeError as exc:
            raise self.failed(f"rail {name}", exc) from exc

    def _rail_wait(self, name: str, work, nbytes: int, steps: list) -> None:
        self._rail_step(name, work.wait, nbytes, steps)

    def failed(self, step: str, exc: BaseException) -> BraidError:
        """The error of a step the native library failed (a peer on another node that died, left
        or did not come within BRAID_TIMEOUT_S): this rank's node is told (its communicator is
        aborted, so node peers waiting for this rank raise at once), and the error names the step
        and the ranks it waited for."""
        ranks = [a * self.per_node + self.local for a in range(self.num_nodes)]
        text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        why = (f"rank {self.world.rank}: the {step} step with ranks {ranks} ({self.rail_lib}) failed: {text}; "
               f"a rank on another node died, left or did not make this call within BRAID_TIMEOUT_S")
        try:
            self.node.abort(why)
        except Exception:          # noqa: BLE001  the first error is the one to report
            pass
        err = BraidTimeoutError if "imeout" in text or "imed out" in text else LaneFailureError
        return err(why)

    # the ops ----------------------------------------------------------------------------------
    @_counted
    def all_reduce(self, tensor: torch.Tensor, op, async_op: bool):
        name = _HIER_REDS.get(op) if type(op) is type(dist.ReduceOp.SUM) else None
        if name is None or tensor.dtype not in REDUCE_DTYPES or tensor.dtype is torch.bool \
                or not self._takes(tensor.numel() * tensor.element_size(), tensor):
            return None
        red = dist.ReduceOp.SUM if name == "avg" else op
        g, n = self.per_node, tensor.numel()
        flat = tensor.view(-1)
        m = -(-n // g)
        buf = flat if m * g == n else torch.zeros(m * g, dtype=tensor.dtype, device=tensor.device)
        if buf is not flat:
            buf[:n].copy_(flat)
        es, steps = tensor.element_size(), []
        # pieces: the rail all_reduce of one piece runs (async, in the native library's own
        # thread or stream) while the node steps of the next go on; every rank cuts alike
        piece = self.piece_bytes
        parts = 1 if piece == 0 else max(1, min(_MAX_PIECES, (m * g * es) // piece))
        counts = [m // parts + (1 if p < m % parts else 0) for p in range(parts)]
        counts = [c for c in counts if c]
        offs = [sum(counts[:p]) for p in range(len(counts))]
        shards = [torch.empty(c, dtype=tensor.dtype, device=tensor.device) for c in counts]
        pending = None
        for p, (lo, c) in enumerate(zip(offs, counts)):
            part = buf[lo * g:(lo + c) * g]
            self._node_step("reduce_scatter", lambda: self.node.reduce_scatter_tensor(shards[p], part, op=red),
                            c * g * es, steps)
            work = self._rail_start("all_reduce", lambda: dist.all_reduce(shards[p], op=red, group=self.rail_group,
                                                                           async_op=True))
            if pending is not None:
                self._gather_piece(*pending, buf, shards, offs, counts, es, steps)
            pending = (p, work)
        self._gather_piece(*pending, buf, shards, offs, counts, es, steps)
        with torch.no_grad():
            if buf is not flat:
                flat.copy_(buf[:n])
            if name == "avg":
                divide(flat, self.world.world_size)
        return self._done("all_reduce", _merged(steps), async_op)

    def _gather_piece(self, p, work, buf, shards, offs, counts, es, steps) -> None:
        """all_reduce's end for piece p: its rail step waited, then the node all_gather."""
        g = self.per_node
        self._rail_wait("all_reduce", work, counts[p] * es, steps)
        part = buf[offs[p] * g:(offs[p] + counts[p]) * g]
        self._node_step("all_gather", lambda: self.node.all_gather_into_tensor(part, shards[p]),
                        counts[p] * g * es, steps)

    @_counted
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, async_op: bool):
        n, N, G = input.numel(), self.num_nodes, self.per_node
        if input.dtype != output.dtype or output.numel() != n * N * G \
                or not self._takes(n * input.element_size(), input, output):
            return None
        es, steps = input.element_size(), []
        rail = torch.empty(N * n, dtype=input.dtype, device=input.device)
        self._rail_step("all_gather", lambda: dist.all_gather_into_tensor(rail, input.view(-1), group=self.rail_group),
                        N * n * es, steps)
        node = torch.empty(G * N * n, dtype=input.dtype, device=input.device)
        self._node_step("all_gather", lambda: self.node.all_gather_into_tensor(node, rail), G * N * n * es, steps)
        with torch.no_grad():          # [G local][N node][n] -> world order [N][G][n]
            output.view(N, G, n).copy_(node.view(G, N, n).transpose(0, 1))
        return self._done("all_gather", steps, async_op)

    @_counted
    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op, async_op: bool):
        name = _HIER_REDS.get(op) if type(op) is type(dist.ReduceOp.SUM) else None
        n, N, G = output.numel(), self.num_nodes, self.per_node
        if name is None or input.dtype != output.dtype or input.numel() != n * N * G \
                or output.dtype not in REDUCE_DTYPES or output.dtype is torch.bool \
                or not self._takes(input.numel() * input.element_size(), input, output):
            return None
        red = dist.ReduceOp.SUM if name == "avg" else op
        es, steps = input.element_size(), []
        # [N node][G local][n] -> [G local][N node][n]: local index j gets every node's chunk j
        x = input.view(N, G, n).transpose(0, 1).contiguous()
        part = torch.empty(N * n, dtype=input.dtype, device=input.device)
        self._node_step("reduce_scatter", lambda: self.node.reduce_scatter_tensor(part, x.view(-1), op=red),
                        N * G * n * es, steps)
        self._rail_step("reduce_scatter", lambda: dist.reduce_scatter_tensor(output.view(-1), part, op=red,
                                                                             group=self.rail_group), N * n * es, steps)
        if name == "avg":
            with torch.no_grad():
                divide(output, self.world.world_size)
        return self._done("reduce_scatter", steps, async_op)

    @_counted
    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool):
        if not self._takes(tensor.numel() * tensor.element_size(), tensor):
            return None
        root_node, root_local = divmod(src, self.per_node)
        nb, steps = tensor.numel() * tensor.element_size(), []
        flat = tensor.view(-1)
        if self.local == root_local:
            self._rail_step("broadcast", lambda: dist.broadcast(flat, group_src=root_node, group=self.rail_group),
                            nb, steps)
        self._node_step("broadcast", lambda: self.node.broadcast(flat, src=root_local), nb, steps)
        return self._done("broadcast", steps, async_op)

    @_counted
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool):
        N, G = self.num_nodes, self.per_node
        w = N * G
        if input.dtype != output.dtype or input.numel() != output.numel() or input.numel() % w \
                or not self._takes(input.numel() * input.element_size(), input, output):
            return None
        n, es, steps = input.numel() // w, input.element_size(), []
        # [N dest node][G dest local][n] -> [G dest local][N dest node][n]
        x = input.view(N, G, n).transpose(0, 1).contiguous()
        y = torch.empty_like(x)
        self._node_step("all_to_all", lambda: self.node.all_to_all_single(y.view(-1), x.view(-1)), w * n * es, steps)
        # y: [G src local][N dest node][n] -> [N dest node][G src local][n] for the rail exchange
        z = y.transpose(0, 1).contiguous()
        self._rail_step("all_to_all", lambda: dist.all_to_all_single(output.view(-1), z.view(-1),
                                                                     group=self.rail_group), w * n * es, steps)
        return self._done("all_to_all_single", steps, async_op)

    @_counted
    def all_to_all_v(self, output: torch.Tensor, input: torch.Tensor, out_splits, in_splits, async_op: bool):
        """Uneven all_to_all over every rail (comm/hier_a2a.py) under BRAID_ROUTE=on; None (NCCL
        whole) otherwise, or where the tensors do not allow it."""
        if self.world.routing != "on" or input.dim() == 0 or output.dim() == 0 \
                or input.dtype != output.dtype or input.shape[1:] != output.shape[1:] \
                or math.prod(input.shape[1:]) == 0 or not output.is_contiguous() \
                or type(input) is not torch.Tensor or input.is_cuda is not self.world.cuda \
                or output.is_cuda is not self.world.cuda:
            return None
        w = self.world.world_size
        ins = [int(v) for v in in_splits] if in_splits else [input.size(0) // w] * w
        outs = [int(v) for v in out_splits] if out_splits else [output.size(0) // w] * w
        if len(ins) != w or len(outs) != w or sum(ins) != input.size(0) or sum(outs) != output.size(0):
            return None         # the full path explains what is wrong
        if self._a2av is None:
            from .hier_a2a import RailRoutedAllToAll
            self._a2av = RailRoutedAllToAll(self)
        with torch.no_grad():
            steps = self._a2av.run(output, input.contiguous(), outs, ins)
        return self._done("all_to_all_single", steps, async_op)
