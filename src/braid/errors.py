"""One exception hierarchy for braid.

    BraidError
      MisuseError          the caller asked for something invalid (also a ValueError)
      LaneUnavailableError a lane was required but this machine cannot run it
      LaneFailureError     a lane broke while running (driver error, dead peer)
      PeerMismatchError    ranks called the same op with arguments that do not agree
      BraidTimeoutError    peers did not reach the call in time (also a TimeoutError)

Each error says what was asked, what was found, and what to do.
"""
from __future__ import annotations


class BraidError(RuntimeError):
    """Base of every error braid raises on purpose."""


class MisuseError(BraidError, ValueError):
    """Invalid arguments: wrong device, dtype, size, rank index, non-contiguous output..."""


class LaneUnavailableError(BraidError):
    """A lane was asked for explicitly but is not available here; the message says why."""


class LaneFailureError(BraidError):
    """A lane failed while moving bytes (CUDA driver error, a peer process died)."""


class PeerMismatchError(BraidError):
    """Ranks disagree about a call: op, dtype, sizes, root or split sizes."""


class BraidTimeoutError(BraidError, TimeoutError):
    """Peers did not reach the same call within BRAID_TIMEOUT_S."""
