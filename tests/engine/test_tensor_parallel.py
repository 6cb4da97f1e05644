"""Tensor parallel over two gloo ranks on this machine (two processes, one torch thread each): tokens
equal to the single-process engine and to transformers' `generate`.

Each model runs once on two ranks with chunked prefill (a 64-token step budget below the longer
prompts), prefix caching (two prompts share a 96-token prefix) and a KV cache that holds only the
longest prompt alone, so shorter sequences are preempted and recomputed. Llama splits its two KV heads
one per rank; Qwen3 has one KV head, replicated on both ranks; Qwen3-MoE splits every expert's width.
The vocabulary (261 tokens) does not divide by two, so the last shard of the embedding and the head is
padded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.parallel.tensor_parallel import ProcessLauncher, RankLost, launch
from bulkgen.lab.tiny import build_tiny_model

MAX_TOKENS = 12
ENGINE = dict(device="cpu", max_num_batched_tokens=64, block_size=8, admission="shortest_first")
MODELS = {"llama": {}, "qwen3": {"num_key_value_heads": 1}, "qwen3_moe": {}}


@pytest.fixture(scope="module")
def prompts(tp_prompts):
    return tp_prompts


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory, prompts, one_thread):
    """(name, path, single-process engine, two-rank engine) with the same limits; the cache holds the
    longest prompt alone."""
    name = request.param
    path = str(build_tiny_model(tmp_path_factory.mktemp(name) / name, name, seed=5, **MODELS[name]))
    probe = Engine.from_pretrained(path, num_kv_blocks=1024, **ENGINE)
    blocks = probe.runner.peak_blocks(max(map(len, prompts)) + MAX_TOKENS)
    single = Engine.from_pretrained(path, num_kv_blocks=blocks, **ENGINE)
    sharded = Engine.from_pretrained(path, num_kv_blocks=blocks, tensor_parallel=2, **ENGINE)
    yield name, path, single, sharded
    sharded.close()


def _greedy(engine: Engine, prompts: list[list[int]]) -> list:
    return engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))


def _transformers(path: str, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def test_two_ranks_hold_half_the_heads(pair):
    name, _, single, sharded = pair
    one, two = single.runner.layout, sharded.runner.layout
    assert two.kv_heads == (one.kv_heads if one.kv_heads == 1 else one.kv_heads // 2)
    assert sharded.runner.k_caches[0].shape[-2] == two.kv_heads
    q_proj = sharded.model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.shape[0] * 2 == single.model.model.layers[0].self_attn.q_proj.weight.shape[0]


def test_greedy_tokens_equal_single_engine_and_transformers(pair, prompts):
    name, path, single, sharded = pair
    outs = _greedy(sharded, prompts)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens == [o.outputs[0].token_ids for o in _greedy(single, prompts)]
    assert tokens == _transformers(path, prompts), name
    assert sharded.stats()["preemptions"] > 0, "the small cache never preempted"
    assert max(o.metrics.num_cached_tokens for o in outs) >= 16, "no shared prefix block was reused"
    assert sharded.block_manager.num_free_blocks == sharded.runner.num_blocks


def test_seeded_sampling_equals_single_engine(pair, prompts):
    _, _, single, sharded = pair
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=i) for i in range(4)]

    def draw(engine: Engine) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in engine.generate(prompts[:4], params)]

    assert draw(sharded) == draw(single)


@pytest.mark.parametrize("signal_to_send", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "hung"])
def test_a_lost_rank_fails_the_step_within_the_timeout(tmp_path, prompts, one_thread, signal_to_send):
    path = str(build_tiny_model(tmp_path / "llama", "llama", seed=5))
    engine = Engine.from_pretrained(path, tensor_parallel=2, collective_timeout_s=10, **ENGINE)
    follower = engine.runner.tp.processes[0]
    try:
        _greedy(engine, prompts[:1])
        os.kill(follower.pid, signal_to_send)
        start = time.monotonic()
        with pytest.raises(RankLost):
            _greedy(engine, prompts[:2])
        assert time.monotonic() - start < 20
    finally:
        follower.kill()
        follower.wait()


class _DiesBeforeJoining(ProcessLauncher):
    """Followers that never reach the rendezvous: killed while rank 0 waits for them (a rank whose start
    crashed, or that was killed while it loaded its imports)."""

    def start(self, specs: list[dict]) -> list[subprocess.Popen]:
        followers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in specs]
        threading.Timer(1.0, lambda: [f.kill() for f in followers]).start()
        return followers


def test_a_follower_that_dies_before_joining_fails_the_load_within_seconds(tmp_path, one_thread):
    """Rank 0 waited in the process group's rendezvous for START_TIMEOUT_S (600 s) for a rank that was
    already dead; it now looks at the followers it started between short polls and names the one that
    ended."""
    path = build_tiny_model(tmp_path / "llama", "llama", seed=5)
    start = time.monotonic()
    with pytest.raises(RankLost, match=r"tensor-parallel rank 1 exited with code -9"):
        launch(path, 2, "cpu", torch.float32, timeout_s=30, launcher=_DiesBeforeJoining())
    assert time.monotonic() - start < 15
