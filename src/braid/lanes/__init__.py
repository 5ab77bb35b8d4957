"""Lanes: one module per mechanism behind the Lane interface (base.py)."""
from .base import Lane, LaneRun, OpContext

__all__ = ["Lane", "LaneRun", "OpContext"]
