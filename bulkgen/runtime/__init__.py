"""Execution on Ray: engine worker actors (one per GPU, CPU actors without one) and per-batch runners."""


class RayUnavailable(RuntimeError):
    """Ray could not be started here, or the cluster named could not be joined; `str()` is one line. Kept
    here, away from `ray`, so the CLI can name it without importing Ray."""


class WorkersDoNotFit(RuntimeError):
    """The cluster's GPUs cannot hold one worker of each rank count the served models need
    (`--tensor-parallel`); `str()` is one line naming the GPUs there and those needed."""
