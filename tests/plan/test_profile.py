"""The throughput profile and the step-cost model, part by part, without a clock: where the profile is
measured (a worker's process state), what the fit recovers, and the context the simulator counts
against what the engine's decode attention reads. How close the seconds come is bench/bench_plan.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from bulkgen.models.registry import DEFAULT_MODEL_NAME, default_model_path
from bulkgen.plan import profile as profiles
from bulkgen.plan.timed import EngineLimits, attended, batch_seconds

ROOT = Path(__file__).resolve().parents[2]


def test_the_profile_is_measured_in_a_fresh_process_not_the_callers():
    """Torch work the caller did before (a model on its main thread) changes how fast steps run (a second
    OpenMP team stops libgomp spinning): the caller must not be where the grid runs."""
    code = (
        "import json, sys\n"
        "from bulkgen.plan import profile\n"
        f"p = profile.measure({DEFAULT_MODEL_NAME!r}, {default_model_path()!r}, startup=False)\n"
        "print(json.dumps({'torch_here': 'torch' in sys.modules, 'base_s': p.base_s, 'load_s': p.model_load_s,"
        " 'padded': p.decode_padded}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["torch_here"] is False  # the model was loaded and stepped elsewhere
    assert result["base_s"] > 0 and result["load_s"] > 0
    assert result["padded"] is True  # the CPU decode path pads to the longest sequence


def test_one_thread_loads_the_model_and_runs_every_step(monkeypatch):
    """As the worker's engine thread does (bulkgen.runtime.engine_loop._on_engine_thread)."""
    from bulkgen.engine import Engine

    threads: set[int] = set()
    load, step = Engine.from_pretrained.__func__, Engine.step

    def spy_load(cls, *args, **kwargs):
        threads.add(threading.get_ident())
        return load(cls, *args, **kwargs)

    def spy_step(self):
        threads.add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(spy_load))
    monkeypatch.setattr(Engine, "step", spy_step)
    monkeypatch.setattr(profiles, "BATCH_SIZES", (1, 16))  # the rule, not the figures: a smaller grid
    monkeypatch.setattr(profiles, "CHURN_ROUNDS", 1)
    profile = profiles.measure_here(DEFAULT_MODEL_NAME, default_model_path())
    assert profile.base_s > 0
    assert len(threads) == 1 and threading.get_ident() not in threads


def _cell_rows(batch: int, context: int, cost) -> list[tuple]:
    """A grid cell's step rows as `_run_cell` gives them, from a known cost: the prompts prefilled in
    chunks of 8 while the sequences already done decode beside them, then 8 pure decode steps."""
    rows, decoding, decoded = [], 0, 0
    for start in range(0, batch, 8):
        chunk = min(8, batch - start)
        decoded += bool(decoding)
        context_tokens = decoding * (context + decoded)
        seqs, prefill = decoding + chunk, chunk * context
        rows.append((seqs, prefill, context_tokens, cost(seqs, prefill, context_tokens, chunk), chunk))
        decoding += chunk
    for _ in range(8):
        decoded += 1
        context_tokens = batch * (context + decoded)
        rows.append((batch, 0, context_tokens, cost(batch, 0, context_tokens, 0), 0))
    return rows


def test_the_fit_recovers_the_step_costs_when_prompts_prefill_beside_decodes():
    """Steps that prefill while other sequences decode pay the decodes' context too; charged to the
    prompt tokens, it made prefill look dearer than it is (the fit said 20% over, here)."""
    truth = (4e-3, 1.2e-4, 7.5e-5, 1.0e-6, 2e-4)  # base, per_seq, per_prefill, per_context, per_new_seq

    def cost(seqs, prefill, context, new):
        base, per_seq, per_prefill, per_context, per_new = truth
        return base + per_seq * seqs + per_prefill * prefill + per_context * context + per_new * new

    cells = [(b, c, _cell_rows(b, c, cost)) for c in (32, 256) for b in (1, 16, 64)]
    churn = [(64, 256, 0, cost(64, 256, 0, 64), 64), (64, 0, 64 * 5, cost(64, 0, 64 * 5, 0), 0)] * 3
    fitted = profiles.fit_steps(cells, churn)
    assert np.allclose(fitted, truth, rtol=0.02), fitted


def test_the_simulator_counts_the_context_the_engines_decode_attention_reads(monkeypatch, tmp_path):
    """Short chat prompts decode ragged sequences; the CPU decode path pads each to the longest one's
    blocks. Summing each sequence's own context instead counted about half of what the engine reads."""
    import importlib.util

    from bulkgen.batch.prepare import fit_context, tokenize
    from bulkgen.batch.requests import CHAT, parse_line
    from bulkgen.engine import Engine, SamplingParams
    from bulkgen.engine.attention.attn_backends import DecodeMeta

    spec = importlib.util.spec_from_file_location("bench_plan", ROOT / "bench" / "bench_plan.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    engine = Engine.from_pretrained(default_model_path(), max_num_seqs=16, max_num_batched_tokens=512)
    read: list[int] = []
    bind = DecodeMeta.bind

    def spy_bind(self, flat):  # the padded gather reads table rows x columns x block_size context slots
        meta = bind(self, flat)
        read.append(meta.table.shape[0] * meta.table.shape[1] * engine.config.block_size)
        return meta

    monkeypatch.setattr(DecodeMeta, "bind", spy_bind)
    path = bench.short_chat(tmp_path / "chat.jsonl", 64, (8, 48))
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        request = parse_line(line, number, CHAT)
        ids = tokenize(request, engine.tokenizer)
        prompts.append(ids)
        params = fit_context(request, len(ids), engine.max_model_len)
        engine.add_request(f"r{number}", ids, SamplingParams(max_tokens=params["max_tokens"], seed=number))
    lengths = {}
    while engine.has_unfinished():
        lengths.update({o.request_id: len(o.token_ids) for o in engine.step()})  # finished ones only
    outputs = [lengths[f"r{i}"] for i in range(1, len(prompts) + 1)]
    limits = EngineLimits(16, 512, engine.config.block_size, profiles.decode_padded(engine))
    simulated = batch_seconds(
        [len(p) for p in prompts], outputs, lambda seqs, pf, context, new: context, limits
    )
    assert limits.decode_padded
    assert abs(simulated - sum(read)) <= 0.1 * sum(read), (simulated, sum(read))


def test_attended_context_is_whole_blocks_and_padded_to_the_longest_where_the_engine_pads():
    assert attended([5, 17, 40], 16) == 16 + 32 + 48
    assert attended([5, 17, 40], 16, padded=True) == 3 * 48
    assert attended([], 16, padded=True) == 0
