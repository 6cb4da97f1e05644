"""Explanatory models: a discrete-step batching simulator and the latency budget of one request."""

from bulkgen.lab.sim.batching import (
    DEFAULT_MAX_WAIT,
    POLICIES,
    Segment,
    SimResult,
    SimulationInputError,
    Workload,
    simulate,
)
from bulkgen.lab.sim.latency import LatencyBudget

__all__ = [
    "DEFAULT_MAX_WAIT",
    "POLICIES",
    "LatencyBudget",
    "Segment",
    "SimResult",
    "SimulationInputError",
    "Workload",
    "simulate",
]
