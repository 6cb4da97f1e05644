"""CUDA path (not run in development: no GPU there). Runs only where a CUDA device exists.

Tolerances: fp32 on CUDA must equal the CPU reference token for token (the plain backend runs in
fp32; TF32 is off by default). bf16 is compared with transformers' own bf16 `generate` on the same
GPU by first divergence (tests/support/divergence.py): with 16 new tokens per prompt, at least half the
prompts identical, a median first divergence of 8 or later, and any divergence before position 2 at a
near-tie of the reference's logits (a wrong mask or cache layout parts early on most prompts, at wide
margins; the same judge runs on CPU in test_bf16_divergence.py).
"""

from __future__ import annotations

import logging

import pytest
import torch

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.attention import attn_select
from bulkgen.engine.attention.attn_backends import BACKENDS, cuda_candidates
from bulkgen.engine.attention.layer_attention import FULL, AttnKind, LayerAttention
from tests.support.divergence import bf16_greedy_against_hf

# Sized from free memory, a tiny model's cache would be ~30 M blocks (a Python object each: a minute of
# CPU and ~10 GB per engine); only test_cuda_defaults_fill_the_gpu keeps the default sizing.
NUM_KV_BLOCKS = 4096

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_fp32_greedy_matches_cpu_reference(arch, model_dirs, reference, mixed_prompts):
    prompts = mixed_prompts(seed=30, count=6, low=1, high=80)
    engine = Engine.from_pretrained(
        str(model_dirs[arch]),
        device="cuda",
        dtype=torch.float32,
        max_num_batched_tokens=64,
        block_size=8,
        num_kv_blocks=NUM_KV_BLOCKS,
    )
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference.greedy(arch, prompt, 8)


def self_check_block_sizes(backend: str) -> tuple[int, ...]:
    """Block 256 exists for varlen_paged (its kernel's paged layout); elsewhere it only compiles three
    spilling triton decode variants (8.5 KB of stack per thread, 6-30 s each) that nothing runs."""
    return (16, 256) if backend == "varlen_paged" else (16,)


LAYERS = {  # each kind of layer the fused kernels take, at real head sizes
    "dense": LayerAttention(FULL, 2, 64, 64, q_heads=8),
    "sliding window": LayerAttention(AttnKind(window=128), 8, 64, 64, q_heads=64),
    "window and sinks (gpt-oss)": LayerAttention(AttnKind(window=128), 8, 64, 64, sinks=True, q_heads=64),
    "sinks": LayerAttention(FULL, 8, 64, 64, sinks=True, q_heads=64),
    "chunked (Llama 4)": LayerAttention(AttnKind(chunk=8192), 8, 128, 128, q_heads=40),
    "MLA (DeepSeek-V3)": LayerAttention(FULL, 16, 192, 128, q_heads=16),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_every_fused_candidate_matches_plain_in_bf16(name):
    layer, names = LAYERS[name], cuda_candidates()
    assert names, "this torch offers no fused varlen attention on CUDA"
    taken = 0
    for candidate in names:
        backend = BACKENDS[candidate]()
        why = backend.supports(layer)
        for block_size in self_check_block_sizes(candidate):
            error = why or attn_select.self_check(
                backend, torch.device("cuda"), torch.bfloat16, layer, block_size
            )
            print(f"{name}: {candidate} block_size={block_size}: {error or 'ok'}")
        taken += why is None
    chosen = attn_select.select_backend(torch.device("cuda"), torch.bfloat16, [layer], 16)
    print(f"{name}: chose {chosen.name}, {chosen.probe_report}")
    assert taken and chosen.name != "plain", "no fused backend passed its self-check"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_bf16_greedy_follows_hf_generate(arch, model_dirs, mixed_prompts):
    prompts = mixed_prompts(seed=31, count=12, low=1, high=300)
    firsts, margins, problems, backend = bf16_greedy_against_hf(model_dirs[arch], prompts, "cuda")
    print(
        f"{arch} bf16 first divergence per prompt: {firsts}, reference margins {margins}, backend {backend}"
    )
    assert not problems, (problems, firsts, margins)


def test_cuda_seeded_sampling_is_the_same_alone_and_in_a_crowd(model_dirs, mixed_prompts):
    prompts = mixed_prompts(seed=32, count=6, low=3, high=120)
    engine = Engine.from_pretrained(
        str(model_dirs["llama"]), device="cuda", dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS
    )
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=77, ignore_eos=True)
    alone = engine.generate([prompts[0]], seeded)[0].token_ids
    others = [
        SamplingParams(max_tokens=n, temperature=1.0, top_k=5, ignore_eos=True) for n in (3, 20, 7, 15, 9)
    ]
    crowd = engine.generate(prompts, [seeded, *others])
    assert crowd[0].token_ids == alone
    pair = engine.generate(
        [prompts[0]], SamplingParams(max_tokens=12, temperature=0.8, seed=5, n=2, ignore_eos=True)
    )[0]
    six = engine.generate(
        [prompts[0]], SamplingParams(max_tokens=12, temperature=0.8, seed=6, ignore_eos=True)
    )[0]
    assert pair.outputs[1].token_ids != six.outputs[0].token_ids


def test_cuda_defaults_fill_the_gpu(model_dirs):
    engine = Engine.from_pretrained(str(model_dirs["llama"]), device="cuda")
    free = torch.cuda.mem_get_info()[0]
    assert engine.config.max_num_seqs >= 128 and engine.config.max_num_batched_tokens >= 4096
    assert engine.runner.num_blocks * engine.config.block_size > 10_000 or free < 8 << 30


def test_cuda_graph_decode_gives_the_eager_tokens_in_fp32(model_dirs, mixed_prompts):
    """More prompts than slots: the decode batch crosses graph buckets upwards (admissions) and
    downwards (finishes), and each replay must read this step's metadata, not a stale one."""
    prompts = mixed_prompts(seed=33, count=10, low=1, high=60)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in range(4, 24, 2)]
    kw = dict(device="cuda", dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS, block_size=16, max_num_seqs=8)
    graphs = Engine.from_pretrained(str(model_dirs["llama"]), cuda_graphs=True, **kw)
    eager = Engine.from_pretrained(str(model_dirs["llama"]), cuda_graphs=False, **kw)
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert any(b.graph is not None for b in graphs.runner.graphs.buckets.values())
    assert got == [o.token_ids for o in eager.generate(prompts, params)]


def test_capture_called_as_the_bench_calls_it_records_no_autograd(model_dirs):
    engine = Engine.from_pretrained(
        str(model_dirs["llama"]), device="cuda", dtype=torch.bfloat16, num_kv_blocks=NUM_KV_BLOCKS
    )
    for p in engine.model.parameters():
        p.requires_grad_(True)  # as a freshly built model's (bench/gpu.py)
    before = torch.cuda.memory_allocated()
    assert engine.runner.graphs.capture(256) > 0  # no inference_mode around it, as in the bench
    buckets = engine.runner.graphs.buckets.values()
    assert all(b.graph is not None and not b.out.requires_grad for b in buckets)
    assert not engine.runner.k_caches[0].requires_grad
    grown = torch.cuda.memory_allocated() - before
    print(f"{len(buckets)} buckets captured; allocated +{grown / 2**20:.0f} MiB")
    assert grown < 2 << 30


@pytest.mark.parametrize("overlap", [True, False])
def test_a_greedy_decode_step_syncs_the_host_once(model_dirs, mixed_prompts, overlap):
    """Step by step, the tokens' copy is the one sync; overlapped, the host waits on an event behind the
    previous step's copy, which sync debug mode does not flag (printed: the counts of both)."""
    import warnings

    engine = Engine.from_pretrained(
        str(model_dirs["llama"]),
        device="cuda",
        dtype=torch.bfloat16,
        num_kv_blocks=NUM_KV_BLOCKS,
        async_scheduling=overlap,
    )
    for i, prompt in enumerate(mixed_prompts(seed=34, count=16, low=4, high=40)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(4):  # prefill, and the first decode buckets captured
        engine.step()
    counts = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(8):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(
        f"host syncs per greedy decode step (overlap {overlap}): {counts}; backend {engine.runner.backend.name}"
    )
    assert max(counts) <= 1, counts


def test_cuda_overlapped_steps_give_the_step_by_step_tokens(model_dirs, mixed_prompts):
    """On the GPU with graphs and the paged kernel (fp32: bf16 rows may round differently in the other
    run's batch shapes): greedy with early stops, and seeded top-p sampling with logprobs."""
    prompts = mixed_prompts(seed=35, count=24, low=2, high=80)
    params = [
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=list(range(0, 256, 9)))
        if i % 2
        else SamplingParams(max_tokens=24, temperature=0.9, top_p=0.7, seed=i, logprobs=2)
        for i in range(len(prompts))
    ]
    kw = dict(device="cuda", dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=32)
    runs = {}
    for overlap in (False, True):
        engine = Engine.from_pretrained(str(model_dirs["llama"]), async_scheduling=overlap, **kw)
        runs[overlap] = [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params)]
        assert engine.overlap is overlap
    assert runs[True] == runs[False]


PER_LAYER_ARCHS = ["mistral-window", "gemma2", "gemma3", "gpt_oss", "llama4", "deepseek_v3"]


@pytest.mark.parametrize("arch", PER_LAYER_ARCHS)
def test_cuda_windows_chunks_softcap_sinks_and_mla_follow_transformers(arch, tmp_path, mixed_prompts):
    """The tiny models of test_architectures.py (32-token windows and chunks) on the GPU: fp32 (the plain
    prefill and the compiled triton decode kernel with its window, soft-cap and sinks) token for token
    against transformers on CPU; bf16 (the fused prefill kernels with windows, chunk pieces, sinks from
    the log-sum-exp and padded V; Gemma 2's soft-cap on plain prefills) judged by first divergence."""
    from transformers import AutoModelForCausalLM

    from bulkgen.lab.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / arch, arch, seed=3)
    prompts = mixed_prompts(seed=34, count=6, low=1, high=300)
    engine = Engine.from_pretrained(
        str(path),
        device="cuda",
        dtype=torch.float32,
        max_num_batched_tokens=64,
        block_size=8,
        num_kv_blocks=NUM_KV_BLOCKS,
    )
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
        assert out.token_ids == want.tolist(), (arch, len(prompt), engine.runner.backend.probe_report)
    firsts, margins, problems, backend = bf16_greedy_against_hf(path, prompts, "cuda")
    print(f"{arch} bf16 first divergence per prompt: {firsts}, margins {margins}, backend {backend}")
    assert not problems, (problems, firsts, margins)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_cuda_hybrid_model_with_graphs_matches_cpu_generate(arch, tmp_path, mixed_prompts, caplog):
    """A hybrid model (Gated DeltaNet layers in state slots; Qwen3.5 dense, Qwen3-Next with MoE) on CUDA in
    fp32, with the defaults there (decode graphs captured, overlapped steps) and whatever linear-attention
    kernels transformers picks on this machine: greedy tokens equal transformers' CPU `generate`.
    Qwen3-Next's experts go through torch's grouped_mm, which has no fp32 CUDA kernel: its fallback reads
    the group offsets on the host, which a graph cannot capture (seen on the H200, torch 2.11), so there
    the engine logs that cause and decodes eagerly; in bf16 grouped_mm is a CUDA kernel."""
    from transformers import AutoModelForCausalLM

    from bulkgen.lab.tiny_hybrid import build_tiny_hybrid

    path = build_tiny_hybrid(tmp_path / arch, arch, seed=1)
    prompts = mixed_prompts(seed=31, count=6, low=5, high=300)
    engine = Engine.from_pretrained(
        str(path), device="cuda", dtype=torch.float32, max_num_batched_tokens=64, num_kv_blocks=NUM_KV_BLOCKS
    )
    with caplog.at_level(logging.ERROR, logger="bulkgen.engine.decode_graphs"):
        outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert out.token_ids == want[0, len(prompt) :].tolist()
    captured = any(b.graph is not None for b in engine.runner.graphs.buckets.values())
    failures = [r.getMessage() for r in caplog.records]
    if arch == "qwen3_5":
        assert captured and not failures, failures
    else:
        assert captured or (len(failures) == 1 and "grouped_mm" in failures[0]), failures
