"""First-run probe of the engine's CUDA path: the facts a short GPU lease must bring back.

Answers in about 2 minutes on an H200, writing `gpu-probe.json` under --out after every phase (a crash
keeps what was measured): the torch/transformers/cuDNN versions; which SDPA backend the padded decode
attention gets at the anchor's biggest decode bucket (B 512, 96 blocks of 16, 32 query / 8 KV heads,
head dim 64), the padded and triton decode kernels' times per layer there, against aten's flash varlen
kernel reading the same real KV once, called with 8 KV heads for 32 query heads (GQA without repeat_interleave); the attention backend the
engine chooses and why; the decode graphs captured at engine start (count, seconds, memory beyond the
KV cache with parameters that require grad: autograd kept alive would show there); host
syncs per greedy and sampled decode step; and engine ms per decode step on a 2-layer model of the
anchor's width at several batch sizes, with overlapped steps and (at B 512) step by step. On a machine
without CUDA it records that and stops.

    PYTHONPATH=. python3 bench/gpu_probe.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]


class Report(dict):
    """The probe's findings, rewritten to disk after every phase."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.path = out / "gpu-probe.json"
        out.mkdir(parents=True, exist_ok=True)

    def phase(self, name: str, fn) -> None:
        started = time.perf_counter()
        try:
            self[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one failed phase must not cost the others
            self[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        self[name + "_s"] = round(time.perf_counter() - started, 2)
        self.path.write_text(json.dumps(self, indent=1, default=str) + "\n")
        print(f"{name}: {json.dumps(self[name], default=str)[:400]}", flush=True)


def cuda_ms(fn, repeat: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / repeat, 4)


def versions() -> dict:
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(),
        "cudnn": torch.backends.cudnn.version(),
        "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
    }


def decode_attention() -> dict:
    from torch.nn.attention import sdpa_kernel

    from bulkgen.engine.attention.interface import SDPA_ORDER

    with sdpa_kernel(SDPA_ORDER, set_priority=True):  # the kernel order the engine's forwards run under
        return _decode_attention()


def _decode_attention() -> dict:
    from bulkgen.engine.attention.attn_backends import DecodeMeta, sdpa_choice

    b, w, bs, hkv, group, d = 512, 96, 16, 8, 4, 64
    kc = torch.randn(b * w + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.arange(b * w, device="cuda").view(b, w)
    lengths = torch.randint(64, w * bs, (b,), device="cuda")
    q = torch.randn(b, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    k = kc[table].view(b, -1, hkv, d).transpose(1, 2)
    mask = (torch.arange(w * bs, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    out = {  # under the engine's pinned kernel order, as its padded decode runs
        "sdpa_choice": sdpa_choice(q.view(b, hkv, group, d), k, k, attn_mask=mask, scale=d**-0.5)
    }
    for name, call in decode_kernels(q, kc, vc, DecodeMeta(0, b, table, lengths), d**-0.5).items():
        out[name] = cuda_ms(call)
    real = int(lengths.sum())
    cu_k = torch.zeros(b + 1, dtype=torch.int32, device="cuda")
    cu_k[1:] = lengths.cumsum(0)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    kv = torch.randn(real, hkv, d, device="cuda", dtype=torch.bfloat16)
    out["flash_varlen_gqa_ms_per_layer"] = cuda_ms(
        lambda: torch.ops.aten._flash_attention_forward(
            q, kv, kv, cu_q, cu_k, 1, w * bs, 0.0, False, False, scale=d**-0.5
        )[0]
    )
    out["real_kv_gb_per_layer"] = round(real * hkv * d * 2 * 2 / 1e9, 3)
    return out


def decode_kernels(q, k_cache, v_cache, meta, scale: float) -> dict:
    """Each decode kernel the engine can run, under the name its time is reported as; each is named
    explicitly (on CUDA the default is triton, so an unnamed call would time triton as "padded")."""
    from bulkgen.engine.attention import triton_decode
    from bulkgen.engine.attention.attn_backends import paged_decode

    kernels = {"padded_decode_ms_per_layer": "padded"}
    if triton_decode.available():
        kernels["triton_decode_ms_per_layer"] = "triton"
    return {
        name: (lambda kernel=kernel: paged_decode(q, k_cache, v_cache, meta, scale, kernel))
        for name, kernel in kernels.items()
    }


def small_anchor_model():
    import gpu as bench

    spec = dict(bench.ANCHOR, model=dict(bench.ANCHOR["model"], num_hidden_layers=2))
    return bench.build_model(spec, "cuda", 0)


def small_anchor_engine(**kwargs):
    from bulkgen.engine import Engine

    return Engine(*small_anchor_model(), num_kv_blocks=16384, **kwargs)


def capture_check() -> dict:
    """The engine captures its decode graphs at start (one per batch bucket with the paged kernel):
    time that, and the memory it grew by beyond the KV cache, with parameters that require grad."""
    from bulkgen.engine import Engine

    model, tokenizer = small_anchor_model()
    for p in model.parameters():
        p.requires_grad_(True)
    before = torch.cuda.memory_allocated()
    started = time.perf_counter()
    engine = Engine(model, tokenizer, num_kv_blocks=16384, max_num_seqs=64)
    setup_s = time.perf_counter() - started
    runner = engine.runner
    cache = sum(t.nbytes for t in (*runner.k_caches, *runner.v_caches))  # a tensor or a kv_cache.Fp8Cache
    grew = torch.cuda.memory_allocated() - before - cache
    graphs = runner.graphs
    return {
        "buckets_at_start": len(graphs.buckets),
        "captured": sum(b.graph is not None for b in graphs.buckets.values()),
        "buckets_after_capture_512": graphs.capture(512),  # the paged kernel: nothing new to capture
        "engine_setup_s": round(setup_s, 2),
        "grew_beyond_kv_gb": round(grew / 1e9, 3),
        "kv_cache_requires_grad": runner.k_caches[0].requires_grad,
        "attention_backend": runner.backend.name,
        "decode_kernel_paged": graphs.paged,
        "attention_probe": getattr(runner.backend, "probe_report", None),
    }


def syncs_and_step_times() -> dict:
    from bulkgen.engine import SamplingParams

    engine = small_anchor_engine(max_num_seqs=512)
    kinds = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_p=0.95, seed=1)}
    out = {}
    runs = [(batch, True) for batch in (64, 256, 512)] + [(512, False)]  # overlapped, then step by step
    for name, sampling in kinds.items():
        for batch, overlap in runs:
            engine.overlap = overlap
            engine.reset()
            for i in range(batch):
                engine.add_request(
                    f"{name}{i}",
                    [5 + i % 100] * (100 + i % 400),
                    SamplingParams(max_tokens=24, ignore_eos=True, **sampling),
                )
            while engine.scheduler.num_waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
                engine.step()  # through the prefill
            engine.step()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(10):
                engine.step()
            torch.cuda.synchronize()
            key = f"{name}_decode_ms_per_step_b{batch}{'' if overlap else '_step_by_step'}"
            out[key] = round((time.perf_counter() - started) * 100, 3)
        engine.overlap = True
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out[f"{name}_syncs_per_decode_step"] = sum("synchroniz" in str(w.message) for w in caught)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    report = Report(Path(parser.parse_args(argv).out))
    report.phase("cuda_available", torch.cuda.is_available)
    if report["cuda_available"]:
        for name, fn in (
            ("versions", versions),
            ("decode_attention", decode_attention),
            ("capture", capture_check),
            ("decode_steps", syncs_and_step_times),
        ):
            report.phase(name, fn)
            torch.cuda.empty_cache()
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
