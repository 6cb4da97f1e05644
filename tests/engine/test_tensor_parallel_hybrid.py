"""Hybrid models with gated delta net layers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) or Mamba-2 layers (Granite
4) on two gloo ranks: the single-process engine's greedy tokens and prompt logprobs, each rank's recurrent
states holding its heads only, as `bulkgen plan` counts them; hybrids whose recurrent layers do not split
(or whose heads or groups do not divide) are refused at load.

As test_hybrid_models.py runs them on one process: chunked prefill (a 64-token step budget) mixing
prefills with decodes, and a KV cache that holds only the longest prompt alone, so sequences are
preempted and recomputed (their state slots refilled from the start). Hybrids have no prefix cache.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoConfig

from bulkgen.engine import Engine
from bulkgen.engine.parallel.rank_memory import rank_memory
from bulkgen.lab.tiny_hybrid import build_tiny_hybrid
from bulkgen.plan.memory import describe_memory, plan_memory
from tests.engine.test_tensor_parallel_architectures import ENGINE, MAX_TOKENS, _greedy, _prompt_logprobs

# test id -> (architecture, config overrides): Granite 4 with two B/C groups (one per rank) and with one
# (whole on both ranks, its norm's statistic summed over them)
SPLIT = {
    "qwen3_next": ("qwen3_next", {}),
    "qwen3_5": ("qwen3_5", {}),
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    "granitemoehybrid": ("granitemoehybrid", {"mamba_n_groups": 2}),
    "granitemoehybrid-one-group": ("granitemoehybrid", {}),
}


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_hybrid")
    return {
        name: str(build_tiny_hybrid(root / name, arch, seed=1, **extra))
        for name, (arch, extra) in SPLIT.items()
    }


def _outputs(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens, and each prompt token's logprob (a split that computes something else can keep a
    tiny model's greedy tokens and still move these)."""
    return _greedy(engine, prompts), _prompt_logprobs(engine, prompts)


@pytest.mark.parametrize("arch", sorted(SPLIT))
def test_two_ranks_give_the_single_engines_tokens(arch, hybrid_dirs, tp_prompts, one_thread):
    path = hybrid_dirs[arch]
    single = Engine.from_pretrained(path, num_kv_blocks=1024, **ENGINE)
    want_tokens, want_logprobs = _outputs(single, tp_prompts)
    blocks = single.runner.peak_blocks(max(map(len, tp_prompts)) + MAX_TOKENS)
    whole_slot = single.runner.states.bytes_per_slot
    del single
    sharded = Engine.from_pretrained(path, num_kv_blocks=blocks, tensor_parallel=2, **ENGINE)
    try:
        tokens, logprobs = _outputs(sharded, tp_prompts)
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4
        assert sharded.stats()["preemptions"] > 0, "the small cache never preempted"
        records = sharded.pop_step_records()
        assert any(r["prefill_tokens"] and r["decode_tokens"] for r in records), "no step mixed the two"
        # each rank's slots hold its heads (a single B/C group whole), as the planner counts them
        slot, config = sharded.runner.states.bytes_per_slot, AutoConfig.from_pretrained(path)
        assert slot * 2 == whole_slot or (arch.endswith("one-group") and slot * 2 > whole_slot)
        planned = [rank_memory(config, n, torch.float32) for n in (1, 2)]
        assert [p["state_bytes_per_sequence"] for p in planned] == [whole_slot, slot]
        assert planned[1]["kv_bytes_per_token"] == sharded.runner.layout.token_bytes(torch.float32)
    finally:
        sharded.close()


# name -> (config overrides, ranks, what the refusal names): Granite 4's two B/C groups over four ranks
# would split a group (whose norm statistic is per group); only one group is kept whole on every rank
REFUSED = {
    "qwen3_5": ({"linear_num_key_heads": 1}, 2, "does not divide the model's linear_num_key_heads (1)"),
    "granitemoehybrid": ({"mamba_n_groups": 2}, 4, "does not divide the model's mamba_n_groups (2)"),
    "falcon_h1": ({}, 2, "this falcon_h1 model has recurrent layers (hybrid, mamba_n_heads"),
    "lfm2": ({}, 2, "this lfm2 model has recurrent layers (conv, conv_L_cache)"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_the_ranks_cannot_split_is_refused_at_load(name, tmp_path):
    overrides, ranks, message = REFUSED[name]
    path = build_tiny_hybrid(tmp_path / name, name, seed=1, **overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        Engine.from_pretrained(str(path), tensor_parallel=ranks, **ENGINE)


def test_overlapped_steps_and_decode_graphs_keep_each_ranks_states(hybrid_dirs, tp_prompts, one_thread):
    """Steps launched before the previous step's tokens are read, and decodes through the graph path
    (eager on CPU), whose slots come from the step plan: the follower's states stay rank 0's."""
    path = hybrid_dirs["qwen3_next"]
    want = _greedy(Engine.from_pretrained(path, **ENGINE), tp_prompts)
    sharded = Engine.from_pretrained(
        path, tensor_parallel=2, async_scheduling=True, cuda_graphs=True, **ENGINE
    )
    try:
        assert _greedy(sharded, tp_prompts) == want
    finally:
        sharded.close()
    # the follower replayed rank 0's buckets, and read stand-in tokens from rank 0's broadcast
    replays = {f"{b},{w}": n for (b, w), n in sharded.runner.graphs.replays.items()}
    report = sharded.runner.tp.reports()[0]
    assert replays and (report["replays"], report["overlapped"] > 0) == (replays, True)


def test_plan_prints_each_ranks_recurrent_state(hybrid_dirs):
    """`bulkgen plan --tensor-parallel 2`: a rank's state per sequence, half the single process's."""
    one, two = (describe_memory(plan_memory(hybrid_dirs["qwen3_5"], n)) for n in (1, 2))
    state = rank_memory(AutoConfig.from_pretrained(hybrid_dirs["qwen3_5"]), 1, torch.bfloat16)
    whole = state["state_bytes_per_sequence"] / 1024
    for text, kib in ((one, whole), (two, whole / 2)):
        assert re.search(rf"^recurrent state +{kib:,.1f} KiB per sequence per rank$", text, re.M), text
