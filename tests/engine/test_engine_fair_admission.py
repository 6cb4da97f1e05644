"""Admission is fair between tags (batches), then longest first within a tag."""

from __future__ import annotations

from bulkgen.engine import SamplingParams


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _first_steps(engine, step: int = 0) -> dict[str, int]:
    """request id -> the step that gave it its first token, running the engine to the end (`step`: the
    steps run before)."""
    first: dict[str, int] = {}
    while engine.has_unfinished():
        done = engine.step()
        step += 1
        started = [o.request_id for o in done]
        started += [rid for rid, r in engine.requests.items() if any(s.num_output_tokens for s in r.seqs)]
        for rid in started:
            first.setdefault(rid, step)
    return first


def test_a_short_request_of_another_tag_goes_before_a_queue_of_long_ones(make_engine, mixed_prompts):
    engine = make_engine("llama", max_num_seqs=2)
    prompts = mixed_prompts(seed=40, count=12, low=20, high=30)
    for i, prompt in enumerate(prompts[:10]):
        engine.add_request(f"big-{i}", prompt, _params(4), tag="big")
    for _ in range(2):  # the big batch is running, eight of its requests waiting
        engine.step()
    engine.add_request("small-0", prompts[10][:3], _params(2), tag="small")
    engine.add_request("small-1", prompts[11][:3], _params(2), tag="small")
    running = {s.request.request_id for s in engine.scheduler.running}
    first = _first_steps(engine, step=2)
    waited = sorted(s for rid, s in first.items() if rid.startswith("big") and rid not in running)
    assert len(waited) == 8
    # the first slot that frees goes to the newcomer, and its share of the next ones (by tokens of work):
    # longest first alone would put both after all eight
    assert first["small-0"] <= waited[0] and first["small-1"] <= waited[1]


def test_within_one_tag_longest_first_still_holds(make_engine, mixed_prompts):
    engine = make_engine("llama", max_num_seqs=1)
    prompts = mixed_prompts(seed=41, count=3, low=4, high=6)
    for i, (prompt, n) in enumerate(zip(prompts, [2, 9, 5], strict=True)):
        engine.add_request(f"r{i}", prompt, _params(n), tag="only")
    first = _first_steps(engine)
    assert sorted(first, key=first.get) == ["r1", "r2", "r0"]
