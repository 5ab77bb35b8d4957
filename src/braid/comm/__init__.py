"""braid's Communicator, one room per concern:

- communicator.py: set-up (segment, lanes, NCCL/gloo groups), the gathering ops, calibration, close
- callpath.py: whole (native library) or split, the shares, the per-shape fast path
- exchange.py: cross-rank agreement on a call, planning, posting on the lanes (the full path)
- reductions.py: all_reduce, reduce_scatter, reduce
- routing.py: all_to_all(v) and the routing decision for skewed traffic
- p2p.py: send/recv and batches
- ledger.py: the call ledger, mismatch and timeout reports, abort, the watchdog
"""
from .policy import DEFAULT_COSTS
from .communicator import OPS, Communicator
from .p2p import PendingP2P
from .uneven import ROUTE_MIN_BYTES, SMALL_RUN

__all__ = ["Communicator", "PendingP2P", "DEFAULT_COSTS", "OPS", "ROUTE_MIN_BYTES", "SMALL_RUN"]
