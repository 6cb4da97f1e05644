"""Execution on Ray: engine worker actors (one per GPU, CPU actors without one) and per-batch runners."""


class RayUnavailable(RuntimeError):
    """Ray could not be started here, or the cluster named could not be joined; `str()` is one line. Kept
    here, away from `ray`, so the CLI can name it without importing Ray."""


def node_ip() -> str | None:
    """This process's node address, for operators (dashboard, log lines); None outside Ray."""
    try:
        import ray  # not at the top: the CLI imports this package without Ray

        if not ray.is_initialized():
            return None
        # the address the node registered with (what `ray status` shows), not this host's default route's
        return (
            getattr(ray._private.worker.global_worker, "node_ip_address", None)
            or ray.util.get_node_ip_address()
        )
    except Exception:
        return None


class WorkersDoNotFit(RuntimeError):
    """The cluster's GPUs cannot hold one worker of each rank count the served models need
    (`--tensor-parallel`); `str()` is one line naming the GPUs there and those needed."""
