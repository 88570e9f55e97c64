"""Expert-parallel load balancer: pure policy over per-step expert token counts.

    counts [layers, experts] per step -> ExpertLoadWindow -> (every period) plan -> phy2log

``plan`` places replicas; ``placement`` holds the maps (phy2log, log2phy, logcnt) and the load
model; ``ExpertRebalancer`` runs the window and the re-placement schedule.
"""

from deepinfer.engine.parallel.eplb.load_window import ExpertLoadWindow
from deepinfer.engine.parallel.eplb.packing import pack
from deepinfer.engine.parallel.eplb.placement import (
    check_placement,
    gpu_loads,
    gpu_share,
    imbalance,
    log2phy,
    logcnt,
    static_placement,
)
from deepinfer.engine.parallel.eplb.planner import plan
from deepinfer.engine.parallel.eplb.replicate import count_moves, replica_counts, spread_counts
from deepinfer.engine.parallel.eplb.schedule import (
    DECODE,
    PREFILL,
    EplbConfig,
    ExpertRebalancer,
    ReplacementSchedule,
)

__all__ = [
    "DECODE", "PREFILL", "EplbConfig", "ExpertLoadWindow", "ExpertRebalancer", "ReplacementSchedule",
    "check_placement", "gpu_loads", "gpu_share", "imbalance", "log2phy", "logcnt", "pack", "plan",
    "count_moves", "replica_counts", "spread_counts", "static_placement",
]
