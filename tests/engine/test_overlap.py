"""Overlapped steps (EngineConfig.async_scheduling): each step is launched before the host reads the
previous step's tokens, the next forward reads them on the device, and stops are seen one step late.
The outputs must be those of a step-by-step run, field by field, across every request option, chunked
prefill, preemptions, late-settled top-p rows, aborts and resets; and the host must read a step's
tokens only after the next step was launched."""

from __future__ import annotations

import pytest

from bulkgen.engine import SamplingParams
from bulkgen.engine import engine as engine_module
from bulkgen.engine.features.guide import Guide
from bulkgen.engine.features.pooling import EmbedParams
from bulkgen.engine.model_runner import ModelRunner
from bulkgen.engine.sampling import sampler

ARCH = "llama"
STOPS = list(range(0, 256, 9))  # about one byte token in nine ends a completion early


def _params() -> list[SamplingParams | EmbedParams]:
    sampled = dict(temperature=1.0, seed=7)
    return [
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=STOPS),
        SamplingParams(max_tokens=20, top_p=0.9, top_k=40, n=2, **sampled),
        SamplingParams(max_tokens=20, top_p=0.15, stop_token_ids=STOPS, **sampled),  # often settled late
        SamplingParams(max_tokens=25, stop=["a", "q", "7"], **sampled),
        SamplingParams(max_tokens=12, logprobs=3, top_p=0.5, **sampled),
        SamplingParams(max_tokens=8, best_of=3, n=2, **sampled),
        SamplingParams(max_tokens=1, temperature=0),  # its first token is its last
        SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=2),
        EmbedParams(),
        SamplingParams(max_tokens=10, frequency_penalty=0.7, **sampled),  # samples after the previous read
        SamplingParams(max_tokens=16, temperature=0, guide=Guide.json_object()),
    ]


def _fields(out) -> tuple:
    completions = [
        (c.index, c.token_ids, c.text, c.finish_reason, c.cumulative_logprob, c.logprobs) for c in out.outputs
    ]
    return out.request_id, completions, out.prompt_logprobs, out.embedding


def _run(make_engine, prompts, params, **kwargs):
    engine = make_engine(ARCH, **kwargs)
    outs = engine.generate(prompts, params)
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks and not engine.requests
    return [_fields(o) for o in outs], engine.stats()


def _close(got, want, where: str) -> None:
    """Equal, floats within 1e-4 (batches of a different composition may round differently)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        _close(g, w, f"request {w[0]}")


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(cuda_graphs=True),  # decodes on the static-buffer path (eager on CPU)
        dict(cuda_graphs=False),  # every step on the packed path
        dict(cuda_graphs=True, num_kv_blocks=40, max_num_seqs=6),  # preemptions, admissions mid-decode
    ],
)
def test_overlapped_steps_give_the_step_by_step_outputs(
    make_engine, mixed_prompts, monkeypatch, engine_kwargs
):
    late = []
    result = sampler.SampledTokens.result

    def counting(self):
        out = result(self)
        late.append(len(out[2]))
        return out

    monkeypatch.setattr(sampler.SampledTokens, "result", counting)
    kinds = _params()
    prompts = mixed_prompts(seed=91, count=3 * len(kinds), low=3, high=40)
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    common = dict(block_size=4, max_num_batched_tokens=32, **engine_kwargs)
    want, sync_stats = _run(make_engine, prompts, params, async_scheduling=False, **common)
    late.clear()
    got, stats = _run(make_engine, prompts, params, async_scheduling=True, **common)
    _assert_same(got, want)
    assert sum(late) > 0  # the late-settle path ran (and was recomputed)
    assert stats["discarded_tokens"] > 0 and sync_stats["discarded_tokens"] == 0  # stops seen a step late
    assert stats["output_tokens"] == sync_stats["output_tokens"]
    if "num_kv_blocks" in engine_kwargs:
        assert stats["preemptions"] > 0


def test_every_late_settled_row_is_recomputed(make_engine, mixed_prompts, monkeypatch):
    """With no row redrawn on the device, every top-p row whose first draw misses is settled only after
    the copy: the step that read its wrong device token is discarded for it, and the tokens still match."""
    monkeypatch.setattr(sampler, "_redrawn_rows", lambda seqs: 0)
    prompts = mixed_prompts(seed=92, count=8, low=3, high=20)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.6, seed=3, logprobs=2, n=2)
    common = dict(block_size=4, cuda_graphs=True)
    want, _ = _run(make_engine, prompts, params, async_scheduling=False, **common)
    got, stats = _run(make_engine, prompts, params, async_scheduling=True, **common)
    _assert_same(got, want)
    assert stats["discarded_tokens"] > len(prompts)


def test_grammar_and_penalty_rows_sample_after_the_previous_read(make_engine, mixed_prompts, monkeypatch):
    """Every request under a JSON grammar or penalties: their steps still overlap the forward with the
    previous step's read, and sample once the matchers and penalty rows have seen its tokens."""
    late = []
    sample_late = engine_module.Engine._sample_late
    monkeypatch.setattr(
        engine_module.Engine, "_sample_late", lambda self, *a: late.append(1) or sample_late(self, *a)
    )
    prompts = mixed_prompts(seed=95, count=10, low=3, high=30)
    sampled = dict(temperature=0.9, seed=4, max_tokens=24)
    params = [
        SamplingParams(guide=Guide.json_object(), **sampled)
        if i % 3 == 0
        else SamplingParams(presence_penalty=0.8, logit_bias={65: 3.0, 66: -2.0}, **sampled)
        if i % 3 == 1
        else SamplingParams(frequency_penalty=1.1, top_p=0.8, **sampled)
        for i in range(len(prompts))
    ]
    common = dict(block_size=4, cuda_graphs=True)
    want, _ = _run(make_engine, prompts, params, async_scheduling=False, **common)
    got, stats = _run(make_engine, prompts, params, async_scheduling=True, **common)
    _assert_same(got, want)
    assert len(late) >= 20 and stats["steps"] - len(late) <= 2  # all but the first step (and the last)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_host_reads_a_step_only_after_launching_the_next(
    make_engine, mixed_prompts, monkeypatch, overlap
):
    """Event order: with overlap, a decode step's tokens are read after the next forward was launched
    (the GPU then never waits for the host between them); step by step, before it."""
    launches, reads = [], []
    run, result, sample_async = ModelRunner.run, sampler.SampledTokens.result, engine_module.sample_async

    def launching(self, *args, **kwargs):
        launches.append(1)
        return run(self, *args, **kwargs)

    def made(*args, **kwargs):
        out = sample_async(*args, **kwargs)
        out.launch = len(launches)
        return out

    def reading(self):
        if not hasattr(self, "read_at"):
            self.read_at = len(launches)
            reads.append(self)
        return result(self)

    monkeypatch.setattr(ModelRunner, "run", launching)
    monkeypatch.setattr(engine_module, "sample_async", made)
    monkeypatch.setattr(sampler.SampledTokens, "result", reading)
    engine = make_engine(ARCH, cuda_graphs=True, async_scheduling=overlap)
    prompts = mixed_prompts(seed=93, count=6, low=4, high=12)
    engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    after_next = sum(r.read_at > r.launch for r in reads)
    if overlap:
        assert after_next >= len(reads) - 2  # all but the last step's (and a drain)
    else:
        assert after_next == 0
    # a last token known in advance (max_tokens) leaves the batch when launched: no step computed in vain
    assert engine.stats()["discarded_tokens"] == 0


def test_abort_and_reset_with_a_step_in_flight(make_engine, mixed_prompts):
    prompts = mixed_prompts(seed=94, count=6, low=4, high=16)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    two = SamplingParams(max_tokens=12, temperature=0.8, seed=1, n=2, ignore_eos=True)
    engine = make_engine(ARCH, cuda_graphs=True, async_scheduling=True, block_size=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, two if i % 2 else greedy)
    done = {}
    while engine._inflight is None or not any(
        len(s) > s.num_prompt_tokens + 2 for s in engine.requests["1"].seqs
    ):
        done.update((o.request_id, o) for o in engine.step())
    assert all(s.token_ids[-1] < 0 for r in ("1", "2") for s in engine.requests[r].seqs)  # in flight
    engine.abort(["1", "2"])
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    assert sorted(done) == ["0", "3", "4", "5"]
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    alone = make_engine(ARCH, async_scheduling=False, block_size=4)
    keep = [0, 3, 4, 5]
    want = alone.generate([prompts[i] for i in keep], [two if i % 2 else greedy for i in keep])
    assert [[c.token_ids for c in done[str(i)].outputs] for i in keep] == [
        [c.token_ids for c in w.outputs] for w in want
    ]

    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy)
    while engine._inflight is None:
        engine.step()
    engine.reset()  # drops the step in flight with everything else
    assert engine._inflight is None and not engine.requests
    again = engine.generate(prompts[:2], greedy)
    assert [o.token_ids for o in again] == [w.token_ids for w in alone.generate(prompts[:2], greedy)]


def test_switching_overlap_off_with_a_step_in_flight(make_engine, mixed_prompts):
    """The in-flight step is read before the next schedule: what it finishes (a stop seen a step late) is
    never scheduled again, and every request comes back once with the step-by-step tokens."""
    prompts = mixed_prompts(seed=95, count=12, low=4, high=16)
    params = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=list(range(0, 512, 5)))
    want = make_engine(ARCH, async_scheduling=False, block_size=4).generate(prompts, params)
    stops_at = sorted(len(w.token_ids) for w in want if w.outputs[0].finish_reason == "stop")
    assert len(stops_at) >= 3 and stops_at[-1] >= 2, stops_at  # stops, some after decoding
    engine = make_engine(ARCH, cuda_graphs=True, async_scheduling=True, block_size=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict = {}
    # switch while the step in flight holds the stop token of a request (its host read finishes it)
    while not any(
        s.token_ids[-1] < 0 and len(s) - s.num_prompt_tokens == len(want[int(r)].token_ids)
        for r, req in engine.requests.items()
        for s in req.seqs
    ):
        done.update((o.request_id, o) for o in engine.step())
    engine.overlap = False
    first = engine.step()
    assert first, "the in-flight step's read finished a request"
    for out in first:
        done[out.request_id] = out
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in done
            done[out.request_id] = out
    assert engine._inflight is None and engine.block_manager.num_free_blocks == engine.runner.num_blocks
    assert [done[str(i)].token_ids for i in range(len(prompts))] == [w.token_ids for w in want]


def test_a_config_value_other_than_a_bool_or_none_is_refused(make_engine):
    with pytest.raises(ValueError, match="async_scheduling"):
        make_engine(ARCH, async_scheduling="yes")
