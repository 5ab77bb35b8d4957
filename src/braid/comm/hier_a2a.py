"""Uneven all_to_all across nodes over every rail (NIMBLE's multi-rail path, FuseLink's borrowed
NICs): the hierarchical router's plan, run as three steps.

A demand from rank (a, i) to rank (b, j) on another node leaves node a on the NIC rails the plan
gives it, in whole rows: the part on rail k goes (a, i) -> (a, k) inside node a, (a, k) -> (b, k)
on rail group k, (b, k) -> (b, j) inside node b. A skewed matrix (one hot pair) thus crosses on every
NIC of both nodes instead of one; the NVLink hops on either side are cheap beside a NIC. Demands
within a node go straight to their destination in the first step.
    step 1  node all_to_all   each rank's rows to the rail ranks of its node (and its node peers)
    step 2  rail all_to_all   each rail rank's rows to the same rail of the destination nodes
    step 3  node all_to_all   each rail rank's rows to their destinations
Every rank needs the whole matrix (rows from every rank to every rank) to know what it forwards:
one small all_gather of the split sizes on braid's gloo group per call. The plan is a function of
the matrix alone (the router is deterministic), so every rank computes the same plan.

When: `BRAID_ROUTE=on` routes every uneven all_to_all of a multi-node world this way. Under
`auto` (the default) such calls go to NCCL whole: whether the extra agreement and the NVLink hops
pay on a real cluster has not been measured yet (`braid sim scale` predicts 3-7x on a hot pair
with 4-8 NICs per node, nothing on balanced traffic).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..errors import PeerMismatchError


def _split_rows(nbytes_by_rail, rows: int, row_bytes: int) -> list[int]:
    """Whole rows per rail from the plan's bytes per rail, summing to `rows` exactly (the
    remainder goes to the rails with the largest fractional parts, lowest index first)."""
    total = float(sum(nbytes_by_rail))
    if rows == 0:
        return [0] * len(nbytes_by_rail)
    if total <= 0:
        return [rows] + [0] * (len(nbytes_by_rail) - 1)
    exact = [rows * b / total for b in nbytes_by_rail]
    out = [int(x) for x in exact]
    rest = rows - sum(out)
    order = sorted(range(len(exact)), key=lambda k: (-(exact[k] - out[k]), k))
    for k in order[:rest]:
        out[k] += 1
    return out


class RailRoutedAllToAll:
    """The three steps of one uneven all_to_all on a Hierarchy (see the module text)."""

    def __init__(self, hier):
        self.h = hier
        self._topo = None

    def _topology(self):
        if self._topo is None:
            from ..planner.topologies import multi_node
            h = self.h
            self._topo = multi_node(h.num_nodes, h.per_node, nics=h.per_node)
        return self._topo

    def matrix(self, in_rows: list[int], out_rows: list[int], row_bytes: int) -> list[list[int]]:
        """Every rank's input split sizes (rows), agreed on the hierarchy's gloo group with every rank's
        output split sizes and row size; every rank checks every rank's (so all raise alike)."""
        h = self.h
        w = h.world.world_size
        mine = torch.tensor(list(in_rows) + list(out_rows) + [row_bytes], dtype=torch.int64)
        got = torch.empty(w * (2 * w + 1), dtype=torch.int64)
        try:
            dist.all_gather_into_tensor(got, mine, group=h.agree_group)
        except RuntimeError as exc:
            raise h.failed("split sizes' agreement", exc) from exc
        rows = got.view(w, 2 * w + 1).tolist()
        m = [r[:w] for r in rows]
        sizes = {r[2 * w] for r in rows}
        if len(sizes) > 1:
            raise PeerMismatchError(f"all_to_all_single: ranks disagree on the bytes of one row (dim 0 "
                                    f"slice): {[r[2 * w] for r in rows]} by rank; pass tensors of one "
                                    f"dtype and trailing shape on every rank")
        for d, r in enumerate(rows):
            for s in range(w):
                if r[w + s] != m[s][d]:
                    raise PeerMismatchError(
                        f"all_to_all_single: rank {d} expects {r[w + s]} rows from rank {s} "
                        f"(output_split_sizes), but rank {s} sends {m[s][d]} (its input_split_sizes); "
                        f"every rank's output_split_sizes[s] must equal rank s's input_split_sizes[that rank]")
        return m

    def parts(self, m: list[list[int]], row_bytes: int) -> dict:
        """(s, d) -> rows per rail for every demand between nodes, from the router's plan."""
        from ..planner.hier import route_hier
        h = self.h
        G = h.per_node
        plan = route_hier(self._topology(), [[r * row_bytes for r in row] for row in m], min_split_bytes=0)
        self.last_plan = plan
        rails = plan.rails
        out = {}
        for s, row in enumerate(m):
            a, i = divmod(s, G)
            for d, rows in enumerate(row):
                b, j = divmod(d, G)
                if a != b and rows:
                    out[(s, d)] = _split_rows([float(x) for x in rails[a, i, b, j]], rows, row_bytes)
        return out

    def run(self, output: torch.Tensor, input: torch.Tensor, out_rows: list[int], in_rows: list[int]):
        h = self.h
        G, W, me = h.per_node, h.world.world_size, h.world.rank
        a, i = divmod(me, G)
        row_numel = math.prod(input.shape[1:])
        es = input.element_size()
        m = self.matrix(in_rows, out_rows, row_numel * es)
        part = self.parts(m, row_numel * es)
        x = input.reshape(-1, row_numel)
        y = output.view(-1, row_numel)
        in_off = [sum(in_rows[:d]) for d in range(W)]
        out_off = [sum(out_rows[:s]) for s in range(W)]
        empty = x.new_empty(0, row_numel)

        # step 1: to every local rank k: [my rows for (a, k) itself] + [my rows for (b, j) on rail k]
        send1, split_out1 = [], []
        for k in range(G):
            d0 = a * G + k
            pieces = [x[in_off[d0]: in_off[d0] + in_rows[d0]]]
            for d in range(W):
                if (me, d) in part:
                    lo = in_off[d] + sum(part[(me, d)][:k])
                    pieces.append(x[lo: lo + part[(me, d)][k]])
            split_out1.append(sum(p.size(0) for p in pieces))
            send1.append(torch.cat(pieces) if pieces else empty)
        # what each local rank src sends me: its rows for me, then its rows on my rail (ordered by d)
        split_in1 = []
        for k in range(G):
            s = a * G + k
            split_in1.append(m[s][me] + sum(part[(s, d)][i] for d in range(W) if (s, d) in part))
        buf1 = x.new_empty(sum(split_in1), x.size(1))
        steps: list = []
        h._node_step("all_to_all (to the rails)", lambda: h.node.all_to_all_single(
            buf1, torch.cat(send1), split_in1, split_out1), buf1.numel() * es, steps)

        # step 2: on my rail i, to node b: rows (a, k) -> (b, j) that ride rail i, ordered by (k, j)
        recv1 = list(torch.split(buf1, split_in1))
        for k in range(G):
            s = a * G + k
            y_from = out_off[s]
            y[y_from: y_from + m[s][me]].copy_(recv1[k][:m[s][me]])       # same node: arrived
        fwd = {}
        for k in range(G):
            s = a * G + k
            off = m[s][me]
            for d in range(W):
                if (s, d) in part:
                    n = part[(s, d)][i]
                    fwd[(s, d)] = recv1[k][off: off + n]
                    off += n
        N = h.num_nodes
        send2, split_out2, split_in2 = [], [], []
        for b in range(N):
            keys = [(a * G + k, b * G + j) for k in range(G) for j in range(G)]
            pieces = [fwd[key] for key in keys if key in fwd]
            send2.append(torch.cat(pieces) if pieces else empty)
            split_out2.append(sum(p.size(0) for p in pieces))
            split_in2.append(sum(part[(b * G + k, a * G + j)][i] for k in range(G) for j in range(G)
                                 if (b * G + k, a * G + j) in part))
        buf2 = x.new_empty(sum(split_in2), x.size(1))
        h._rail_step("all_to_all", lambda: dist.all_to_all_single(buf2, torch.cat(send2), split_in2, split_out2,
                                                                 group=h.rail_group), buf2.numel() * es, steps)

        # step 3: to local j: rows (b, k) -> (a, j) that rode my rail, ordered by source (b, k)
        arrived = {}
        for b, chunk in zip(range(N), torch.split(buf2, split_in2)):
            off = 0
            for k in range(G):
                for j in range(G):
                    key = (b * G + k, a * G + j)
                    if key in part:
                        n = part[key][i]
                        arrived[key] = chunk[off: off + n]
                        off += n
        send3, split_out3, split_in3 = [], [], []
        for j in range(G):
            d = a * G + j
            pieces = [arrived[(s, d)] for s in range(W) if (s, d) in arrived]
            send3.append(torch.cat(pieces) if pieces else empty)
            split_out3.append(sum(p.size(0) for p in pieces))
            split_in3.append(sum(part[(s, me)][j] for s in range(W) if (s, me) in part))
        buf3 = x.new_empty(sum(split_in3), x.size(1))
        h._node_step("all_to_all (from the rails)", lambda: h.node.all_to_all_single(
            buf3, torch.cat(send3), split_in3, split_out3), buf3.numel() * es, steps)

        # assemble: rows from source s on rail k sit in the chunk from local rank k, in source order
        chunks = list(torch.split(buf3, split_in3))
        offs = [0] * G
        for s in range(W):
            if (s, me) not in part:
                continue
            at = out_off[s]
            for k in range(G):
                n = part[(s, me)][k]
                if n:
                    y[at: at + n].copy_(chunks[k][offs[k]: offs[k] + n])
                    offs[k] += n
                    at += n
        return steps

