"""Execution on Ray: engine worker actors (one per GPU, CPU actors without one) and per-batch runners."""


class RayUnavailable(RuntimeError):
    """Ray could not be started here, or the cluster named could not be joined; `str()` is one line. Kept
    here, away from `ray`, so the CLI can name it without importing Ray."""
