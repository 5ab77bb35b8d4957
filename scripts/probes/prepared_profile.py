"""Where a prepared split call's host time goes: each step of the call path timed on its own
(wrapped functions, nested times included in their callers), ranks sharing one GPU (2, or --nproc), or a GPU each (--own-gpus).

    PYTHONPATH=src python3 scripts/probes/prepared_profile.py [--op all_gather] [--nbytes 1048576] [--nproc 4] [--async-op] [--first [--first-only]] [--nccl 3]

`--op all_to_all_equal` passes equal split sizes (torch's functional all_to_all_single's form);
`--op all_to_all_uneven` skewed ones (rank s sends rank d (1 + (s + 2d) % 3) parts, an MoE
layer's kind of matrix; the copy engines take it from BRAID_A2AV_CE_MIN_MB, which the probe sets
to 1 unless given).
BRAID_WARM=0 leaves out the communicator's warm-up (see comm/prepared.py) for comparison. With
BRAID_DEFER=1 the deferred call's steps are timed too (comm/rounds.py); --gap-us spins that long
between calls (as a job's own work would), so a deferred call's cost is the caller's alone, not
the rounds thread's pace.
"""
import argparse
import collections
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _calls(comm, op, nbytes, world, async_op=False):
    """The call of `op` on bfloat16 buffers of `nbytes` per rank, made once."""
    n = nbytes // 2
    x = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = torch.empty(n * world, device="cuda", dtype=torch.bfloat16)
    y = x.clone()
    rs_out = torch.empty(n // world, device="cuda", dtype=torch.bfloat16)
    a2a_out = torch.empty_like(x)
    if comm is None:                # NCCL's own call through torch (--nccl), the same buffers
        comm = dist
    # skewed split sizes: rank s sends rank d (1 + (s + 2d) % 3) parts of n / (2 world) elements
    part = max(n // (2 * world), 1)
    rank = dist.get_rank()
    ins = [part * (1 + (rank + 2 * d) % 3) for d in range(world)]
    outs = [part * (1 + (s + 2 * rank) % 3) for s in range(world)]
    u_in = torch.randn(sum(ins), device="cuda").to(torch.bfloat16)
    u_out = torch.empty(sum(outs), device="cuda", dtype=torch.bfloat16)
    calls = {
        "all_gather": lambda: comm.all_gather_into_tensor(out, x),
        "all_reduce": (lambda: comm.all_reduce(y, async_op=True).wait()) if async_op else (lambda: comm.all_reduce(y)),
        "reduce_scatter": lambda: comm.reduce_scatter_tensor(rs_out, x),
        "broadcast": lambda: comm.broadcast(y, 0),
        "all_to_all_single": lambda: comm.all_to_all_single(a2a_out, x),
        # equal split sizes given, as torch's functional all_to_all_single passes them
        "all_to_all_equal": lambda: comm.all_to_all_single(a2a_out, x, [n // world] * world, [n // world] * world),
        "all_to_all_uneven": lambda: comm.all_to_all_single(u_out, u_in, outs, ins),
    }
    return calls[op]


def worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("BRAID_A2AV_CE_MIN_MB", "1")
    import braid
    if args.own_gpus:               # a GPU per rank
        torch.cuda.set_device(rank)
    else:                           # the ranks share GPU 0 (host-cost figures)
        os.environ["BRAID_SHARED_GPU"] = "1"
        braid.share_gpu(rank)
        torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    comm = braid.init()
    from braid.comm import exchange, prepared, communicator
    from braid.lanes import _cuda
    from braid import node
    acc = collections.defaultdict(float)
    cnt = collections.Counter()

    def wrap(owner, name, label=None):
        fn = getattr(owner, name, None)
        if fn is None:              # (an older tree, compared in the same run)
            return
        label = label or f"{getattr(owner, '__name__', owner)}.{name}"

        def timed(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                acc[label] += time.perf_counter_ns() - t0
                cnt[label] += 1
        setattr(owner, name, timed)

    fn = _calls(comm, args.op, args.nbytes, world, args.async_op)
    if args.first:                  # the first call of the shape under cProfile (rank 0's top entries)
        import cProfile
        import pstats
        with comm.fixed_shares({"ce": 1.0}):
            dist.barrier()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            t0 = time.perf_counter_ns()
            prof.enable()
            fn()
            prof.disable()
            t1 = time.perf_counter_ns()
            torch.cuda.synchronize()
        # a second shape's first call (half the size): what every later new shape costs
        with comm.fixed_shares({"ce": 1.0}):
            fn2 = _calls(comm, args.op, args.nbytes // 2, world)
            dist.barrier()
            torch.cuda.synchronize()
            t2 = time.perf_counter_ns()
            fn2()
            t3 = time.perf_counter_ns()
            torch.cuda.synchronize()
        if rank == 0:
            warm = comm._prepared.stats.get("warm_ms")
            print(f"{args.op} {args.nbytes} B, {world} ranks: first call {(t1 - t0) / 1e6:.2f} ms of host time, "
                  f"a second shape's first call {(t3 - t2) / 1e6:.2f} ms; the communicator's warm-up "
                  f"{'off' if warm is None else f'{warm:.1f} ms'}")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(28)
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        if args.first_only:
            braid.close()
            dist.destroy_process_group()
            return
    with comm.fixed_shares({"ce": 1.0}):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        from braid.comm import a2av, callpath, ledger, reductions, routing, uneven
        from braid.comm import native_rounds as native_rounds_mod
        from braid.lanes import signals
        for owner, names in ((type(comm), ("lanes_for", "shares_for", "all_gather_into_tensor", "all_reduce",
                                           "reduce_scatter_tensor", "broadcast",
                                           "all_to_all_single")),
                             (exchange.Exchange, ("run", "run_call", "run_prepared")),
                             (reductions.Reductions, ("reduction", "reduce_call")),
                             (callpath.CallPath, ("fast_prepared", "deferred")),
                             (ledger.Faults, ("check_open",)),
                             (routing.Routing, ("all_to_all_single", "a2av_agree", "a2a_even", "a2av_entry",
                                                "a2av_lean", "native_posting")),
                             (uneven.UnevenAgreement, ("round", "round_native", "_copy_engines", "verdict", "read",
                                                       "settle", "agreement")),
                             (native_rounds_mod.FastCalls, ("uneven_round", "uneven_post")),
                             (a2av.UnevenCe, ("run", "_peers")),
                             (signals.Rising, ("ready_then_wait", "wait_ready", "done_then_wait", "ready")),
                             (callpath.CallPath, ("ticket_word", "replay_agreed", "native_replay")),
                             (ledger.CallLedger, ("enter",))):
            for name in names:
                wrap(owner, name)
        comm._fast_prepared = comm._calls.fast_prepared     # the op entries' binding, made at creation
        for name in ("word_base", "finish_word", "launch", "get", "fork", "join"):
            wrap(prepared.PreparedCalls, name)
        for name in ("post_values", "read_values"):
            wrap(node.NodeSegment, name)
        for name in ("buffer_id", "event_record", "stream_wait_event", "graph_launch", "wait_value", "event_query",
                     "memcpy_async", "memops"):
            wrap(_cuda, name)
        if comm._rounds is not None:
            from braid.comm import native_rounds, rounds
            for name in ("room", "push", "start_event", "stream_wait"):
                wrap(rounds.Rounds, name)
            wrap(native_rounds.Launcher, "push", "Launcher.push")
        prepared._cuda = _cuda
        from braid.comm import policy as policy_mod, shortcuts as shortcuts_mod
        wrap(policy_mod.SplitPolicy, "observation")
        wrap(shortcuts_mod.Shortcuts, "decide")
        wrap(prepared.PreparedHandle, "wait")
        wrap(exchange, "_capturing", "is_capturing")
        def timed_calls(f):
            dist.barrier()
            out = []
            for i in range(args.calls):
                if args.busy_cycles:            # the caller's stream busy, as inside a training step
                    torch.cuda._sleep(args.busy_cycles)
                t0 = time.perf_counter_ns()
                f()
                t1 = time.perf_counter_ns()
                out.append(t1 - t0)
                while time.perf_counter_ns() - t1 < args.gap_us * 1000:
                    pass
                if args.sync_every and i % args.sync_every == 0:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            return out
        if args.cprofile:               # the repeated calls under cProfile (rank 0's top entries by own time)
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            timed_calls(fn)
            prof.disable()
            if rank == 0:
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        total = timed_calls(fn)
        steps = {k: (v, cnt[k]) for k, v in acc.items()}      # the profile of these calls alone
        if args.nccl:                   # NCCL's own call in alternating windows with braid's
            nfn = _calls(None, args.op, args.nbytes, world, args.async_op)
            for _ in range(10):
                nfn()
            windows = []
            for _ in range(args.nccl):
                windows.append(("nccl", statistics.median(timed_calls(nfn)) / 1e3))
                windows.append(("braid", statistics.median(timed_calls(fn)) / 1e3))
            if rank == 0:
                print("windows (host per call median, us): " + ", ".join(f"{k} {v:.1f}" for k, v in windows))
                b = statistics.median(v for k, v in windows if k == "braid")
                c = statistics.median(v for k, v in windows if k == "nccl")
                print(f"{args.op} {args.nbytes} B: braid {b:.1f} us, NCCL {c:.1f} us, braid / NCCL {b / c:.2f}")
    if rank == 0:
        st = comm._prepared.stats
        if st.get("deferred"):
            print(f"deferred {st['deferred']}, native {st.get('native', 0)}, post to launch "
                  f"{st['launch_us'] / st['deferred']:.1f} us per deferred call")
        print(f"{args.op} {args.nbytes} B, gap {args.gap_us} us: host per call median {statistics.median(total) / 1e3:.1f} us, "
              f"mean {statistics.mean(total) / 1e3:.1f} us (wrapped: each wrapper adds ~0.3 us)")
        for k, (v, c) in sorted(steps.items(), key=lambda kv: -kv[1][0]):
            print(f"  {k:45s} {v / c / 1e3:8.2f} us per call x {c / args.calls:.1f}")
    # the cost of the round alone
    seg = comm.segment
    dist.barrier()
    ts = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        seg.read_values(seg.post_values([1, 0, 0, 0, 0, 0, 0]), "probe")
        ts.append(time.perf_counter_ns() - t0)
    if rank == 0:
        print(f"  a round of 7 words alone: median {statistics.median(ts) / 1e3:.1f} us")
    braid.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="all_gather")
    ap.add_argument("--nbytes", type=int, default=1 << 20)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--sync-every", type=int, default=0)
    ap.add_argument("--gap-us", type=int, default=0, help="spin this long between calls")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--own-gpus", action="store_true", help="a GPU per rank (default: the ranks share GPU 0)")
    ap.add_argument("--busy-cycles", type=int, default=0,
                    help="queue a GPU sleep of this many cycles on the caller's stream before each call")
    ap.add_argument("--async-op", action="store_true", help="all_reduce: async_op=True, then wait() (DDP's form)")
    ap.add_argument("--first", action="store_true", help="profile the shape's first call (cProfile) before timing repeats")
    ap.add_argument("--cprofile", action="store_true", help="profile the repeated calls (cProfile) before timing them")
    ap.add_argument("--first-only", action="store_true", help="with --first: stop after the first calls")
    ap.add_argument("--nccl", type=int, default=0,
                    help="then this many windows each of NCCL's own call through torch and braid's, alternating")
    a = ap.parse_args()
    mp.spawn(worker, args=(a.nproc, 29400 + os.getpid() % 500, a), nprocs=a.nproc)
