"""The planner: pure math over plans. No torch import (a test enforces it)."""
from .model import LaneCost, choose_shares, choose_with_native, equal_finish, fit, predicted_time_us
from .plan import (CPU_LANES, GPU_LANES, LINK_GROUP, LaneKind, LocalCopy, Movement, Plan, Transfer,
                   all_gather_movement, all_to_all_movement, broadcast_movement, p2p_movement, split)

__all__ = [
    "LaneCost", "choose_shares", "choose_with_native", "equal_finish", "fit", "predicted_time_us",
    "CPU_LANES", "GPU_LANES", "LINK_GROUP", "LaneKind", "LocalCopy", "Movement", "Plan", "Transfer",
    "all_gather_movement", "all_to_all_movement", "broadcast_movement", "p2p_movement", "split",
]
