"""braid's Communicator: a façade over parts that own their state, one file per concern:

- communicator.py: set-up (segment, lanes, NCCL/gloo groups), the ops' entries with their fast
  paths, the shares, the backend's forwarding questions, calibration, close
- callpath.py: the fast path of a repeated call (whole through the native library, or a prepared
  call replayed)
- exchange.py: cross-rank agreement on a call, planning, posting on the lanes (the full path)
- reductions.py: all_reduce, reduce_scatter, reduce past their fast paths
- routing.py: all_to_all(v) and the routing decision for skewed traffic
- p2p.py: send/recv and batches
- ledger.py: the call ledger; closed, aborted, mismatch and timeout reports, abort, the watchdog
"""
from .policy import DEFAULT_COSTS
from .communicator import OPS, Communicator
from .pairs import PendingP2P
from .uneven import ROUTE_MIN_BYTES, SMALL_RUN

__all__ = ["Communicator", "PendingP2P", "DEFAULT_COSTS", "OPS", "ROUTE_MIN_BYTES", "SMALL_RUN"]
