"""The hook tests hold batches with: a worker's engine class comes from BULKGEN_TEST_ENGINE (set for the test
session), and its requests marked HOLD wait at the closed gate while the others run."""

from __future__ import annotations

from bulkgen.engine import SamplingParams, engine_class
from tests.support.held_engine import HOLD, HeldEngine
from tests.support.service import random_model
from tests.support.wait import wait_until


def _run_until_only_held(engine) -> list:
    finished = []
    wait_until(
        lambda: finished.extend(engine.step()) or not (engine.requests.keys() - {"held"}),
        60,
        "the unheld request to finish",
    )
    return finished


def test_held_requests_wait_at_the_closed_gate_and_run_once_it_opens(engine_gate):
    assert engine_class() is HeldEngine  # what every worker of the test session builds
    engine = engine_class().from_pretrained(str(random_model()), max_num_seqs=4)
    engine.add_request("held", f"{HOLD} wait", SamplingParams(max_tokens=32, temperature=0))
    engine.add_request("free", "go", SamplingParams(max_tokens=4, temperature=0))
    assert [out.request_id for out in _run_until_only_held(engine)] == ["free"]
    made = engine.requests["held"].seqs[0].num_output_tokens  # it ran beside the unheld one
    for _ in range(20):  # only held requests left: no step runs
        assert engine.step() == []
    engine_gate.wait_held()
    assert engine.requests["held"].seqs[0].num_output_tokens == made < 32
    engine_gate.open()
    done = []
    wait_until(
        lambda: done.extend(engine.step()) or done, 60, "the held request to finish once the gate opens"
    )
    assert done[0].request_id == "held" and len(done[0].outputs[0].token_ids) == 32
