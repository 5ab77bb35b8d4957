"""Faults on CPU worlds: every surviving rank raises within BRAID_TIMEOUT_S + 5 s, nothing is
left in /dev/shm.

Each scenario runs a loop of split-size calls (all_reduce on even calls, all_gather_into_tensor on
odd ones; gloo + shm lanes, BRAID_MIN_SPLIT_KB=1, BRAID_TIMEOUT_S=5) and injects one fault at
call 3 or 4 on one rank:
- kill: the rank posts call 3 (an all_gather of 16 MB, async: in flight on both lanes; a split
  all_reduce on CPU returns only once done even with async_op=True) and SIGKILLs itself;
- exit0: the rank leaves with os._exit(0) before call 3;
- raise: the rank raises an exception instead of making call 4; its process lives on (its
  handler closes the communicator and waits), so the peers cannot learn it from a dead pid;
- skip: the rank skips call 3 and goes on with the next call (call sizes differ per call);
- dtype: the rank passes int32 where the others pass float32, same byte count;
- dtype_whole: the same at a size gloo's own collective takes whole (set calibration), under
  BRAID_CHECK=1 (without it braid makes only local checks on that path, README);
- boundary: a 2-rank world where rank 1's call is small enough for gloo's own collective and rank
  0's large enough to split (set calibration).
"Surviving ranks": every rank but the one that died or raised on its own; in skip, dtype and
boundary every rank. Times are measured from the fault (the faulting rank's clock reading just
before it; the same machine's wall clock) to each survivor's raise. After raising, a rank stays
alive (communicator open, no more calls) until every survivor has raised or the bound has passed,
so no survivor is released by a peer's exit; then it closes braid and leaves with os._exit(0).
A world that still hangs is terminated by run_world after WORLD_TIMEOUT_S.

Already covered elsewhere (not repeated here): tests/test_errors_and_hygiene.py has a peer that
never makes a call (it sleeps, BraidTimeoutError), a peer that exits with os._exit(1) before the
first call (3 ranks) and with an async split call in flight (2 ranks), both without a time bound,
and a dtype mismatch of the same byte count under fixed gloo + shm shares (all_gather);
tests/test_call_ledger.py has the whole/split boundary mismatch as seen by the splitting rank
(PeerMismatchError within 10 s, the gloo rank released when the other's process ends),
braid.abort() reaching a waiting peer, and the timeout's message.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import tempfile
import time

import pytest
import torch

from conftest import WorkerError, braid_shm_entries, run_world

TIMEOUT_S = 5.0
BOUND_S = TIMEOUT_S + 5.0
WORLD_TIMEOUT_S = 40.0
ENV = {"BRAID_TIMEOUT_S": str(TIMEOUT_S), "BRAID_MIN_SPLIT_KB": "1", "CUDA_VISIBLE_DEVICES": ""}
CALLS = 8
SPLIT_N = 150_001              # float32 elements (600 KB): split over gloo + shm by the built-in model
KILL_N = 4_000_001             # 16 MB: the killed rank's last call is still moving when it dies
BIG_N = 600_001                # 2.4 MB: split under FAST_LANES
WHOLE_N = 1_001                # 4 KB: gloo's own call under FAST_LANES
FAST_LANES = {"gloo": {"latency_us": 10.0, "bw_gbps": 1.0, "floor_us": 10.0},
              "shm": {"latency_us": 100.0, "bw_gbps": 10.0, "floor_us": 100.0}}


def _write(folder: str, name: str, data: dict) -> None:
    p = pathlib.Path(folder)
    tmp = p / f".{name}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(p / f"{name}.json")


def _read(folder: str, name: str):
    f = pathlib.Path(folder) / f"{name}.json"
    return json.loads(f.read_text()) if f.exists() else None


def _hold(folder: str, survivors: list[int]) -> None:
    """Stay alive until every survivor reported or the bound after the fault has passed."""
    while True:
        fault = _read(folder, "fault")
        if all(_read(folder, f"rank{r}") is not None for r in survivors):
            return
        if fault is not None and time.time() > fault["t"] + BOUND_S + 1.0:
            return
        time.sleep(0.05)


def _leave(comm) -> None:
    """Close braid here (local, no collective) and leave without torch.distributed's teardown,
    which may wait on a dead peer or a dead store."""
    try:
        import braid
        comm.close()
        braid.close()
    finally:
        os._exit(0)


def _call(comm, k: int, n: int, dtype, rank: int, w: int, async_op: bool = False, dev=None):
    """Call k of the loop: all_reduce on even k, all_gather_into_tensor on odd k (inputs filled
    with rank + 1, on `dev`: None is the CPU). Returns (handle, check)."""
    t = torch.full((n,), rank + 1, dtype=dtype, device=dev)
    if k % 2 == 0:
        h = comm.all_reduce(t, async_op=async_op)
        return h, lambda: bool((t == w * (w + 1) // 2).all())
    out = torch.empty(n * w, dtype=dtype, device=dev)
    h = comm.all_gather_into_tensor(out, t, async_op=async_op)
    return h, lambda: torch.equal(out, torch.arange(1, w + 1, dtype=dtype, device=dev).repeat_interleave(n))


def _fault_worker(rank: int, w: int, scenario: str, faulty: int, fault_at: int, survivors: list[int], folder: str,
                  dev=None, lanes=None):
    """One rank of a fault scenario. `dev`: where the tensors live (None: CPU); `lanes`: a
    calibration given to every scenario (GPU worlds), else FAST_LANES where a scenario needs one."""
    import braid
    from braid import envs
    comm = braid.init()
    if scenario in ("dtype_whole", "boundary") or lanes is not None:
        table = {f"{op}/{w}": dict(lanes or FAST_LANES) for op in ("all_reduce", "all_gather")}
        if scenario == "dtype_whole":
            with envs.override(BRAID_CHECK="1"):        # read when a communicator is made
                comm = braid.Communicator()
        comm.set_calibration(table)
    base = WHOLE_N if scenario == "dtype_whole" else SPLIT_N

    def size(k: int) -> int:          # differs per call: a skipped call shows as a mismatch
        if scenario.startswith(("kill", "abort")) and k == fault_at:
            return KILL_N             # long enough to be cut in the middle
        if scenario == "boundary" and k == fault_at:
            return BIG_N if rank == 0 else WHOLE_N
        return base + 64 * k

    import faulthandler
    stacks = open(os.path.join(folder, f"stacks{rank}.txt"), "w")
    faulthandler.dump_traceback_later(WORLD_TIMEOUT_S - 8, file=stacks)   # what a hung rank waits in
    k, t_call, wrong_at = 0, time.time(), None
    try:
        while k < CALLS:
            n, dtype = size(k), torch.float32
            if rank == faulty and k == fault_at:
                if scenario.startswith("kill"):
                    _call(comm, k, n, dtype, rank, w, async_op=True, dev=dev)   # in flight on both lanes
                    _write(folder, "fault", {"t": time.time(), "rank": rank})
                    os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(60)
                if scenario == "abort_async":      # this rank's own call in flight, then abort
                    h, _ = _call(comm, k, n, dtype, rank, w, async_op=True, dev=dev)
                    _write(folder, "fault", {"t": time.time(), "rank": rank})
                    t_call = time.time()
                    comm.abort("injected abort")
                    h.wait()       # raises, or returns where the call had ended before the abort
                    k += 1
                    continue       # the next call must raise
                _write(folder, "fault", {"t": time.time(), "rank": rank})
                if scenario == "exit0":
                    os._exit(0)
                if scenario.startswith("raise"):
                    raise RuntimeError("injected: this rank's step failed")
                if scenario == "skip":
                    k += 1
                    continue
                if scenario.startswith("dtype"):
                    dtype = torch.int32
            t_call = time.time()
            _, check = _call(comm, k, n, dtype, rank, w, dev=dev)
            if not check():
                # on a GPU a call returns once queued: a fault cuts a call whose output the next
                # call or wait then declares void by raising (NCCL's contract too)
                assert dev is not None and wrong_at is None, f"call {k}: wrong result"
                wrong_at = k
            k += 1
        assert wrong_at is None, f"call {wrong_at}: wrong result, and no braid call raised after it"
    except Exception as exc:              # noqa: BLE001  the point of the test
        injected = isinstance(exc, RuntimeError) and str(exc).startswith("injected")
        t_raise = time.time()
        if not injected:
            fault = _read(folder, "fault")
            _write(folder, f"rank{rank}", {
                "raised": type(exc).__name__, "msg": (str(exc).splitlines() or [""])[0][:300],
                "call": k, "wrong_before": wrong_at, "after_fault_s": round(t_raise - fault["t"], 2) if fault else None,
                "after_call_start_s": round(t_raise - t_call, 2)})
        _hold(folder, survivors)
        _leave(comm)
    _write(folder, f"rank{rank}", {"raised": None, "call": k})
    _hold(folder, survivors)
    _leave(comm)


# scenario -> (world size, faulty rank, call of the fault, survivors, expected error types,
# allowed exit codes). Calls 3 are all_gathers, calls 4 all_reduces.
SCENARIOS = {
    "kill": (3, 1, 3, [0, 2], {"LaneFailureError", "BraidTimeoutError"}, {1: -signal.SIGKILL}),
    "exit0": (3, 0, 3, [1, 2], {"LaneFailureError", "BraidTimeoutError"}, {}),
    "raise": (3, 2, 4, [0, 1], {"LaneFailureError", "BraidTimeoutError", "PeerMismatchError"}, {}),
    "skip": (3, 1, 3, [0, 1, 2], {"PeerMismatchError"}, {}),
    "dtype": (3, 2, 4, [0, 1, 2], {"PeerMismatchError"}, {}),
    "dtype_whole": (2, 1, 4, [0, 1], {"PeerMismatchError"}, {}),
    "boundary": (2, 1, 4, [0, 1], {"PeerMismatchError", "LaneFailureError", "BraidTimeoutError"}, {}),
}

# the same faults on a world of 2 pretend nodes of 2 ranks with the node and rail steps on for every
# call: survivors on the faulty rank's node and on the other node
NODES_ENV = {"BRAID_FAKE_NODES": "2", "BRAID_HIER": "1", "BRAID_HIER_MIN_BYTES": "0"}
SCENARIOS.update({
    "kill_nodes": (4, 1, 3, [0, 2, 3], {"LaneFailureError", "BraidTimeoutError"}, {1: -signal.SIGKILL}),
    "raise_nodes": (4, 2, 4, [0, 1, 3], {"LaneFailureError", "BraidTimeoutError", "PeerMismatchError"}, {}),
})

def _run(scenario: str, worker=_fault_worker, env: dict | None = None, init_pg: bool = True,
         scenarios: dict | None = None, allowed_exit: dict | None = None) -> dict:
    """Run a scenario's world; `allowed_exit`: exit codes beyond the scenario's own, per rank."""
    w, faulty, fault_at, survivors, _, allowed = (scenarios or SCENARIOS)[scenario]
    allowed = {**(allowed_exit or {}), **allowed}
    if env is None:
        env = dict(ENV, **NODES_ENV) if scenario.endswith("_nodes") else ENV
    info: dict = {}
    with tempfile.TemporaryDirectory(prefix="braid-fault-") as folder:
        t0 = time.monotonic()
        hung = None
        try:
            run_world(worker, w, scenario, faulty, fault_at, survivors, folder, env=env, timeout=WORLD_TIMEOUT_S,
                      allowed_exit=allowed, info=info, init_pg=init_pg)
        except WorkerError as exc:        # a hang: the reports written so far still say what happened
            hung = str(exc)[:3000]
        wall = time.monotonic() - t0
        reports = {r: _read(folder, f"rank{r}") for r in range(w)}
        decided = {r: _read(folder, f"ended{r}") for r in range(w)}      # GPU workers: braid's end
        fault = _read(folder, "fault")
        if hung:
            for r in range(w):
                f = pathlib.Path(folder) / f"stacks{r}.txt"
                if reports[r] is None and f.exists() and f.stat().st_size:
                    hung += f"\n--- rank {r}'s threads before the world was terminated:\n" + f.read_text()[-6000:]
    left = {e for e in braid_shm_entries() if any(e.startswith(f"braid-{p}-") for p in info.get("pids", []))}
    return {"reports": reports, "fault": fault, "hung": hung, "wall": wall, "shm_left": left,
            "exits": info.get("exits", {}), "decided": {r: d["t"] for r, d in decided.items() if d}}


def check_survivors(scenario: str, res: dict, capsys, scenarios: dict | None = None, what: str = "fault",
                    ended_by_braid: float | None = None) -> None:
    """Print what every survivor raised and when; assert each raised an expected braid error
    within BOUND_S of the fault, no world hung, nothing left in /dev/shm. `ended_by_braid`: a
    survivor may instead have been ended by braid (exit code 70: its NCCL abort did not release
    it) within BOUND_S + that many seconds."""
    w, faulty, _, survivors, expected, _ = (scenarios or SCENARIOS)[scenario]
    fault_t = (res["fault"] or {}).get("t")
    lines = []
    # ended by braid: exit code 70, decided within the bound (where the worker noted when braid
    # decided; else the exit's own time, which also counts the driver's teardown of the process)
    decided = res.get("decided", {})
    ended = {r for r in survivors if res["reports"][r] is None and ended_by_braid is not None
             and res["exits"].get(r, (None,))[0] == 70 and fault_t is not None
             and decided.get(r, res["exits"][r][1]) - fault_t <= BOUND_S + ended_by_braid}
    for r in survivors:
        rep = res["reports"][r]
        if r in ended:
            when = (f"decided {decided[r] - fault_t:.1f} s, exited {res['exits'][r][1] - fault_t:.1f} s"
                    if r in decided else f"{res['exits'][r][1] - fault_t:.1f} s")
            lines.append(f"rank {r}: ended by braid (exit code 70) {when} "
                         f"after the fault: its NCCL abort did not release it")
        elif rep is None:
            lines.append(f"rank {r}: no report (hung until the world was terminated)")
        else:
            lines.append(f"rank {r}: {rep.get('raised')} after {rep.get('after_fault_s')} s "
                         f"(call {rep.get('call')}): {rep.get('msg', '')[:160]}")
    with capsys.disabled():
        print(f"\n{what} {scenario} (world of {w}, rank {faulty} faulty, bound {BOUND_S:.0f} s, "
              f"world {res['wall']:.1f} s):\n  " + "\n  ".join(lines))
    assert res["fault"] is not None, res
    assert not res["shm_left"], res["shm_left"]
    for r in survivors:
        rep = res["reports"][r]
        if r in ended:
            continue
        assert rep is not None, f"{scenario}: rank {r} never raised\n" + "\n".join(lines) + f"\n{res['hung']}"
        assert rep["raised"] in expected, f"{scenario}: rank {r}: " + "\n".join(lines)
        assert rep["after_fault_s"] is not None and rep["after_fault_s"] <= BOUND_S, \
            f"{scenario}: rank {r} took {rep['after_fault_s']} s (bound {BOUND_S} s)\n" + "\n".join(lines)
    assert res["hung"] is None, res["hung"]


@pytest.mark.parametrize("scenario", [
    "kill", "exit0", "raise", "skip", "dtype", "dtype_whole", "kill_nodes", "raise_nodes",
    "boundary",
])
def test_survivors_raise_in_time(scenario, capsys):
    check_survivors(scenario, _run(scenario), capsys)
