"""Online FP8 (`quantize="fp8"`) on two gloo ranks: each rank quantizes its own shard after the sharded load.

Column-parallel shards (q/k/v, gate/up) hold whole output rows, so their e4m3 weights and per-channel
scales are bit for bit the single-process FP8 model's rows. Row-parallel shards (o_proj, down_proj) hold
a slice of each row and get their own scales (never larger than the whole row's), and their activations
are quantized per token over the slice: there the two-rank engine is close to, not equal to, the
single-process FP8 engine. Measured (5 prompts, 12 greedy tokens each; the two ranks with overlapped
steps and the decode-graph path), prompt logprobs off single FP8 by at most / single FP8 off float:
Llama 0.014 / 0.020, Qwen3 (one KV head, replicated) 0.027 / 0.044, Qwen3-MoE 0.015 / 0.018. The tiny
models' logits are flat (top logits around 0.4, often 0.005 apart), so greedy tokens part where single
FP8's top two logits are that close, as single FP8 parts from float: Llama 5 of 5 prompts identical,
Qwen3 3, Qwen3-MoE 2, every first divergence at a margin under 0.008.
"""

from __future__ import annotations

import pytest
import torch

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.model.quantize import weight_bytes
from bulkgen.lab.tiny import build_tiny_model

ENGINE = dict(device="cpu", max_num_batched_tokens=64, block_size=8, num_kv_blocks=256)
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=1)
MODELS = {"llama": {}, "qwen3": {"num_key_value_heads": 1}, "qwen3_moe": {}}
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
BOUND = 0.05  # logprob (and logit) differences sharding's own scales may make; measured at most 0.027
NEAR_TIE = 0.02  # single FP8's top-two logit gap where a greedy token may go either way


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens and the logprob of every prompt token after the first."""
    outs = engine.generate(prompts, PARAMS)
    logprobs = [entry["logprob"] for o in outs for entry in o.prompt_logprobs if entry is not None]
    return [o.outputs[0].token_ids for o in outs], torch.tensor(logprobs)


@pytest.fixture(scope="module", params=list(MODELS))
def engines(request, tmp_path_factory, one_thread):
    """(float engine, single-process FP8 engine, two-rank FP8 engine, prompts); closed at the end."""
    name = request.param
    path = str(build_tiny_model(tmp_path_factory.mktemp(name) / name, name, seed=5, **MODELS[name]))
    gen = torch.Generator().manual_seed(39)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 32, 100, 60, 45)]
    float_engine = Engine.from_pretrained(path, **ENGINE)
    fp8 = Engine.from_pretrained(path, quantize="fp8", **ENGINE)
    sharded = Engine.from_pretrained(
        path, quantize="fp8", tensor_parallel=2, async_scheduling=True, cuda_graphs=True, **ENGINE
    )
    yield float_engine, fp8, sharded, prompts
    sharded.close()


def _module(layer: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:  # an MoE layer has experts where a dense one has gate/up/down
        return None


def test_column_parallel_shards_equal_and_row_parallel_have_their_own_scales(engines):
    _, fp8, sharded, _ = engines
    for mine, whole in zip(sharded.model.model.layers, fp8.model.model.layers, strict=True):
        for name in COLUMN:
            shard, full = _module(mine, name), _module(whole, name)
            if shard is None:
                continue
            rows = shard.weight.shape[0]  # rank 0's: the first rows (with one KV head, all of them)
            assert torch.equal(shard.weight.view(torch.uint8), full.weight[:rows].view(torch.uint8)), name
            assert torch.equal(shard.weight_scale, full.weight_scale[:rows]), name
        for name in ROW:
            shard, full = _module(mine, name), _module(whole, name)
            if shard is None:
                continue
            assert shard.weight.shape[1] * 2 == full.weight.shape[1], name
            assert (shard.weight_scale <= full.weight_scale).all(), name  # a slice's max, not the row's
            assert (shard.weight_scale < full.weight_scale).any(), name


def test_two_rank_fp8_is_close_to_single_process_fp8(engines):
    float_engine, fp8, sharded, prompts = engines
    tokens, logprobs = _run(sharded, prompts)
    fp8_tokens, fp8_logprobs = _run(fp8, prompts)
    _, float_logprobs = _run(float_engine, prompts)
    sharding = (logprobs - fp8_logprobs).abs()
    quantizing = (fp8_logprobs - float_logprobs).abs()
    assert sharding.max() < BOUND, sharding.max()
    assert sharding.mean() <= 1.5 * quantizing.mean(), (sharding.mean(), quantizing.mean())
    for prompt, want, got in zip(prompts, fp8_tokens, tokens, strict=True):
        at = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
        if at is None:
            continue
        with torch.no_grad():  # single FP8's logits where the two runs part, on the same tokens before it
            logits = fp8.model(torch.tensor([prompt + want[:at]])).logits[0, -1]
        assert logits[want[at]] - logits[got[at]] < NEAR_TIE, (prompt[:4], at)  # a wrong shard parts wide


def test_each_rank_holds_half_the_sharded_fp8_weights(engines):
    """Each rank's bytes: its replicated parameters (norms; KV heads fewer than ranks) whole, the rest
    half of the single FP8 model's (plus a padded vocabulary row)."""
    _, fp8, sharded, _ = engines
    whole = dict(fp8.model.named_parameters())
    replicated = sum(
        p.numel() * p.element_size()
        for name, p in sharded.model.named_parameters()
        if name in whole and p.shape == whole[name].shape
    )
    ranks = [m["weight_bytes"] for m in sharded.runner.tp.rank_memory()]
    assert ranks[0] == weight_bytes(sharded.model)
    split = weight_bytes(fp8.model) - replicated
    for held in ranks:
        assert split / 2 <= held - replicated <= split / 2 * 1.01, (held, replicated, split)
