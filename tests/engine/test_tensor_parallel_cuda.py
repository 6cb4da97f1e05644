"""Decode CUDA graphs and overlapped steps on CUDA, at tp=1 and tp=2 (the device run; skipped without CUDA).

tp=1 checks the single-GPU graph path is unchanged by the tensor-parallel work: captured graphs replayed
under overlapped steps give the tokens of the eager, step-by-step engine (fp32: token for token). tp=2
needs two GPUs and is skipped with fewer (the reference device has one, so it has not run there): every
rank captures its buckets with the NCCL collectives inside, the follower replays the buckets rank 0
chose, and the tokens equal the single-GPU engine's.
"""

from __future__ import annotations

import pytest
import torch

from bulkgen.engine import Engine, SamplingParams

NUM_KV_BLOCKS = 512
ENGINE = dict(
    device="cuda", dtype=torch.float32, max_num_batched_tokens=64, block_size=8, num_kv_blocks=NUM_KV_BLOCKS
)
PARAMS = [
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=4, ignore_eos=True),
]

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _tokens(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(prompts, [PARAMS[i % 2] for i in range(len(prompts))])
    return [o.outputs[0].token_ids for o in outs]


def _captured(engine: Engine) -> int:
    return sum(b.graph is not None for b in engine.runner.graphs.buckets.values())


@pytest.fixture(scope="module")
def reference(model_dirs, mixed_prompts):
    """The eager, step-by-step single-GPU engine's tokens."""
    prompts = mixed_prompts(seed=41, count=7, low=1, high=90)
    engine = Engine.from_pretrained(
        str(model_dirs["llama"]), cuda_graphs=False, async_scheduling=False, **ENGINE
    )
    return prompts, _tokens(engine, prompts)


def test_single_gpu_graphs_and_overlap_unchanged(model_dirs, reference):
    prompts, want = reference
    engine = Engine.from_pretrained(str(model_dirs["llama"]), **ENGINE)  # CUDA: graphs and overlap on
    assert engine.overlap and _captured(engine) > 1
    assert _tokens(engine, prompts) == want
    assert sum(engine.runner.graphs.replays.values()) > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tp=2 needs two GPUs")
def test_two_gpu_ranks_replay_rank_zeros_graphs(model_dirs, reference):
    prompts, want = reference
    engine = Engine.from_pretrained(str(model_dirs["llama"]), tensor_parallel=2, **ENGINE)
    try:
        assert engine.overlap and _captured(engine) > 1
        assert _tokens(engine, prompts) == want
    finally:
        engine.close()
    (follower,) = engine.runner.ranks.reports()
    mine = {f"{b},{w}": n for (b, w), n in sorted(engine.runner.graphs.replays.items())}
    assert follower["replays"] == mine and mine
    assert follower["overlapped"] > 0
