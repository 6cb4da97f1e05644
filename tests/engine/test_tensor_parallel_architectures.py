"""Every architecture bulkgen runs, on two gloo ranks: the single-process engine's greedy tokens, or a
refusal at load that names what does not split. Never a third outcome: a model whose ranks each ran a
whole row-parallel weight (its partial sums all-reduced, so counted twice) once gave other tokens with
no error, which is what this module guards.

The single-process engine is the reference (test_architectures.py holds it to transformers' `generate`
for each of these models). The two-rank engine runs with chunked prefill (a 64-token step budget), prefix
caching (two prompts share a 96-token prefix) and a KV cache that holds only the longest prompt alone, so
sequences are preempted and recomputed. Llama, Qwen3 and Qwen3-MoE are test_tensor_parallel.py's.
Hybrid recurrent models are test_tensor_parallel_hybrid.py's (test_hybrid_models.py has them on one process).
"""

from __future__ import annotations

import re

import pytest

from bulkgen.engine import Engine, SamplingParams

MAX_TOKENS = 10
ENGINE = dict(device="cpu", max_num_batched_tokens=64, block_size=8, admission="shortest_first")
SPLIT = [
    "mistral",
    "qwen2",
    "mistral-window",
    "ministral",
    "starcoder2",
    "qwen2-window",
    "gemma2",
    "gemma3",
    "cohere2",
    "exaone4",
    "glm4_moe",
    "smollm3",
    "gemma",
    "granite",
    "olmo",
    "cohere",
    "apertus",
    "arcee",
    "ernie4_5",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    "youtu",
    "phi3",
    "olmo2",
    "olmo3",
    "glm",
    "mixtral",
    "qwen2_moe",
    "llama4",
    "phi",
    "gpt_neox",
    "gptj",
    "codegen",
    "minimax_m2",
    "gpt_oss",
]
# name -> what the refusal names
REFUSED = {
    "helium": "o_proj.weight: a row-parallel weight of shape (64, 64) is whole on a rank",
    "gemma3n": "down_proj.weight: a row-parallel weight of shape (64, 128) is whole on a rank",
    "opt": "the tensor-parallel plan splits nothing in layers [0, 1]",
}


def _greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _prompt_logprobs(engine: Engine, prompts: list[list[int]]) -> list[float]:
    """Each prompt token's logprob: a split that runs but computes something else (OPT's heads once) can
    keep ten greedy tokens of a tiny model and still move these by 1e-3; a faithful one by float rounding."""
    outs = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return [entry["logprob"] for o in outs for entry in o.prompt_logprobs if entry]


@pytest.mark.parametrize("name", SPLIT)
def test_two_ranks_give_the_single_engines_tokens(name, tiny_model, tp_prompts, one_thread, rank_pool):
    path = str(tiny_model(name, seed=3))
    single = Engine.from_pretrained(path, num_kv_blocks=1024, **ENGINE)
    expected, logprobs = _greedy(single, tp_prompts), _prompt_logprobs(single, tp_prompts)
    blocks = single.runner.peak_blocks(max(map(len, tp_prompts)) + MAX_TOKENS)
    del single
    sharded = Engine.from_pretrained(
        path, num_kv_blocks=blocks, tensor_parallel=2, launcher=rank_pool, **ENGINE
    )
    try:
        assert _greedy(sharded, tp_prompts) == expected
        gap = max(abs(a - b) for a, b in zip(_prompt_logprobs(sharded, tp_prompts), logprobs, strict=True))
        assert gap < 1e-4, gap
        stats = sharded.stats()
        assert stats["preemptions"] > 0, "the small cache never preempted"
        assert stats["cached_prompt_tokens"] > 0, "the shared prefix was never reused"
    finally:
        sharded.close()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_two_ranks_cannot_split_is_refused_at_load(name, tiny_model, one_thread, rank_pool):
    path = str(tiny_model(name, seed=3))
    with pytest.raises(ValueError, match=re.escape(REFUSED[name])):
        Engine.from_pretrained(path, tensor_parallel=2, launcher=rank_pool, **ENGINE)
