"""LoRA adapters in the engine: rows of several adapters and of the base model share packed steps, and each
row's greedy tokens equal peft's `merge_and_unload()` model of its adapter run alone through transformers'
`generate` (fp32, CPU). Three tiny random adapters (different ranks, alphas, rsLoRA and targets, B
non-zero) on a tiny Llama (attention and MLP targets) and a tiny Qwen3-MoE (attention targets; LoRA on its
fused experts is refused by name). Also: the slot pool with fewer slots than adapters, prefix caching per
adapter, seeded sampling, embeddings, and the refusals at load.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from bulkgen.engine import EmbedParams, Engine, SamplingParams
from bulkgen.engine.features.lora import LoraError
from bulkgen.lab.tiny import build_tiny_model

pytestmark = pytest.mark.upstream  # also on the lower bound and the canary (README: tested ranges)

MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name: (rank, alpha, rsLoRA, targets)
    "a": (4, 8, False, ["q_proj", "v_proj"]),
    "b": (8, 4, True, ["o_proj", *MLP]),
    "c": (2, 6, False, ["q_proj", "k_proj", "v_proj", "o_proj", *MLP]),
}
LENGTHS = [70, 5, 33, 12, 48, 9, 21, 3]
PLAN = [None, "a", "b", "c", "a", None, "c", "b"]  # the adapter of each prompt
MAX_TOKENS = 8


def _save_adapter(base_path, out, seed: int, rank: int, alpha: int, rslora: bool, targets, **extra):
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_path))
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=targets,
        init_lora_weights=False,  # random A and B: a zero B would make every adapter the base model
        **extra,
    )
    get_peft_model(base, config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{arch: (model folder, {adapter name: adapter folder})} for a tiny Llama and a tiny Qwen3-MoE."""
    root = tmp_path_factory.mktemp("lora")
    built = {}
    for arch, extra in (("llama", {}), ("qwen3_moe", {"mlp_only_layers": [1]})):
        path = build_tiny_model(root / arch, arch, seed=3, **extra)
        adapters = {}
        for i, (name, (rank, alpha, rslora, targets)) in enumerate(ADAPTERS.items()):
            if arch == "qwen3_moe":  # peft turns MLP names into LoRA on the fused experts (refused)
                targets = [t for t in targets if t not in MLP]
            adapters[name] = _save_adapter(
                path, root / f"{arch}-{name}", i + 10, rank, alpha, rslora, targets
            )
        built[arch] = (path, adapters)
    return built


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]


@functools.cache
def _merged(path, adapter) -> torch.nn.Module:
    """The base model, or peft's merge of `adapter` into it (loaded once per test module run)."""
    model = AutoModelForCausalLM.from_pretrained(str(path))
    if adapter is None:
        return model
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()


def _reference(path, adapter, prompt: list[int]) -> list[int]:
    model = _merged(path, adapter)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _engine(path, adapters, **kwargs) -> Engine:
    engine = Engine.from_pretrained(str(path), device="cpu", **kwargs)
    for name, folder in adapters.items():
        engine.add_lora(name, folder)
    return engine


def _run(engine: Engine, prompts, plan, params) -> dict:
    for i, (prompt, lora) in enumerate(zip(prompts, plan, strict=True)):
        engine.add_request(str(i), prompt, params, lora=lora)
    results = {}
    while engine.has_unfinished():
        results.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_mixed_adapters_equal_merged_models(models, prompts, arch):
    path, adapters = models[arch]
    want = {
        str(i): _reference(path, None if lora is None else adapters[lora], p)
        for i, (p, lora) in enumerate(zip(prompts, PLAN, strict=True))
    }
    base = [want[str(i)] for i, lora in enumerate(PLAN) if lora is None]
    assert all(want[str(i)] != _reference(path, None, prompts[i]) for i, lora in enumerate(PLAN) if lora)
    assert base  # rows of the base model ride along
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    # 32 tokens per step: long prompts prefill in chunks beside other adapters' decodes; 2 slots for 3
    # adapters: the third waits for a free slot; with decode graphs on (eager on CPU) steps with adapter
    # rows bypass them; overlapped steps fill slots for a step while the previous one is in flight
    for kwargs in (
        {"max_loras": 4, "cuda_graphs": True},
        {"max_loras": 2, "max_num_batched_tokens": 32, "async_scheduling": True},
    ):
        engine = _engine(path, adapters, **kwargs)
        assert _run(engine, prompts, PLAN, greedy) == want, kwargs
    assert engine.runner.loras.loads > 2  # three adapters through two slots: one was evicted


def test_a_step_never_holds_more_adapters_than_slots(models, prompts):
    path, adapters = models["llama"]
    engine = _engine(path, adapters, max_loras=2)
    for i, (prompt, lora) in enumerate(zip(prompts, PLAN, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=4, temperature=0), lora=lora)
    widest = 0
    while engine.has_unfinished():
        engine.step()
        running = {s.lora.name for s in engine.scheduler.running if s.lora is not None}
        widest = max(widest, len(running))
    assert widest == 2


def test_rows_of_a_waiting_adapter_let_others_go_ahead(models, prompts):
    path, adapters = models["llama"]
    engine = _engine(path, adapters, max_loras=1)
    params = SamplingParams(max_tokens=4, temperature=0)
    for rid, prompt, lora in (("a", prompts[0], "a"), ("b", prompts[4], "b"), ("base", prompts[1], None)):
        engine.add_request(rid, prompt, params, lora=lora)  # admitted longest first: a, b, base
    engine.step()
    running = sorted(s.request.request_id for s in engine.scheduler.running)
    assert running == ["a", "base"]  # b waits for the one slot; the base row behind it does not


def test_prefix_cache_is_per_adapter(models):
    path, adapters = models["llama"]
    engine = _engine(path, adapters, block_size=16)
    shared = list(range(40, 40 + 64))  # four full blocks
    greedy = SamplingParams(max_tokens=2, temperature=0)

    def cached(tail: int, lora: str | None) -> int:
        (out,) = (
            engine.generate([shared + [tail]], greedy)
            if lora is None
            else [_alone(engine, shared + [tail], lora)]
        )
        return out.metrics.num_cached_tokens

    assert cached(1, "a") == 0
    assert cached(2, "b") == 0  # same tokens under other weights: computed again
    assert cached(3, None) == 0  # and for the base model
    assert cached(4, "a") == 64  # within one adapter the prefix is shared
    assert cached(5, "b") == 64


def _alone(engine: Engine, prompt, lora):
    engine.add_request("x", prompt, SamplingParams(max_tokens=2, temperature=0), lora=lora)
    while True:
        for out in engine.step():
            return out


def test_seeded_sampling_with_adapters_is_batch_independent(models, prompts):
    path, adapters = models["llama"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5, ignore_eos=True)
    engine = _engine(path, adapters)
    alone = {lora: _run(engine, [prompts[1]], [lora], params)["0"] for lora in ("a", "b")}
    mixed = _run(engine, prompts, PLAN, params)
    assert mixed["1"] == alone["a"] and mixed["7"] == _run(engine, [prompts[7]], ["b"], params)["0"]
    assert alone["a"] != alone["b"]


def test_embeddings_with_an_adapter(models, prompts):
    path, adapters = models["llama"]
    engine = _engine(path, adapters)
    for i, lora in enumerate((None, "a", "c")):
        engine.add_request(str(i), prompts[2], EmbedParams(), lora=lora)
    got = {}
    while engine.has_unfinished():
        got.update({o.request_id: torch.tensor(o.embedding) for o in engine.step()})
    merged = _merged(path, adapters["c"])
    with torch.no_grad():
        last = merged.model(torch.tensor([prompts[2]])).last_hidden_state[0, -1]
    want = torch.nn.functional.normalize(last, dim=0)
    assert torch.allclose(got["2"], want, atol=1e-4)
    assert not torch.allclose(got["0"], got["1"], atol=1e-3)


def test_refused_adapters_name_the_feature(models, tmp_path):
    path, adapters = models["llama"]
    engine = _engine(path, {}, max_lora_rank=8)
    cases = {
        "use_dora": dict(use_dora=True),
        "modules_to_save": dict(modules_to_save=["lm_head"]),
    }
    for i, (feature, extra) in enumerate(cases.items()):
        folder = _save_adapter(path, tmp_path / feature, i, 4, 8, False, ["q_proj"], **extra)
        with pytest.raises(LoraError, match=feature):
            engine.add_lora(feature, folder)
    embed = _save_adapter(path, tmp_path / "embed", 0, 4, 8, False, ["embed_tokens"])
    with pytest.raises(LoraError, match="embedding"):
        engine.add_lora("embed", embed)
    head = _save_adapter(path, tmp_path / "head", 0, 4, 8, False, ["lm_head"])
    with pytest.raises(LoraError, match="lm_head"):
        engine.add_lora("head", head)
    wide = _save_adapter(path, tmp_path / "wide", 0, 16, 8, False, ["q_proj"])
    with pytest.raises(LoraError, match=r"rank 16 \(.*\) is above max_lora_rank 8"):
        engine.add_lora("wide", wide)
    moe_path, _ = models["qwen3_moe"]
    moe = Engine.from_pretrained(str(moe_path), device="cpu")
    with pytest.raises(
        LoraError, match=r"target module 'model\.layers\.0\.mlp\.\w+_proj' is not in the model"
    ):
        moe.add_lora("b", adapters["b"])  # Llama's MLP: Qwen3-MoE's layer 0 has experts there
    experts = _save_adapter(moe_path, tmp_path / "experts", 0, 4, 8, False, ["o_proj", "down_proj"])
    with pytest.raises(LoraError, match="target_parameters, e.g. fused MoE experts"):
        moe.add_lora("experts", experts)
    _write_adapter(tmp_path / "expert", "model.layers.0.mlp.experts.0.gate_proj", 64, 32)
    with pytest.raises(LoraError, match="MoE expert projections"):
        moe.add_lora("expert", tmp_path / "expert")
    with pytest.raises(LoraError, match="unknown LoRA adapter 'b'"):
        engine.add_request("r", [1, 2, 3], SamplingParams(), lora="b")
    assert engine.loras() == [] and moe.loras() == []


def test_add_and_remove(models, prompts, tmp_path):
    path, adapters = models["llama"]
    engine = _engine(path, {"a": adapters["a"]})
    with pytest.raises(LoraError, match="already loaded"):
        engine.add_lora("a", adapters["a"])
    engine.add_request("r", prompts[0], SamplingParams(max_tokens=2), lora="a")
    with pytest.raises(LoraError, match="in use by 1 requests"):
        engine.remove_lora("a")
    while engine.has_unfinished():
        engine.step()
    engine.remove_lora("a")
    engine.add_lora("a", adapters["b"])  # the name again, other weights: no cached KV of the old ones
    assert engine.loras() == ["a"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    with pytest.raises(LoraError, match="adapter_model.safetensors is missing"):
        engine.add_lora("bad", bad)


def test_lora_inside_a_recurrent_mixer_is_refused(tmp_path):
    """A hybrid model's mixers run sequence by sequence, not on the packed row the slots index."""
    from bulkgen.lab.tiny_hybrid import build_tiny_hybrid

    path = build_tiny_hybrid(tmp_path / "lfm2", "lfm2")
    engine = Engine.from_pretrained(str(path), device="cpu")
    hidden = engine.model.config.hidden_size
    for module, name in (("conv.in_proj", "mixer"), ("feed_forward.w1", "mlp")):
        out = engine.model.get_submodule(f"model.layers.0.{module}").out_features
        _write_adapter(tmp_path / name, f"model.layers.0.{module}", hidden, out)
    with pytest.raises(LoraError, match=r"inside the recurrent layer model\.layers\.0\.conv"):
        engine.add_lora("mixer", tmp_path / "mixer")
    engine.add_lora("mlp", tmp_path / "mlp")  # the layer's MLP runs on the packed row
    assert engine.loras() == ["mlp"]


def _write_adapter(folder, module: str, fan_in: int, fan_out: int) -> None:
    """A rank-2 PEFT folder by hand: LoRA on one module of any name."""
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    key = f"base_model.model.{module}"
    weights = {f"{key}.lora_A.weight": torch.ones(2, fan_in), f"{key}.lora_B.weight": torch.ones(fan_out, 2)}
    save_file(weights, str(folder / "adapter_model.safetensors"))
