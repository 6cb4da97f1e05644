"""Host time per engine step on the anchor workload of bench/gpu.py, with the model's forward stubbed.

On a GPU the forward of a decode step at B = 512 takes a few ms; whatever the host does around it
(scheduling, block tables, staging the step's integers, sampling bookkeeping, stop checks, stats) is
time the GPU idles unless it is shorter. This runs the real Engine (scheduler, block manager, the
attention backend's metadata, DecodeGraphs staging with `cuda_graphs=True`, the sampler, stop checks)
over the anchor's 512 requests (prompts 16-1,024 tokens, outputs 8-256, Llama-3.2-1B's vocabulary for
the ids) while every model call returns zero logits of width 8 (a [B, 8] sampler pass: nothing of the
device's work is left but what the host must do anyway). It reports host ms per decode-only step at
B >= 480 (median, p90) and the whole run's host seconds, greedy and sampled.

The baseline measured in the same run is the step's own floor: one `torch.tensor` of the B x (4 + W)
ints a decode step must send (what any per-step rebuild pays); the ratio says how many such floors
the engine's host work costs.

Overlapped steps (`--device-ms D`): the same runs against a modelled device, a serial queue on which
every forward takes D ms from when the runner has staged it or when the previous one ends, whichever is later;
reading a step's tokens waits (sleeps) until that step's forward has ended. Step by step, a decode step
then costs the host's work plus D; overlapped (EngineConfig.async_scheduling), the host's work hides
behind the device's. Reported: wall ms per steady decode step both ways, and the device's idle ms per
step (wall minus D), in the same run. A model of a GPU, not one: the H200 run measures the real thing.

Garbage collection (`--gc`): the continuous run twice, the heap as built and then frozen once the engine
is built, as a worker freezes it after loading (bulkgen/engine/heap.py): CPython's full collections walk
every object the loaded engine holds, inside whichever step they fall in.

    OMP_NUM_THREADS=1 python bench/bench_host.py [--quick] [--json] [--device-ms 3] [--gc]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from bench_engine import make_workload  # noqa: E402

LOGIT_WIDTH = 8
SLOTS = 512  # max_num_seqs, as on an H200
ANCHOR = {"requests": 512, "prompt": (16, 1024), "output": (8, 256), "vocab": 128256, "kv_blocks": 45000}
QUICK = {"requests": 160, "prompt": (16, 256), "output": (8, 64), "vocab": 128256, "kv_blocks": 6000}
# three times the slots' worth of requests: slots refill as sequences finish, so most full steps mix
# admitted prompts' prefill chunks with the decodes (a bulk job's steady state)
CONTINUOUS = {**ANCHOR, "requests": 1536, "kv_blocks": 60000}
STEADY = (
    0.94  # decode steps with at least this share of the requests in the batch: the steady state (480 of 512)
)


def stub_engine(spec: dict, overlap: bool = False):
    """The real engine over a 1-layer Llama whose forwards return zero logits (the device's work gone)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bulkgen.engine import Engine, EngineConfig
    from bulkgen.lab.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=spec["vocab"],
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    config = EngineConfig(
        max_num_seqs=SLOTS,
        max_num_batched_tokens=16384,
        num_kv_blocks=spec["kv_blocks"],
        cuda_graphs=True,
        async_scheduling=overlap,
    )
    engine = Engine(model, tokenizer, config)

    class Out:
        def __init__(self, rows: int) -> None:
            self.logits = torch.zeros(1, rows, LOGIT_WIDTH)

    def forward(input_ids=None, logits_to_keep=None, **_):
        return Out(input_ids.shape[1] if logits_to_keep is None else len(logits_to_keep))

    model.forward = forward
    model.model.forward = lambda **_: None
    engine.runner.graphs._forward = lambda b: torch.zeros(b.batch, LOGIT_WIDTH)
    return engine


class ModelledDevice:
    """A serial queue whose every forward takes `ms` (see the module docstring): ModelRunner.run enqueues,
    SampledTokens.result waits for the forward its tokens came from."""

    def __init__(self, engine, ms: float) -> None:
        from bulkgen.engine import engine as engine_module

        self.seconds, self.free_at, self.last_end = ms / 1e3, 0.0, 0.0
        run, sample_async = engine.runner.run, engine_module.sample_async

        def launch(*args, **kwargs):
            out = run(*args, **kwargs)  # the forward is queued once the runner has staged the step
            self.free_at = self.last_end = max(self.free_at, time.perf_counter()) + self.seconds
            return out

        def sample(*args, **kwargs):
            sampled = sample_async(*args, **kwargs)
            end, result = self.last_end, sampled.result

            def wait():
                delay = end - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                return result()

            sampled.result = wait
            return sampled

        engine.runner.run = launch
        self._restore = (engine_module, sample_async)
        engine_module.sample_async = sample

    def close(self) -> None:
        module, sample_async = self._restore
        module.sample_async = sample_async


class GcPauses:
    """Every collection CPython runs while attached (gc.callbacks): how many, how long, the longest full one."""

    def __init__(self) -> None:
        self.started: tuple[float, int] | None = None
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = (time.perf_counter(), info["generation"])
        elif self.started is not None:
            self.pauses.append((self.started[1], time.perf_counter() - self.started[0]))

    def close(self) -> dict:
        gc.callbacks.remove(self._note)
        full = [s for generation, s in self.pauses if generation == 2]
        return {
            "gc_collections": len(self.pauses),
            "gc_full_collections": len(full),
            "gc_pause_ms_total": round(1e3 * sum(s for _, s in self.pauses), 1),
            "gc_full_max_ms": round(1e3 * max(full, default=0.0), 1),
        }


def run(
    spec: dict, sampled: bool, overlap: bool = False, device_ms: float | None = None, frozen: bool = False
) -> dict:
    """`frozen`: the heap frozen once the engine is built, as a worker does after loading (engine/heap.py)."""
    from bulkgen.engine import SamplingParams, heap

    heap.thaw()  # a previous frozen run's engine must be collectable
    gc.collect()  # the previous run's engine: its garbage would be swept during this run's steps
    engine = stub_engine(spec, overlap)
    if frozen:
        heap.freeze_loaded()
    device = ModelledDevice(engine, device_ms) if device_ms else None
    work = make_workload(spec["requests"], spec["prompt"], spec["output"], spec["vocab"], 0)
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lengths, strict=True)):
        params = (
            SamplingParams(max_tokens=n, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
            if sampled
            else SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        )
        engine.add_request(str(i), prompt, params)
    kinds: list[tuple[bool, int]] = []
    prefill_tokens: list[int] = []
    run_plan = engine.runner._plan

    def plan(batch):
        ordered, step_plan = run_plan(batch)
        kinds.append((step_plan.num_prefill == 0, len(ordered)))
        prefill_tokens.append(step_plan.num_prefill_tokens)
        return ordered, step_plan

    engine.runner._plan = plan
    times: list[float] = []
    pack, uploads = engine.runner.graphs.pack, {}
    upload = pack.upload

    def counted_upload():
        uploads[len(times)] = len(pack.values)  # keyed by the step it belongs to
        return upload()

    pack.upload = counted_upload
    packed, packed_uploads = engine.runner.pack, {}  # the packed path's (prefill and mixed steps)
    packed_upload = packed.upload

    def counted_packed_upload():
        packed_uploads[len(times)] = len(packed.values)
        return packed_upload()

    packed.upload = counted_packed_upload
    tokens, started, pauses = 0, time.perf_counter(), GcPauses()
    try:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            for out in engine.step():
                tokens += len(out.outputs[0].token_ids)
            times.append(time.perf_counter() - t0)
    finally:
        if device is not None:
            device.close()
        collected = pauses.close()
    total = time.perf_counter() - started
    if tokens != work.useful_tokens:
        raise AssertionError(f"generated {tokens} tokens, the workload asks for {work.useful_tokens}")
    full = int(STEADY * min(spec["requests"], SLOTS))
    steady_at = [i for i, (decode, size) in enumerate(kinds) if decode and size >= full]
    steady = [times[i] for i in steady_at]
    steady_ms = sorted(1e3 * t for t in steady)
    mixed_at = [i for i, (decode, size) in enumerate(kinds) if not decode and size >= full]
    mixed_ms = sorted(1e3 * times[i] for i in mixed_at)
    # beyond each prefill token's id, position and slot: what the decode rows and the metadata cost
    beyond = [packed_uploads.get(i, 0) - 3 * prefill_tokens[i] for i in mixed_at]
    return {
        "sampled": sampled,
        "overlap": overlap,
        "device_ms": device_ms,
        "steps": len(times),
        "decode_steps": sum(decode for decode, _ in kinds),
        "steady_batch": full,
        "steady_steps": len(steady_ms),
        "host_ms_per_decode_step_median": round(statistics.median(steady_ms), 3) if steady_ms else None,
        "host_ms_per_decode_step_p90": round(steady_ms[int(0.9 * (len(steady_ms) - 1))], 3)
        if steady_ms
        else None,
        "host_s_total": round(total, 3),
        "mixed_steps": len(mixed_ms),  # prefill chunks beside the decodes, at B >= steady_batch
        "host_ms_per_mixed_step_median": round(statistics.median(mixed_ms), 3) if mixed_ms else None,
        "mixed_upload_ints_beyond_prefill_median": statistics.median(beyond) if beyond else None,
        # ints a steady decode step sends to the device: 4 per row plus the table entries it appended
        "steady_upload_ints_median": statistics.median([uploads.get(i, 0) for i in steady_at] or [0]),
        "steady_upload_ints_max": max((uploads.get(i, 0) for i in steady_at), default=0),
        "decode_buckets": len(engine.runner.graphs.buckets),
        "output_tokens": tokens,
        "discarded_tokens": engine.stats()["discarded_tokens"],
        "frozen": frozen,
        "max_step_ms": round(1e3 * max(times), 1),
        **collected,
    }


def floor_ms(batch: int = 512, width: int = 64, repeats: int = 50) -> float:
    """The baseline: building one decode step's B x (4 + W) int64 tensor from a Python list."""
    values = list(range(batch * (4 + width)))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.tensor(values, dtype=torch.int64)
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="160 requests, shorter prompts and outputs")
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    parser.add_argument(
        "--device-ms",
        type=float,
        default=3.0,
        help="modelled device ms per forward for the overlap comparison (0: skip it)",
    )
    parser.add_argument(
        "--gc",
        action="store_true",
        help="only the garbage-collection comparison: the continuous run with the heap as loaded, then frozen",
    )
    args = parser.parse_args(argv)
    if args.gc:
        return gc_report(args.json)
    torch.set_num_threads(1)
    spec = QUICK if args.quick else ANCHOR
    report = {"spec": spec, "baseline_floor_ms": round(floor_ms(), 3)}
    report["greedy"] = run(spec, sampled=False)
    report["sampled"] = run(spec, sampled=True)
    for mode in ("greedy", "sampled"):
        median = report[mode]["host_ms_per_decode_step_median"]
        report[mode]["ratio_to_floor"] = round(median / report["baseline_floor_ms"], 2) if median else None
    if not args.quick:
        report["continuous"] = run(CONTINUOUS, sampled=False)
    if args.device_ms:
        report["device"] = {}
        for mode, sampled in (("greedy", False), ("sampled", True)):
            pair = {
                name: run(spec, sampled, overlap, args.device_ms)
                for name, overlap in (("step_by_step", False), ("overlapped", True))
            }
            for r in pair.values():  # with a modelled device a step's time is wall time, sleeps included
                r["wall_ms_per_decode_step_median"] = r.pop("host_ms_per_decode_step_median")
                r["device_idle_ms_per_step"] = round(r["wall_ms_per_decode_step_median"] - args.device_ms, 3)
            base, over = (pair[k]["wall_ms_per_decode_step_median"] for k in ("step_by_step", "overlapped"))
            pair["wall_ratio"] = round(over / base, 3)
            report["device"][mode] = pair
    if args.json:
        print(json.dumps(report))
        return report
    print(f"baseline (one B=512 step's ints into a tensor): {report['baseline_floor_ms']:.2f} ms")
    for mode in ("greedy", "sampled"):
        r = report[mode]
        print(
            f"{mode:8s} steps {r['steps']:4d} (decode {r['decode_steps']}, at B>={r['steady_batch']}: {r['steady_steps']}); "
            f"host ms per decode step median {r['host_ms_per_decode_step_median']} "
            f"p90 {r['host_ms_per_decode_step_p90']} ({r['ratio_to_floor']}x the floor); "
            f"whole run {r['host_s_total']} s"
        )
    if "continuous" in report:
        r = report["continuous"]
        print(
            f"continuous ({CONTINUOUS['requests']} requests through 512 slots, greedy): {r['steps']} steps; "
            f"at B>={r['steady_batch']}: {r['mixed_steps']} mixed (prefill + decodes), host ms median "
            f"{r['host_ms_per_mixed_step_median']} (ints sent beyond 3 per prefill token: median "
            f"{r['mixed_upload_ints_beyond_prefill_median']}); {r['steady_steps']} decode-only, host ms median "
            f"{r['host_ms_per_decode_step_median']}"
        )
    for mode, pair in report.get("device", {}).items():
        base, over = pair["step_by_step"], pair["overlapped"]
        print(
            f"{mode:8s} modelled device {args.device_ms} ms/forward: wall ms per steady decode step "
            f"step-by-step {base['wall_ms_per_decode_step_median']} (device idle {base['device_idle_ms_per_step']}), "
            f"overlapped {over['wall_ms_per_decode_step_median']} (device idle {over['device_idle_ms_per_step']}); "
            f"overlapped / step-by-step {pair['wall_ratio']}x; whole run {base['host_s_total']} s -> "
            f"{over['host_s_total']} s; discarded tokens {over['discarded_tokens']}"
        )
    return report


def gc_report(as_json: bool) -> dict:
    """The continuous workload twice, greedy: the heap as built, then frozen as a worker freezes it."""
    torch.set_num_threads(1)
    report = {
        name: run(CONTINUOUS, sampled=False, frozen=frozen)
        for name, frozen in (("as_built", False), ("frozen", True))
    }
    base, frozen = report["as_built"], report["frozen"]
    report["max_step_ratio"] = round(frozen["max_step_ms"] / base["max_step_ms"], 3)
    if as_json:
        print(json.dumps(report))
        return report
    for name in ("as_built", "frozen"):
        r = report[name]
        print(
            f"{name:8s} {r['steps']} steps, whole run {r['host_s_total']} s; collections {r['gc_collections']} "
            f"({r['gc_full_collections']} full, longest {r['gc_full_max_ms']} ms), all pauses "
            f"{r['gc_pause_ms_total']} ms; longest step {r['max_step_ms']} ms"
        )
    print(f"longest step frozen / as built: {report['max_step_ratio']}x")
    return report


if __name__ == "__main__":
    main()
