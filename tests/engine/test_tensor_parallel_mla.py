"""Multi-head latent attention on two gloo ranks (shard_mla.py): heads split, the latent whole on each rank.

test_tensor_parallel_architectures.py holds the tiny DeepSeek-V2/V3, GLM-4.7-Flash and Youtu models to
the single engine's tokens at tp=2; here, what the split must keep: the yarn variant's softmax scale, the
replicated latent projections and the latent cache (as large on each rank as on one process, in the
engine and in `bulkgen plan`'s memory model), and online FP8, whose absorbed kv_b_proj rows on a rank
are the single FP8 model's rows of its heads.
"""

from __future__ import annotations

import pytest
import torch
from test_lora import LENGTHS, _run, _save_adapter
from test_lora_tp import ENGINE as LORA_ENGINE
from test_lora_tp import GREEDY as LORA_GREEDY
from test_mla import DEEPSEEK_V3
from test_tensor_parallel_architectures import ENGINE, MAX_TOKENS, _greedy, _prompt_logprobs
from test_tensor_parallel_fp8 import ENGINE as FP8_ENGINE
from test_tensor_parallel_fp8 import test_two_rank_fp8_is_close_to_single_process_fp8 as close_to_single_fp8
from transformers import AutoConfig, DeepseekV3Config

from bulkgen.engine import Engine
from bulkgen.engine.attention.mla import absorbed_weights
from bulkgen.engine.parallel.rank_memory import rank_memory
from bulkgen.lab.tiny import build_tiny_model
from bulkgen.plan.memory import plan_memory

# as test_architectures.py's deepseek_v3-yarn: an mscale strong enough to change the tiny model's tokens
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 32.0,
    "original_max_position_embeddings": 64,
    "mscale": 4.0,
    "mscale_all_dim": 4.0,
}
HEADS = 4  # the tiny MLA models' attention heads: two per rank


@pytest.fixture(scope="module")
def yarn_engines(tmp_path_factory, tp_prompts, one_thread):
    """(single engine, two-rank engine, model path) of a yarn-scaled tiny DeepSeek-V3."""
    path = str(
        build_tiny_model(
            tmp_path_factory.mktemp("yarn") / "dsv3", "deepseek_v3", seed=3, rope_parameters=YARN
        )
    )
    single = Engine.from_pretrained(path, num_kv_blocks=1024, **ENGINE)
    blocks = single.runner.peak_blocks(max(map(len, tp_prompts)) + MAX_TOKENS)
    sharded = Engine.from_pretrained(path, num_kv_blocks=blocks, tensor_parallel=2, **ENGINE)
    yield single, sharded, path
    sharded.close()


def test_yarn_scaled_mla_gives_the_single_engines_tokens(yarn_engines, tp_prompts):
    single, sharded, _ = yarn_engines
    assert sharded.model.model.layers[0].self_attn.scaling == single.model.model.layers[0].self_attn.scaling
    assert _greedy(sharded, tp_prompts) == _greedy(single, tp_prompts)
    got, want = _prompt_logprobs(sharded, tp_prompts), _prompt_logprobs(single, tp_prompts)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    assert sharded.stats()["preemptions"] > 0


def test_each_rank_holds_the_whole_latent_and_half_the_heads(yarn_engines):
    """Rank 0's latent projections and norms are the whole ones; its q_b_proj and kv_b_proj are the
    first half of the heads' rows, its o_proj the first half of the columns."""
    single, sharded, _ = yarn_engines
    for mine, whole in zip(sharded.model.model.layers, single.model.model.layers, strict=True):
        ours, theirs = mine.self_attn, whole.self_attn
        for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
            assert torch.equal(getattr(ours, name).weight, getattr(theirs, name).weight), name
        for name in ("q_b_proj", "kv_b_proj"):
            rows = getattr(theirs, name).weight.shape[0] // 2
            assert torch.equal(getattr(ours, name).weight, getattr(theirs, name).weight[:rows]), name
        columns = theirs.o_proj.weight.shape[1] // 2
        assert torch.equal(ours.o_proj.weight, theirs.o_proj.weight[:, :columns])


def test_each_ranks_latent_cache_is_the_single_engines(yarn_engines):
    """Every rank caches the whole latent (it is every head's K and V): per token, the two-rank engine's
    cache, the single engine's and `bulkgen plan`'s figure at 1 and 2 ranks are one number; the weights
    each rank reports holding are what the memory model counts for it."""
    single, sharded, path = yarn_engines
    config = AutoConfig.from_pretrained(path)
    latent = config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 4  # fp32
    assert sharded.runner.layout.token_bytes(torch.float32) == latent
    assert single.runner.layout.token_bytes(torch.float32) == latent
    for ranks in (1, 2):
        assert rank_memory(config, ranks, torch.float32)["kv_bytes_per_token"] == latent
        assert plan_memory(path, ranks)["kv_bytes_per_token"] == latent // 2  # the plan counts bf16
    held = [m["weight_bytes"] for m in sharded.runner.tp.rank_memory()]
    assert held == [rank_memory(config, 2, torch.float32)["weight_bytes"]] * 2


def test_deepseek_v3_rank_memory_keeps_the_latent_whole():
    """DeepSeek-V3's shape over 8 ranks: each holds the latent projections, norms and routers whole and
    1/8 of the rest; its cache per token is the 576-value latent of each of 61 layers, as on one GPU."""
    config = DeepseekV3Config(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        n_routed_experts=256,
        first_k_dense_replace=3,
        **DEEPSEEK_V3,
    )
    one, eight = (rank_memory(config, n, torch.bfloat16) for n in (1, 8))
    assert one["kv_bytes_per_token"] == eight["kv_bytes_per_token"] == 61 * 576 * 2
    assert round(one["weight_bytes"] / 2e9) == 671  # DeepSeek-V3's main model (its MTP module not built)
    hidden, moe_layers = 7168, 61 - 3
    whole = 61 * (hidden * 1536 + 1536 + hidden * 576 + 512 + 2 * hidden) + moe_layers * 256 * hidden
    whole += hidden  # the final norm (the routers' score-correction biases are buffers, not weights)
    split = one["weight_bytes"] // 2 - whole
    assert eight["weight_bytes"] // 2 == whole + split // 8


@pytest.fixture(scope="module")
def fp8_engines(tmp_path_factory, one_thread):
    """(float engine, single-process FP8 engine, two-rank FP8 engine, prompts) of a tiny DeepSeek-V3."""
    path = str(build_tiny_model(tmp_path_factory.mktemp("fp8") / "dsv3", "deepseek_v3", seed=3))
    gen = torch.Generator().manual_seed(39)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 32, 100, 60, 45)]
    float_engine = Engine.from_pretrained(path, **FP8_ENGINE)
    fp8 = Engine.from_pretrained(path, quantize="fp8", **FP8_ENGINE)
    sharded = Engine.from_pretrained(path, quantize="fp8", tensor_parallel=2, **FP8_ENGINE)
    yield float_engine, fp8, sharded, prompts
    sharded.close()


def test_fp8_ranks_absorb_their_heads_rows_of_the_single_fp8_kv_b_proj(fp8_engines):
    """kv_b_proj is column-parallel: a rank's e4m3 rows and per-row scales are the single FP8 model's, so
    its absorbed W_UK and W_UV (read through the quantized layer) are the single model's for its heads."""
    _, fp8, sharded, _ = fp8_engines
    for mine, whole in zip(sharded.model.model.layers, fp8.model.model.layers, strict=True):
        ours, theirs = (
            absorbed_weights(mine.self_attn, torch.float32),
            absorbed_weights(whole.self_attn, torch.float32),
        )
        assert ours[0].shape[0] == theirs[0].shape[0] // 2 == HEADS // 2
        assert torch.equal(ours[0], theirs[0][: HEADS // 2]) and torch.equal(ours[1], theirs[1][: HEADS // 2])


def test_two_rank_fp8_mla_is_close_to_single_process_fp8(fp8_engines):
    """As Llama's (test_tensor_parallel_fp8.py): only the row-parallel shards (o_proj, the dense, shared
    and routed experts' down projections) have their own scales, so logprobs stay within its bound of
    single FP8 and greedy tokens part only at near-ties. Measured, prompt logprobs off single FP8 max /
    mean, against single FP8 off float: seed 3, 0.020 / 0.0024 against 0.034 / 0.0038 (tokens: 5 of 5
    prompts equal); seed 5, 0.055 / 0.0032 against 0.024 / 0.0033 (5 of 5 equal): one prompt token
    past Llama's 0.05 bound, with more row-parallel FP8 layers per block than Llama's two."""
    close_to_single_fp8(fp8_engines)


def test_lora_on_split_and_replicated_mla_projections_gives_the_single_engines_tokens(tmp_path, one_thread):
    """Adapters on the replicated latent projections (whole A and B on every rank), on q_b_proj (B split
    by heads' rows) and on o_proj (A split by columns): the two-rank engine's tokens are the single
    engine's with the same adapters (MLP adapters split as on any model: test_lora_tp.py)."""
    path = build_tiny_model(tmp_path / "dsv3", "deepseek_v3", seed=3)
    adapters = {
        "latent": _save_adapter(
            path, tmp_path / "latent", 10, 4, 8, False, ["q_a_proj", "kv_a_proj_with_mqa"]
        ),
        "heads": _save_adapter(path, tmp_path / "heads", 11, 2, 6, False, ["q_b_proj", "o_proj"]),
    }
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]
    engines = [Engine.from_pretrained(str(path), tensor_parallel=tp, **LORA_ENGINE) for tp in (1, 2)]
    try:
        for engine in engines:
            for name, folder in adapters.items():
                engine.add_lora(name, folder)
        plan = [None, "latent", "heads", "latent", "heads", None, "heads", "latent"]
        got = _run(engines[1], prompts, plan, LORA_GREEDY)
        assert got == _run(engines[0], prompts, plan, LORA_GREEDY)
        base = _run(engines[0], prompts, [None] * len(prompts), LORA_GREEDY)
        assert {plan[int(i)] for i in got if got[i] != base[i]} == {"latent", "heads"}  # both change tokens
    finally:
        engines[1].close()
