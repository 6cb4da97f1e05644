"""A follower rank a test holds while its group loads: the real RankActor, whose next model waits at a gate
before it joins the group's rendezvous ("join") or before it loads its shard ("load"), so a test can kill
it while rank 0 waits for it, however fast the tiny model would load.

Groups build their followers from this class when BULKGEN_TEST_RANK_ACTOR names it
(runtime/groups.rank_actor_class); tests/conftest.py sets that for the whole session, and the gate lives in
the held engine's folder (BULKGEN_TEST_GATE). While the gate is closed (the file `rank-closed`, holding
"join" or "load", is in that folder) a follower starting a model marks `rank-held` and waits at that point;
with the gate open it is the plain RankActor.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bulkgen.runtime.groups import RankActor
from tests.support.wait import wait_until

GATE_ENV = "BULKGEN_TEST_GATE"


class HeldRankActor(RankActor):
    def serve(self, spec: dict) -> None:
        gate = RankGate(os.environ[GATE_ENV])
        if gate.closed() == "load":
            from bulkgen.engine.parallel import tensor_parallel

            load = tensor_parallel.load_shard

            def held_load(*args, **kwargs):
                gate.hold()
                return load(*args, **kwargs)

            tensor_parallel.load_shard = held_load  # serve_rank calls it by the module's name
            try:
                return super().serve(spec)
            finally:
                tensor_parallel.load_shard = load
        if gate.closed() == "join":
            gate.hold()
        return super().serve(spec)


class RankGate:
    """The test's side of the gate: close at a point ("join" or "load"), wait until a follower holds there,
    open."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def closed(self) -> str | None:
        try:
            return (self.folder / "rank-closed").read_text().strip() or None
        except FileNotFoundError:
            return None

    def close(self, at: str) -> None:
        (self.folder / "rank-held").unlink(missing_ok=True)
        (self.folder / "rank-closed").write_text(at)

    def open(self) -> None:
        (self.folder / "rank-closed").unlink(missing_ok=True)

    def hold(self) -> None:
        (self.folder / "rank-held").write_text(str(os.getpid()))
        while self.closed():
            time.sleep(0.05)

    def wait_held(self, timeout: float = 120) -> int:
        """Until a follower holds at the gate; its pid."""
        held = self.folder / "rank-held"
        wait_until(held.exists, timeout, "a follower rank to hold at the gate")
        return int(wait_until(lambda: held.read_text().strip(), 10, "the held follower's pid"))
