"""Online FP8 weights (`quantize="fp8"`): each linear layer within FP8's rounding of the float layer,
the engine's greedy tokens equal to transformers' generate over the same quantized modules, and the
load quantizing a layer at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.model.fp8 import FP8, quantize_rows
from bulkgen.engine.model.quantize import Fp8Linear, quantize_layers, weight_bytes
from tests.support.logprobs import assert_follows

# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of itself; a
# subnormal (below 2^-6 in scaled units) by at most half its step, 2^-10 of the row's scale
REL, SUB = 2.0**-4, 2.0**-10


def _rounding(x: torch.Tensor) -> torch.Tensor:
    """Largest e4m3 rounding error of each element of x, quantized per row as quantize_rows does."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / torch.finfo(FP8).max
    return torch.maximum(x.abs() * REL, scale * SUB)


@pytest.fixture(scope="module")
def float_and_fp8(model_dirs):
    """The tiny llama twice: as loaded (fp32) and quantized in place."""
    float_model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()
    quantized = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()
    report = quantize_layers(quantized, "cpu")
    return float_model, quantized, report


def test_each_linear_is_within_fp8_rounding_of_the_float_layer(float_and_fp8):
    """|y_fp8 - y| <= sum_i (ex_i |w_i| + |x_i| ew_i + ex_i ew_i) elementwise, ex/ew each operand's
    largest e4m3 rounding error (the product's float accumulation adds far less)."""
    float_model, quantized, report = float_and_fp8
    assert report.linears == 7 * len(quantized.model.layers) and report.fallback == 0
    gen = torch.Generator().manual_seed(0)
    layers = dict(float_model.named_modules())
    checked = 0
    for name, fp8 in quantized.named_modules():
        if not isinstance(fp8, Fp8Linear):
            continue
        reference = layers[name]
        assert fp8.weight.dtype == FP8 and fp8.weight_scale.shape == (fp8.out_features, 1)
        x = torch.randn(9, fp8.in_features, generator=gen) * torch.rand(9, 1, generator=gen) * 4
        with torch.no_grad():
            got, want = fp8(x), reference(x)
        w = reference.weight.detach()
        ex, ew = _rounding(x), _rounding(w)
        bound = ex @ w.abs().t() + x.abs() @ ew.t() + ex @ ew.t() + 1e-5
        assert ((got - want).abs() <= bound).all(), name
        relative = (got - want).norm() / want.norm()
        assert 1e-4 < relative < 0.08, (name, relative.item())  # quantized, and near the float layer
        checked += 1
    assert checked == report.linears


def test_quantize_rows_round_trip_and_zero_rows():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 448.0, -3e5]])
    values, scale = quantize_rows(x)
    assert values.dtype == FP8 and not values.float().isnan().any()
    assert values.float().abs().amax(-1).tolist() == [448.0, 0.0, 448.0]
    assert ((values.float() * scale - x).abs() <= _rounding(x)).all()


def test_embedding_and_lm_head_stay_float(float_and_fp8):
    float_model, quantized, report = float_and_fp8
    assert quantized.get_input_embeddings().weight.dtype == torch.float32
    assert type(quantized.get_output_embeddings()) is torch.nn.Linear
    assert report.float_params == sum(
        p.numel() for layer in quantized.model.layers for n, p in layer.named_parameters() if "norm" in n
    )
    linear = sum(m.weight.numel() for m in quantized.modules() if isinstance(m, Fp8Linear))
    scales = sum(m.out_features for m in quantized.modules() if isinstance(m, Fp8Linear))
    assert weight_bytes(float_model) - weight_bytes(quantized) == linear * 3 - scales * 4  # 4 -> 1 byte each


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_greedy_equals_generate_over_the_same_fp8_modules(arch, model_dirs, mixed_prompts):
    """Mixed packed steps (chunked prefill beside decodes) over the online-FP8 model give transformers'
    greedy tokens for each prompt alone, transformers running the same quantized modules; the tokens'
    logprobs are those of the quantized model, not the float one (a tiny model's greedy tokens alone
    rarely tell the two apart)."""
    float_model = AutoModelForCausalLM.from_pretrained(model_dirs[arch]).eval()
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[arch]).eval()
    quantize_layers(hf, "cpu")
    prompts = mixed_prompts(seed=11, count=8, low=1, high=90)
    engine = Engine.from_pretrained(
        str(model_dirs[arch]),
        device="cpu",
        quantize="fp8",
        max_num_seqs=5,
        max_num_batched_tokens=40,
        block_size=8,
    )
    assert sum(isinstance(m, Fp8Linear) for m in engine.model.modules()) == 7 * len(hf.model.layers)
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=0))
    records = engine.pop_step_records()
    assert any(r["prefill_tokens"] and r["decode_tokens"] for r in records)
    off_float = assert_follows(hf, prompts, outs, 8, float_model)
    assert off_float > 1e-3  # FP8 rounding shows in the logprobs


PEAK_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from bulkgen.engine.model.fp8 import quantize_rows
from bulkgen.engine.model.quantize import quantize_layers

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

# bf16 from an fp32 checkpoint: weights converted into process memory (a same-dtype load may map the file)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).eval()
layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
quantize_rows(torch.ones(2, 2))  # the float8 casts' code loaded before measuring
open("/proc/self/clear_refs", "w").write("5")  # VmHWM restarts from the current RSS
start = rss("VmRSS")
quantize_layers(model, "cpu")
print(json.dumps({"start": start, "peak": rss("VmHWM"), "end": rss("VmRSS"), "layer": layer_bytes}))
"""


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    from bulkgen.lab.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("six") / "llama"
    return build_tiny_model(
        path, arch="llama", seed=3, hidden_size=256, intermediate_size=1024, num_hidden_layers=6
    )


def test_quantizing_holds_at_most_one_float_layer_more(six_layers):
    """Quantizing a layer at a time: RSS never rises by more than one float layer (6 bf16 layers of
    1.97 MB here; measured 1.57 MB), and ends lower by about half the linear weights. glibc's malloc returns big blocks
    to the system at once only with a fixed mmap threshold (its dynamic one keeps them in the heap)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(six_layers)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["peak"] - got["start"] <= got["layer"], got
    assert got["start"] - got["end"] >= 6 * 0.4 * got["layer"], got  # 6 layers, bf16 -> e4m3: half freed


def test_the_engine_quantizes_a_float_model_it_is_given(model_dirs, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()
    engine = Engine(model, tokenizer, quantize="fp8", max_num_seqs=2)
    assert sum(isinstance(m, Fp8Linear) for m in engine.model.modules()) == 7 * len(model.model.layers)
    with pytest.raises(ValueError, match=r"^quantize must be one of fp8 \(or None\), got 'int4'$"):
        Engine(AutoModelForCausalLM.from_pretrained(model_dirs["llama"]), tokenizer, quantize="int4")


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from bulkgen.lab.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("moe")
    return {arch: build_tiny_model(root / arch, arch=arch, seed=4) for arch in ("qwen3_moe", "gpt_oss")}


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_fused_moe_experts_are_fp8_within_a_stated_bound(arch, moe_dirs):
    """Fused experts (3-D weights; gpt-oss' transposed, with biases and its clamped gate) in e4m3: the
    experts' output within 8% (relative norm) of the float module's, two FP8 products of at most 2^-4
    relative rounding per operand each; measured 5-6%."""
    float_model = AutoModelForCausalLM.from_pretrained(moe_dirs[arch]).eval()
    quantized = AutoModelForCausalLM.from_pretrained(moe_dirs[arch]).eval()
    report = quantize_layers(quantized, "cpu")
    assert report.experts == len(quantized.model.layers)
    gen = torch.Generator().manual_seed(1)
    for want_module, got_module in zip(float_model.model.layers, quantized.model.layers, strict=True):
        experts = got_module.mlp.experts
        assert experts.down_proj.dtype == FP8 and experts.down_proj_scale.dtype == torch.float32
        hidden = torch.randn(12, float_model.config.hidden_size, generator=gen)
        route = torch.randint(0, experts.num_experts, (12, 2), generator=gen)
        weights = torch.rand(12, 2, generator=gen)
        with torch.no_grad():
            want, got = want_module.mlp.experts(hidden, route, weights), experts(hidden, route, weights)
        relative = ((got - want).norm() / want.norm()).item()
        assert 1e-4 < relative < 0.08, relative


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_moe_engine_greedy_equals_generate_over_the_same_fp8_modules(arch, moe_dirs, mixed_prompts):
    hf = AutoModelForCausalLM.from_pretrained(moe_dirs[arch]).eval()
    quantize_layers(hf, "cpu")
    prompts = mixed_prompts(seed=12, count=6, low=1, high=70)
    engine = Engine.from_pretrained(
        str(moe_dirs[arch]),
        device="cpu",
        quantize="fp8",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        block_size=8,
    )
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0, logprobs=0))
    assert_follows(hf, prompts, outs, 6)
