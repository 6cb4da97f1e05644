"""Tensor-parallel steps at full speed on two gloo ranks (two processes, one torch thread each):
overlapped steps and the decode-graph path give the single-process engine's tokens.

With overlapped steps rank 0 launches a step before its host reads the previous step's tokens; the
followers get those tokens by broadcast and must read the same ones. With `cuda_graphs=True` on CPU the
decode steps take the static-buffer path eagerly (CPU has no graphs): rank 0 picks each step's bucket and
its plan carries it, so the followers' replays per bucket must be rank 0's. Each run has chunked prefill
(a 64-token step budget), a shared 96-token prefix and a KV cache that holds the longest prompt alone,
so shorter sequences are preempted and recomputed; the sampled requests stop on byte tokens (seen a step
late when overlapped), one draws from a narrow top-p (often settled late: recomputed), and two sample
only once the previous step's tokens are read (penalties, a grammar).
"""

from __future__ import annotations

import pytest

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.features.guide import Guide
from bulkgen.lab.tiny import build_tiny_model

MAX_TOKENS = 12
ENGINE = dict(device="cpu", max_num_batched_tokens=64, block_size=8, admission="shortest_first")
STOPS = list(range(0, 256, 9))
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SAMPLED = [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1),
    SamplingParams(max_tokens=MAX_TOKENS, top_p=0.15, stop_token_ids=STOPS, temperature=1.0, seed=2),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=40, n=2, seed=3),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=STOPS),
    # rows that sample once the previous step's tokens are read (overlapped: after the forward launched)
    SamplingParams(max_tokens=MAX_TOKENS, frequency_penalty=0.7, temperature=1.0, seed=5),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, guide=Guide.json_object()),
]


def _tokens(engine: Engine, prompts: list[list[int]]) -> tuple[list, list]:
    greedy = engine.generate(prompts, GREEDY)
    sampled = engine.generate(prompts, SAMPLED)
    return [o.outputs[0].token_ids for o in greedy], [[c.token_ids for c in o.outputs] for o in sampled]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tp_prompts, one_thread):
    """(path, KV blocks that hold the longest prompt alone, the single-process engine's tokens step by
    step)."""
    path = str(build_tiny_model(tmp_path_factory.mktemp("llama") / "llama", "llama", seed=5))
    probe = Engine.from_pretrained(path, num_kv_blocks=1024, **ENGINE)
    blocks = probe.runner.peak_blocks(max(map(len, tp_prompts)) + MAX_TOKENS)
    single = Engine.from_pretrained(
        path, num_kv_blocks=blocks, async_scheduling=False, cuda_graphs=False, **ENGINE
    )
    return path, blocks, _tokens(single, tp_prompts)


@pytest.mark.parametrize(
    "overlap, graphs",
    [(True, True), (True, False), (False, True)],
    ids=["overlap+graphs", "overlap", "graphs"],
)
def test_two_ranks_match_the_single_engine(model, tp_prompts, overlap, graphs):
    path, blocks, want = model
    engine = Engine.from_pretrained(
        path, num_kv_blocks=blocks, tensor_parallel=2, async_scheduling=overlap, cuda_graphs=graphs, **ENGINE
    )
    try:
        assert engine.overlap is overlap and (engine.runner.graphs is not None) is graphs
        assert _tokens(engine, tp_prompts) == want
        assert engine.stats()["preemptions"] > 0, "the small cache never preempted"
        assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
        store, steps = engine.runner.tp.store, engine.runner.tp.steps
        # the follower deletes each plan once it has run its step: the store holds the last one at most
        assert not any(store.check([f"plan/{k}"]) for k in range(steps - 1))
    finally:
        engine.close()
    group = engine.runner.tp
    (follower,) = group.reports()
    assert follower["steps"] == group.steps - 1  # every plan but the closing one
    if graphs:  # the follower ran every decode step in the bucket rank 0 chose
        mine = {f"{b},{w}": n for (b, w), n in sorted(engine.runner.graphs.replays.items())}
        assert follower["replays"] == mine and len(mine) > 1
    else:
        assert follower["replays"] == {}
    # overlapped: every step after a sampling one read its stand-ins from rank 0's broadcast
    assert (follower["overlapped"] > group.steps // 2) is overlap
