"""Every BRAID_* setting, typed, in one place.

Only this module reads the environment. Each setting is parsed when it is read (so a test can
change it with `braid.envs.override(...)`), and has a meaning, its values and a default below.
Rejected: reading os.environ in the lanes themselves (settings then hide in many files and tests
have to patch the environment of a library).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .errors import MisuseError
from .planner.pieces import MIN_PIECE_BYTES, TAPER_FROM_BYTES


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0/1/true/false, got {text!r}")


def _lanes(text: str) -> tuple[str, ...] | None:
    text = text.strip().lower()
    if text in ("", "auto"):
        return None
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {value}")
    return value


def _nonneg_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError(f"expected 0 or a positive number, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError(f"expected a positive number, got {value}")
    return value


_SETTINGS: dict[str, Setting] = {}


def _define(name: str, parse: Callable[[str], Any], default: Any, doc: str) -> None:
    _SETTINGS[name] = Setting(name, parse, default, doc)


_define("BRAID_LANES", _lanes, None,
        "Comma list of lanes braid may use (nccl, ce, host, gloo, shm; relay for routed plans), "
        "or 'auto' for every available lane for the tensor's device. Lanes named here but not available are skipped "
        "with one log line.")
_define("BRAID_HOST_BUFFER_MB", _positive_int, 64,
        "Pinned shared host memory per rank for the host and shm lanes, in MiB. Half feeds the "
        "collective ring, half the point-to-point rings; a GPU communicator adds 4 slots of the "
        "collective ring's size per rank for the host lane's replayed graphs, and 4 slots of the "
        "point-to-point rings' size per direction for its repeated send/recv.")
_define("BRAID_HOST_CHUNK_KB", _positive_int, 4096,
        "Chunk (slot) size of the host and shm lanes in KiB; FlexLink used 4 MB slots.")
_define("BRAID_RELAY_BUFFER_MB", _positive_int, 64,
        "Staging buffer per rank for the relay lane (rank a -> rank b -> rank c), in MiB, cut into "
        "4 slots: device memory on GPUs, shared host memory for CPU tensors (shrunk to fit "
        "/dev/shm). It caps what relaying through a rank can take from that rank's memory.")
_define("BRAID_CHECK", _bool, False,
        "1: check every call across ranks (sizes, dtypes, roots, split sizes) even where braid "
        "would otherwise take NCCL's own path without an exchange.")
_define("BRAID_TIMEOUT_S", _positive_float, 300.0,
        "Seconds a rank waits for its peers to reach the same call before raising BraidTimeoutError.")
_define("BRAID_ABORT_EXIT_S", _nonneg_float, 30.0,
        "After braid gives up on a GPU communicator (a peer died, aborted or timed out), seconds "
        "it lets NCCL's abort take to release a call blocked in NCCL before it ends the process "
        "itself (exit code 70, the cause on stderr), as torch ends a process after an NCCL error: "
        "a rank stuck in an NCCL kernel cannot be given an exception. 0: never end it.")
_define("BRAID_BENCH_HOST_MEMORY_GB", _nonneg_float, 0.0,
        "Host memory in GiB that `braid bench` on CPU tensors may fill with a point's buffers, "
        "every rank's together (braid's, the baseline's, the check's); a point that would need "
        "more than 80% of it is not run, and its table says so, rather than have the kernel kill "
        "a rank. 0: what the host (or its memory cgroup, if smaller) can give at that point.")
_define("BRAID_CACHE_DIR", str, os.path.join(os.path.expanduser("~"), ".cache", "braid"),
        "Where lane calibrations are cached (one JSON per machine/software key).")
_define("BRAID_CALIBRATE", str, "auto",
        "auto: use the cached calibration when there is one for this machine (made by `braid "
        "calibrate` or `braid bench`), else none (GPU calls then go to NCCL whole, see "
        "BRAID_SPLIT_UNMEASURED); force/off: ignore the cache.")
_define("BRAID_SPLIT_UNMEASURED", _bool, False,
        "0 (default): on GPUs, an op and size the calibration has not measured (no calibration cached "
        "for this machine, or one without that op) goes to NCCL whole: the built-in lane model alone "
        "split DDP's 25 MiB all_reduce over the copy engines, host staging and NCCL and made its steps "
        "1.9x slower on 2 x H200. 1: the built-in lane model splits such calls (CPU lanes always use "
        "it). Rank 0's setting applies on every rank.")
_define("BRAID_MIN_SPLIT_KB", _positive_int, 256,
        "Pieces of a transfer smaller than this are not split across lanes.")
_define("BRAID_NEAR_TRIAL", _nonneg_float, 0.0,
        "On GPUs, an all_reduce, reduce_scatter or all_gather size where the calibration timed NCCL alone "
        "faster than the copy engines alone, but by less than this factor (1.5, say), goes to the copy "
        "engines on trial inside the job: the job's own pace decides whole or split per call shape (in a "
        "training step NCCL's kernels share the SMs with the compute, the copy engines do not). 0 "
        "(default): such sizes stay NCCL's (no job measured faster with it yet). Rank 0's value applies "
        "on every rank.")


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"expected 0 or a positive integer, got {value}")
    return value


_define("BRAID_CPU_NATIVE", _bool, True,
        "1 (default): a CPU communicator's all_reduce, reduce and reduce_scatter (float32, float64, "
        "bfloat16, float16, int32 and int64 sums, averages, minima, maxima and products), all_gather, "
        "all_to_all_single and broadcast of 256 KiB and more run in native threads (comm/_cpucoll.c, compiled with the "
        "system's C compiler on first use into BRAID_CACHE_DIR), and smaller reductions of 3 ranks and "
        "more reduce in the same library on the caller's thread; 0: rounds in Python for all of them. "
        "Every rank must have the same setting.")
_define("BRAID_SPLIT_MARGIN_PCT", _nonneg_int, 5,
        "Calibration: a split over several lanes is kept for a size only where it measured this many "
        "percent faster than the fastest single lane (in a job a split costs more than its timed calls "
        "show: posted calls for the balancer, rebuilds at its moves). Read when calibrating (rank 0's).")
_define("BRAID_CPU_THREADS", _nonneg_int, 0,
        "Threads per rank of the native CPU collectives (the ranks take the least any of them asks); "
        "0: torch's intra-op threads, at most this process's cores divided by the ranks.")
_define("BRAID_CPU_STRIPE_KB", _positive_int, 128,
        "Native CPU collectives: KiB of a call per thread at least (the input's; reduce_scatter's and "
        "all_to_all's output); a "
        "smaller call runs on fewer of BRAID_CPU_THREADS (each more wakes a thread and waits on one more).")
_define("BRAID_CPU_CHUNK_KB", _positive_int, 256,
        "Native CPU collectives: KiB of data per rank and chunk of a thread's stripe (small enough to "
        "stay in the caches between a rank's copy in and the others' reduction).")
# in the order of _cpucoll.c's K_* kinds of call: op i is bit 1 << i (native_cpu.kinds)
NATIVE_CPU_OPS = ("all_reduce", "reduce", "reduce_scatter", "all_to_all", "all_gather", "broadcast")


def _native_ops(text: str) -> tuple[str, ...]:
    """A comma list of the native CPU collectives' ops, 'all' or 'none'."""
    low = text.strip().lower()
    if low == "all":
        return NATIVE_CPU_OPS
    if low in ("", "none", "0"):
        return ()
    ops = {part.strip() for part in low.split(",") if part.strip()}
    bad = sorted(ops - set(NATIVE_CPU_OPS))
    if bad:
        raise ValueError(f"unknown op(s) {', '.join(bad)}; expected a comma list of "
                         f"{', '.join(NATIVE_CPU_OPS)}, 'all' or 'none'")
    return tuple(op for op in NATIVE_CPU_OPS if op in ops)


_define("BRAID_CPU_LAG", _native_ops, ("all_gather",),
        "Native CPU collectives whose chunks run a turn apart (comma list of all_reduce, reduce, "
        "reduce_scatter, all_to_all, all_gather, broadcast; 'all'; 'none'): a rank copies a chunk in one turn "
        "before it takes it (reduces it, or copies it out), so a wait is for what a peer did a turn "
        "earlier; the others run each chunk's steps back to back.")
_define("BRAID_CPU_STREAM", _native_ops, ("all_gather",),
        "Native CPU collectives whose copies from other ranks' chunks into a rank's own tensor use "
        "stores that bypass the caches (x86; same list as BRAID_CPU_LAG); the others copy plainly.")
_define("BRAID_CPU_A2A_BIG_MB", _nonneg_int, 16,
        "Native CPU all_to_all_single of this many MiB a rank and more, in communicators of 4 ranks "
        "and more, runs a turn apart with copies past the caches (as BRAID_CPU_LAG and "
        "BRAID_CPU_STREAM with all_to_all would; 16-64 MiB at 4-16 ranks took 0.68-0.92 of the "
        "time on a 2-core and a 16-vCPU host); 0: never. Smaller ones and 2-3 ranks keep those settings.")


def _c_round(text: str) -> int | None:
    """'auto' (or empty): None; else a rank count, 0 or more."""
    return None if text.strip().lower() in ("", "auto") else _nonneg_int(text)


_define("BRAID_CPU_C_ROUND_RANKS", _c_round, None,
        "Native CPU calls of a communicator of at most this many ranks run their header round (the "
        "ranks agree on the call, its stripes and chunk) in C with the call, handed to Python when a "
        "peer is over 5 ms late; larger ones, and 0, run it in Python before the call. auto "
        "(default): 4, and any world of more ranks than the cores this process may run on (2 cores: "
        "2 ranks' 256 KiB-1 MiB calls 13-29% faster in C, 8 and 16 ranks' 256 KiB-4 MiB calls 0.51-0.96 of the time; 8 ranks "
        "of 16 vCPUs not yet measured with it). Ranks may differ: both write the same header.")
_define("BRAID_CPU_SLOW_YIELD_US", _nonneg_int, 500,
        "CPU collectives through shared memory: a wait whose yield gave the core away this long "
        "(other processes or threads want the cores) sleeps on its counter from then on, for a few "
        "calls, woken by the rank that raises it; 0: waits never switch to sleeping.")
_define("BRAID_CPU_ROUND_KB", _nonneg_int, 0,
        "CPU tensors through the node segment: data per rank in one round of all_reduce and "
        "reduce_scatter, in KiB (smaller rounds keep a round's data in the CPU's caches between "
        "the copy in and the reduction, at the cost of more rounds); 0: half the rank's "
        "collective area (16 MiB with BRAID_HOST_BUFFER_MB=64).")
_define("BRAID_CE_PIECE_MB", _nonneg_int, 0,
        "Piece size of the copy engines' pipelined reduction in MiB (experiments); 0 = braid's "
        "rule (planner/pieces.py: every chunk in 4 pieces of BRAID_CE_MIN_PIECE_MB to 256 MiB).")
_define("BRAID_CE_MIN_PIECE_MB", _positive_int, MIN_PIECE_BYTES >> 20,
        "The smallest piece of the copy engines' pipelined reduction in MiB (planner/pieces.py: "
        "every chunk in 4 pieces of at least this size). Must be the same on every rank.")
_define("BRAID_CE_BATCH", _bool, True,
        "Post the copy engines' flag operations of one step (a wait and its reset, the flags of "
        "every peer) as one batch of stream memory operations, one node of a replayed graph; 0: "
        "one operation at a time (a fallback for a driver that rejects batches).")
_define("BRAID_CE_PUSH", _bool, True,
        "In the copy engines' all_reduce, push each reduced piece into every peer's output (and "
        "end when every peer's last piece has come) instead of letting the peers pull it and "
        "closing with a handshake; 0: pull. The copy engines' reduce always pushes (to the root). "
        "Must be the same on every rank.")
_define("BRAID_CE_PRIORITY", _bool, False,
        "1: the copy engines' streams (the lane's, its captured programs' and the pipelined reduction's) "
        "are made at CUDA's highest stream priority, so that the reduction's kernels take SMs ahead of "
        "a training step's compute kernels as they free up (a graph's kernels run at the priority of "
        "the stream it is launched into); 0 (default): normal priority. Read when the streams are made.")
_define("BRAID_CE_TAPER", _bool, True,
        "Taper the end of each chunk of the copy engines' pipelined reduction into smaller pieces "
        "(planner/pieces.py: pieces of 64 MiB and up). Must be the same on every rank.")
_define("BRAID_CE_TAPER_FROM_KB", _nonneg_int, TAPER_FROM_BYTES >> 10,
        "The smallest piece, in KiB, whose chunk gets the tapered end (tests lower it). Must be the "
        "same on every rank.")


def _route(text: str) -> str:
    value = text.strip().lower()
    if value not in ("auto", "on", "off"):
        raise ValueError(f"BRAID_ROUTE must be auto, on or off (got {text!r})")
    return value


_define("BRAID_ROUTE", _route, "auto",
        "Skewed all_to_all_single through the router (per-pair lane mixes): auto = when a pair "
        "carries more than 1 MiB and 1.5x the mean and the routed plan is predicted 3% faster than "
        "NCCL's own call (predictions corrected per kind of matrix by what steady calls of each "
        "side measured; the side not in use is tried in blocks of 4 calls now and then); "
        "on = always (tests); off = never. On a world of several nodes, on also sends every uneven "
        "all_to_all_single over every NIC rail as the hierarchical router plans it; auto and off leave "
        "those to NCCL whole.")
_define("BRAID_FAKE_NODES", _positive_int, 1,
        "For tests: split one host's ranks into this many pretend nodes of equal size (ranks in "
        "order: the first world/N ranks are node 0). Each pretend node gets its own segment and "
        "lanes; the steps between nodes run on gloo (CPU) or NCCL (GPU) rail groups, as between "
        "real hosts. Must divide the world size; the same on every rank.")
_define("BRAID_HIER", _bool, False,
        "1: on a world of several nodes, run large calls as node steps on braid's lanes plus rail "
        "steps on NCCL/gloo (one group per local rank). Off by default: such calls go to NCCL (gloo) "
        "whole, as NCCL's own hierarchical algorithms run them, since the steps have not been "
        "measured against NCCL on a real cluster. Must be the same on every rank.")
_define("BRAID_HIER_MIN_BYTES", _nonneg_int, 1 << 20,
        "With BRAID_HIER=1: calls of at least this many bytes (a rank's input of all_gather, "
        "reduce_scatter and all_to_all, the tensor of all_reduce and broadcast) run as steps; smaller "
        "ones go to the native library whole. Must be the same on every rank.")
_define("BRAID_HIER_PIECE_KB", _nonneg_int, 0,
        "With BRAID_HIER=1: run a multi-node all_reduce in pieces of about this size (at most 8), "
        "the rail step of one piece beside the node steps of the next; 0 (default) = one piece. "
        "On CPU pretend nodes 4 MiB pieces made 16-64 MiB calls 2x slower (each piece's node steps "
        "cost milliseconds of host time); for real nodes, where the network step dominates, it is "
        "untested. Must be the same on every rank.")
_define("BRAID_SHARED_GPU", _bool, False,
        "1: ranks may share a GPU, a development mode: exact results and braid's host (CPU) time per "
        "call with 2-4 ranks on one GPU. NCCL refuses two ranks of one host on one GPU, so each rank "
        "also needs an NCCL_HOSTID of its own before NCCL starts (share_gpu(rank); `import braid` sets "
        "it from torchrun's RANK, `braid bench` and the GPU tests set it): NCCL then takes every rank "
        "for a host of its own and runs over its network transport, and the ranks' kernels take turns "
        "on the GPU, so times measured this way are host-cost figures, not link speeds. Off: two ranks "
        "of one host on one GPU are an error.")
_define("BRAID_PREPARED", _bool, True,
        "1 (default): a repeated split collective is agreed and built once and replayed (one round of "
        "a few words between ranks; on the copy engines alone, one CUDA graph launch), and a repeated "
        "split send/recv is named by its sender in one message (on the copy engines alone the send "
        "does not wait for its receiver); 0: every split call exchanges descriptors and posts its "
        "lanes from scratch (for comparison). Must be the same on every rank.")
_define("BRAID_DEFER", _bool, False,
        "1: a repeated GPU call that replays a prepared program on the copy engines returns once this "
        "rank's word is posted; a thread of the communicator reads the other ranks' words and launches "
        "the program, and the caller's stream (or the async handle's waiter) waits for its end on the GPU, "
        "as with NCCL's own call, instead of the caller's CPU waiting for the slowest rank. 0 (default): "
        "the caller reads the round and launches (training steps measured no faster with 1: the launch "
        "then waits for the slowest rank on the thread instead). Must be the same on every rank.")
_define("BRAID_DEFER_NATIVE", _bool, True,
        "With BRAID_DEFER=1: a native thread (comm/_rounds.c, compiled with the system's C compiler on "
        "first use into BRAID_CACHE_DIR) reads the rounds and launches the programs without Python's "
        "interpreter lock; what it cannot decide goes back to the Python thread. 0, or no compiler: the "
        "Python thread does everything.")
_define("BRAID_NATIVE_CALL", _bool, True,
        "1 (default): a repeated GPU call that replays a prepared program on the copy engines does its "
        "word, the round of words with the other ranks and the launch in one native call (comm/_rounds.c, "
        "compiled with the system's C compiler on first use into BRAID_CACHE_DIR); anything unusual (a "
        "word that differs, a late peer, a capture) goes on in Python. An uneven all_to_all on the copy "
        "engines posts its copies and signals in one native call too. 0, or no compiler: all in Python.")
_define("BRAID_DEFER_SWITCH_US", _nonneg_int, 200,
        "With BRAID_DEFER=1: the interpreter's thread switch interval (sys.setswitchinterval) is lowered "
        "to this many microseconds when the first such communicator is made (never raised; it stays for "
        "the process). The rounds thread needs the interpreter lock to read a round and launch; while the "
        "caller's thread runs Python without a break it gets the lock only at that interval (5 ms by "
        "default: a sleeping thread waited 5.2 ms for it in a probe, 0.4 ms at 200 us). 0: leave it.")
_define("BRAID_CPU_SHM", _bool, True,
        "1 (default): on a CPU communicator whose ranks share one host, all_reduce, reduce, reduce_scatter, "
        "all_gather, broadcast and all_to_all_single of contiguous tensors, every untagged send/recv and "
        "the backend's barrier run whole through the node's shared memory "
        "(no gloo, no lanes); 0: the calibration's split over the shm and gloo lanes, or gloo whole. "
        "Explicit shares (fixed_shares, --shares) always run the lanes. Must be the same on every rank.")
_define("BRAID_LEARN_SPLIT", _bool, True,
        "1 (default): a GPU call of a shape the calibration splits is tried in the job itself, split "
        "and whole by turns (paired blocks of whole steps of the job, whose period the trial finds, "
        "until the difference stands out of the noise; again 4096 calls after a verdict), and the "
        "shape keeps whichever kept the job's pace; fixed "
        "shares and the op rows of `braid bench` keep the calibration's verdict. 0: the calibration "
        "alone decides. Must be the same on every rank.")
def _pace(text: str) -> str:
    value = text.strip().lower()
    if value not in ("gpu", "host", "max"):
        raise ValueError(f"BRAID_TRIAL_PACE must be gpu, host or max (got {text!r})")
    return value


_define("BRAID_TRIAL_PACE", _pace, "gpu",
        "How the in-job trials time a block of calls: gpu (default), the GPU's time between timing "
        "events recorded on the caller's stream at the block's first and last calls (a job whose host "
        "runs ahead of its GPU shows its speed there); host, the host's clock between those calls; max, "
        "the longer of the two (a mode whose host is slower than its GPU is timed at its host's pace).")
def _block(text: str) -> int:
    value = int(text)
    if value < 4:
        raise ValueError(f"BRAID_TRIAL_BLOCK must be at least 4 (got {value})")
    return value


def _handoff(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"BRAID_HANDOFF must be 0 (never) or a number of calls (got {text!r})")
    return value


_define("BRAID_HANDOFF", _handoff, 256,
        "Under init_process_group(\"braid\"): every this many calls that go whole, the "
        "backend looks whether every call since its last look went whole with no in-job trial under way "
        "and no fixed shares; then the all_reduce, all-gather and reduce-scatter of the shapes seen go "
        "straight to the inner NCCL (gloo) group, without braid's Python per call, until the shares are fixed, "
        "a calibration is loaded, or the group closes (those shapes are not tried again meanwhile). "
        "0: never.")
_define("BRAID_TRIAL_BLOCK", _block, 12,
        "Calls per block of the in-job trials' paired blocks (one block split, one whole), at least: "
        "a block is a whole number of the job's periods (its calls of the shape per step, found by the "
        "trial); at least 4.")
_define("BRAID_TRIAL_WATCH", _bool, True,
        "1 (default): while an in-job trial's verdict keeps a call shape split, the job's own pace is "
        "timed and, where on some rank it runs slower than the whole pace the trial measured (by more "
        "than 2%, beyond its margin of error), the shape goes whole until its next trial; 0: kept "
        "splits stay split until then. Every rank must have the same setting.")
_define("BRAID_TRIAL_LOG", str, "",
        "A file name: each rank appends the in-job trials' findings to it, the rank's number added to "
        "the name: per shape the period found (calls a step), then one line per timed block (shape, "
        "block number, mode, us a call; 'built' where a prepared call was built in or before it). "
        "Empty (default): no log.")
_define("BRAID_WARM", _bool, True,
        "1 (default): a GPU communicator, when made, captures and replays one small program (a copy, "
        "flag operations, the float32 and bfloat16 sum kernels) so that the process's first split "
        "call does not pay the kernels' first load and the first graph's setup; a CPU communicator "
        "builds (once per machine, ~1.3 s on 2 cores) and loads its native collectives and starts "
        "their threads, which its first call would otherwise do; 0: skip it.")
_define("BRAID_PREPARED_MAX", _positive_int, 64,
        "Prepared calls a communicator keeps (least recently used go first), and prepared send/recv "
        "shapes per direction; each holds its agreed descriptors and plan, and a prepared collective "
        "on the copy engines alone a CUDA graph.")
_define("BRAID_A2AV_CE_MIN_MB", _nonneg_int, 32,
        "An uneven all_to_all_single on GPUs whose shares are the copy engines' alone runs on them "
        "from this size (the largest row or column of its matrix, MiB) and goes to NCCL whole below "
        "it: its copies are posted every call (its sizes change), which costs more host time than a "
        "graph replay (2 x H200, 2026-11-26: an MoE layer's exchange on the copy engines at "
        "0.45-0.62 of NCCL at 4-16 MiB, 1.14-1.22 at 64-256 MiB). On two ranks a call whose larger "
        "direction is below half of it goes to NCCL without a round. Fixed shares ignore it. Read "
        "when the communicator is made; must be the same on every rank.")
_define("BRAID_LOG_LEVEL", str, "WARNING", "Log level of the 'braid' logger (debug: one line per "
        "skewed all_to_all routing decision, with its corrections and trial state).")


def get(name: str) -> Any:
    """Value of setting `name`, parsed; the default when unset."""
    setting = _SETTINGS[name]
    raw = os.environ.get(name)
    if raw is None:
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError as exc:
        raise MisuseError(f"{name}={raw!r} is invalid: {exc}. {setting.doc}") from None


def shared_gpu_env(rank: int) -> dict[str, str]:
    """What rank `rank` adds to its environment, before NCCL starts, to share a GPU with other
    ranks: BRAID_SHARED_GPU=1 and an NCCL_HOSTID of its own. NCCL tells hosts apart by a hash of
    the host name and boot id, or of NCCL_HOSTID where it is set, and refuses two ranks of one host
    on one GPU ("Duplicate GPU detected"); a host id per rank makes every rank a host of its own."""
    return {"BRAID_SHARED_GPU": "1", "NCCL_HOSTID": f"braid-shared-gpu-rank-{rank}"}


def share_gpu(rank: int) -> None:
    """Put this process, rank `rank` of its world (the global rank), in shared-GPU mode: sets
    shared_gpu_env(rank). Call it before NCCL starts in this process (before init_process_group);
    under torchrun `import braid` does it when BRAID_SHARED_GPU=1 is set."""
    os.environ.update(shared_gpu_env(rank))


def share_gpu_under_torchrun() -> None:
    """At `import braid`: with BRAID_SHARED_GPU=1, torchrun's RANK set and no NCCL_HOSTID, give this
    rank its own NCCL_HOSTID (share_gpu). A NCCL_HOSTID already set is left as it is."""
    rank = os.environ.get("RANK", "")
    if rank.isdigit() and "NCCL_HOSTID" not in os.environ and get("BRAID_SHARED_GPU"):
        share_gpu(int(rank))


def describe() -> list[tuple[str, str, str]]:
    """(name, default, meaning) for every setting, for docs and `braid env`."""
    return [(s.name, repr(s.default), s.doc) for s in _SETTINGS.values()]


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Set BRAID_* settings for the duration of a block (tests, bench). Values are strings or
    objects whose str() parses; None removes the setting."""
    old = {}
    for key, value in values.items():
        if key not in _SETTINGS:
            raise MisuseError(f"unknown setting {key}; known: {sorted(_SETTINGS)}")
        old[key] = os.environ.get(key)
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
