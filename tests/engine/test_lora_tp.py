"""LoRA adapters under tensor parallel, two gloo ranks on this machine (two processes, one torch thread
each, fp32): a batch mixing base rows and three adapters of different ranks (test_lora.ADAPTERS: q/v,
o + MLP with rsLoRA, and every projection) gives the tokens of the single-process engine with the same
adapters and of peft's `merge_and_unload()` model run alone through transformers' `generate`.

The step budget (32 tokens) prefills the long prompts in chunks beside other adapters' decodes, and two
slots for three adapters make rank 0 evict and reload, which the follower copies from the step plan;
steps overlap (rank 0 fills slots for a step while the previous one is in flight).
Llama splits its two KV heads one per rank; Qwen3 has one KV head, replicated, so its k/v adapters' B
rows are replicated too. An adapter removed and added again between steps reaches the follower as well.
"""

from __future__ import annotations

import pytest
import torch

from bulkgen.engine import Engine, SamplingParams
from bulkgen.lab.tiny import build_tiny_model
from tests.engine.test_lora import ADAPTERS, LENGTHS, MAX_TOKENS, PLAN, _reference, _run, _save_adapter

MODELS = {"llama": {}, "qwen3": {"num_key_value_heads": 1}}
ENGINE = dict(device="cpu", max_loras=2, max_num_batched_tokens=32, async_scheduling=True)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory, one_thread, rank_pool):
    """(model folder, {adapter: folder}, single-process engine, two-rank engine), both with the adapters."""
    root = tmp_path_factory.mktemp(f"lora-tp-{request.param}")
    path = build_tiny_model(root / "model", request.param, seed=3, **MODELS[request.param])
    adapters = {
        name: _save_adapter(path, root / name, i + 10, rank, alpha, rslora, targets)
        for i, (name, (rank, alpha, rslora, targets)) in enumerate(ADAPTERS.items())
    }
    engines = [
        Engine.from_pretrained(str(path), tensor_parallel=tp, launcher=rank_pool, **ENGINE) for tp in (1, 2)
    ]
    for engine in engines:
        for name, folder in adapters.items():
            engine.add_lora(name, folder)
    yield path, adapters, *engines
    engines[1].close()


def test_mixed_adapters_on_two_ranks_equal_single_engine_and_merged(pair, prompts):
    path, adapters, single, sharded = pair
    want = {
        str(i): _reference(path, None if lora is None else adapters[lora], p)
        for i, (p, lora) in enumerate(zip(prompts, PLAN, strict=True))
    }
    got = _run(sharded, prompts, PLAN, GREEDY)
    assert got == _run(single, prompts, PLAN, GREEDY)
    assert got == want
    assert sharded.runner.loras.loads > 2  # rank 0 evicted and reloaded; the follower's rows need its copy


def test_adapter_removed_and_added_again_reaches_the_follower(pair, prompts):
    path, adapters, single, sharded = pair
    for engine in (single, sharded):
        engine.remove_lora("a")
        engine.add_lora("a", adapters["c"])  # the name now serves c's weights
    plan = ["a", None, "b", "a"]
    got = _run(sharded, prompts[:4], plan, GREEDY)
    assert got == _run(single, prompts[:4], plan, GREEDY)
    assert got["0"] == _reference(path, adapters["c"], prompts[0])
    for engine in (single, sharded):  # the fixture's engines serve the next test as they came
        engine.remove_lora("a")
        engine.add_lora("a", adapters["a"])
