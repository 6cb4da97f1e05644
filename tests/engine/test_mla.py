"""MLA's latent KV cache (bulkgen/engine/attention/mla.py): what it stores, what it costs, and the paths that read it.

Greedy tokens against transformers (chunked prefill, prefix caching, preemption, the decode buffers) for
the tiny DeepSeek-V3, DeepSeek-V2-Lite-shaped and yarn-scaled models are in test_architectures.py; here,
the cache's content and size on a tiny DeepSeek-V3 (kv_lora_rank 32, rope dim 8, 4 heads of K 24 / V 16),
DeepSeek-V3's real attention shape, the triton decode kernel over the latent, and the memory model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.attention import triton_decode as td
from bulkgen.engine.attention.attn_backends import BACKENDS, DecodeMeta, paged_decode
from bulkgen.engine.attention.attn_select import _all_fused_refused
from bulkgen.engine.attention.layer_attention import probe_layers
from bulkgen.engine.attention.mla import absorbed_weights, find_mla, wrap_mla
from bulkgen.engine.kv import kv_cache
from bulkgen.engine.kv.kv_layout import KVLayout
from bulkgen.engine.model.quantize import Fp8Linear
from bulkgen.engine.sequence import Request, Sequence
from bulkgen.plan.memory import plan_memory

LATENT = 32 + 8  # the tiny model's kv_lora_rank + qk_rope_head_dim
# deepseek-ai/DeepSeek-V3's config.json: the attention numbers (hidden size cut: it shapes no cache)
DEEPSEEK_V3 = dict(
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("deepseek_v3", seed=3)


def test_the_cache_holds_each_tokens_latent_once_per_layer(tiny):
    """One KV head of kv_lora_rank + rope values per token and layer, V a view of K (no second copy),
    and the rows a prompt left in its prefix-cached blocks equal the c_kv and rope'd k_pe transformers'
    own cache keeps for it."""
    engine = Engine.from_pretrained(str(tiny), device="cpu", block_size=8, num_kv_blocks=64)
    runner = engine.runner
    assert all(layer.latent and layer.kv_shape == (1, LATENT, 32, True) for layer in runner.layers)
    k, v = runner.k_caches[0], runner.v_caches[0]
    assert k.shape == (65, 8, 1, LATENT) and v.shape == (65, 8, 1, 32)
    assert v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    layers = len(runner.layers)
    assert runner.layout.token_bytes(torch.float32) == layers * LATENT * 4
    assert runner.layout.block_bytes(8, torch.float32) == layers * 8 * LATENT * 4

    # 17 tokens: both full blocks are hashed, and a hit leaves the last token to compute
    prompt = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    # outside the engine's steps the wrapped layers run transformers' own forward (generate is untouched)
    with torch.no_grad():
        own = engine.model.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False)[0, -1]
    assert (
        own.item() == engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    )
    seq = Sequence(0, Request("r", prompt, SamplingParams(max_tokens=1), order=0), 0, max_tokens=1)
    blocks = engine.block_manager.match_prefix(seq).tables[0][:2]
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    with torch.no_grad():
        past = model(torch.tensor([prompt]), use_cache=True).past_key_values
    for i in range(layers):
        cached = runner.k_caches[i][blocks].reshape(16, LATENT)
        want = torch.cat([past.layers[i].keys[0, 0], past.layers[i].values[0, 0]], dim=-1)[:16]
        torch.testing.assert_close(cached, want, atol=1e-5, rtol=1e-5)


def test_fp8_latent_rows_share_one_scale_and_count_it(tiny):
    engine = Engine.from_pretrained(
        str(tiny), device="cpu", block_size=8, num_kv_blocks=16, kv_cache_dtype="fp8"
    )
    k, v = engine.runner.k_caches[0], engine.runner.v_caches[0]
    assert isinstance(v, kv_cache.Fp8Cache) and v.scale is k.scale
    assert v.data.untyped_storage().data_ptr() == k.data.untyped_storage().data_ptr()
    assert engine.runner.layout.token_bytes(kv_cache.FP8) == len(engine.runner.layers) * (LATENT + 4)


def test_deepseek_v3_caches_71x_fewer_bytes_per_token():
    """DeepSeek-V3's attention shape, probed as the engine probes it: 128 heads of K 192 and V 128
    expanded, one latent of 576 (512 + 64 rope) per token and layer; over its 61 layers in bf16."""
    config = DeepseekV3Config(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        first_k_dense_replace=1,
        vocab_size=16,
        **DEEPSEEK_V3,
    )
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    expanded = probe_layers(model)[0]
    wrap_mla(find_mla(model))
    latent = probe_layers(model)[0]
    assert expanded.kv_shape == (128, 192, 128, False)
    assert latent.kv_shape == (1, 576, 512, True) and latent.q_heads == 128
    before, after = KVLayout([expanded] * 61), KVLayout([latent] * 61)
    assert before.token_bytes(torch.bfloat16) == 61 * 128 * (192 + 128) * 2 == 4_997_120
    assert after.token_bytes(torch.bfloat16) == 61 * 576 * 2 == 70_272
    assert round(before.token_bytes(torch.bfloat16) / after.token_bytes(torch.bfloat16), 1) == 71.1
    assert after.token_bytes(kv_cache.FP8) == 61 * (576 + 4)


def test_plan_counts_the_latent_bytes(tiny):
    """`bulkgen plan`'s memory model (from the config alone) counts what the engine's cache stores."""
    config = AutoConfig.from_pretrained(tiny)
    for ranks in (1, 2):  # the latent is whole on every rank
        memory = plan_memory(str(tiny), ranks)
        assert memory["kv_bytes_per_token"] == config.num_hidden_layers * LATENT * 2
    engine = Engine.from_pretrained(str(tiny), device="cpu", dtype=torch.bfloat16, num_kv_blocks=8)
    assert engine.runner.layout.token_bytes(torch.bfloat16) == memory["kv_bytes_per_token"]


def test_flash_kernels_refuse_the_latent_head_as_a_feature():
    """On CUDA an MLA model runs plain prefills: the refusal is a feature one, so selection logs it and
    takes plain instead of failing the load or running a kernel that cannot take a 576-wide head."""
    from bulkgen.engine.attention.layer_attention import FULL, LayerAttention

    layer = LayerAttention(FULL, 1, 576, 512, q_heads=128, latent=True)
    report = {name: BACKENDS[name]().supports(layer) for name in ("flash_varlen", "varlen_paged")}
    assert all(report.values()) and _all_fused_refused(report)
    assert "576" in report["flash_varlen"]


@pytest.mark.parametrize("fp8", [False, True])
def test_triton_decode_reads_v_as_the_leading_columns_of_the_latent(fp8):
    """CUDA's decode kernel, run by triton's interpreter, over K [c_kv, k_pe] and V a strided view of
    its first columns (as the engine allocates them) against the padded reference."""
    gen = torch.Generator().manual_seed(4)
    lengths, hq, dim, dim_v, bs = [1, 9, 23, 40], 8, 40, 32, 4
    table = torch.randperm(48, generator=gen)[:44].view(4, 11)
    cache = torch.randn(48, bs, 1, dim, generator=gen)
    k = kv_cache.Fp8Cache(*kv_cache.quantize(cache)) if fp8 else cache
    v = kv_cache.leading(k, dim_v)
    q, lens = torch.randn(4, hq, dim, generator=gen), torch.tensor(lengths)
    got = td.paged_decode(q, k, v, table, lens, 0.3)
    want = paged_decode(q, k, v, DecodeMeta(0, 4, table, lens), 0.3, "padded")
    assert got.shape == (4, hq, dim_v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_quantized_kv_b_proj_is_absorbed_as_its_dequantized_weight(tiny):
    """Online FP8 weights make kv_b_proj an Fp8Linear: the absorbed W_UK and W_UV are its e4m3 rows times
    their scales (read once through its forward), and the engine runs the model."""
    engine = Engine.from_pretrained(str(tiny), device="cpu", block_size=8, quantize="fp8")
    attn = engine.model.model.layers[0].self_attn
    proj = attn.kv_b_proj
    assert isinstance(proj, Fp8Linear)
    w_uk, w_uv = absorbed_weights(attn, torch.float32)
    dequantized = (proj.weight.float() * proj.weight_scale).view(4, 16 + 16, 32)
    torch.testing.assert_close(w_uk, dequantized[:, :16])
    torch.testing.assert_close(w_uv, dequantized[:, 16:])
    outs = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(outs[0].token_ids) == 4


def test_lora_on_the_absorbed_kv_b_proj_is_refused(tiny, tmp_path):
    """kv_b_proj is folded into the queries and outputs: an adapter there would be dropped silently, so
    it is refused naming the layer; one on the other projections (q_b_proj) still loads."""
    from test_lora import _write_adapter

    from bulkgen.engine.features.lora import LoraError

    engine = Engine.from_pretrained(str(tiny), device="cpu", block_size=8, num_kv_blocks=16)
    attn = engine.model.model.layers[0].self_attn
    for child in ("kv_b_proj", "q_b_proj"):
        proj = getattr(attn, child)
        _write_adapter(
            tmp_path / child, f"model.layers.0.self_attn.{child}", proj.in_features, proj.out_features
        )
    with pytest.raises(LoraError, match=r"kv_b_proj is absorbed .*model\.layers\.0\.self_attn\.kv_b_proj"):
        engine.add_lora("kv", tmp_path / "kv_b_proj")
    engine.add_lora("q", tmp_path / "q_b_proj")
    assert engine.loras() == ["q"]
