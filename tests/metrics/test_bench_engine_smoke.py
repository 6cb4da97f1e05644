"""Smoke run of bench/bench_engine.py --quick: all three methods on the same tiny workload."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_engine.py"


def load_bench():
    if "bench_engine" in sys.modules:
        return sys.modules["bench_engine"]
    spec = importlib.util.spec_from_file_location("bench_engine", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_engine"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def test_workload_is_seeded_and_in_range():
    bench = load_bench()
    a = bench.make_workload(20, (8, 256), (4, 64), 8192, seed=3)
    assert a == bench.make_workload(20, (8, 256), (4, 64), 8192, seed=3)
    assert all(8 <= len(p) <= 256 for p in a.prompts) and all(4 <= n <= 64 for n in a.output_lengths)
    assert not {t for p in a.prompts for t in p} & set(range(256, 261))


@pytest.mark.slow
def test_quick_run_reports_every_method(capsys):
    bench = load_bench()
    report = bench.main(["--quick", "--json", "--requests", "6", "--static-batch", "4"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    work = bench.make_workload(
        6, bench.QUICK["prompt"], bench.QUICK["output"], bench.QUICK["model"]["vocab_size"], 0
    )
    rows = {row["method"]: row for row in report["results"]}
    assert set(rows) == {"hf_static", "hf_generate_batch", "bulkgen"}
    assert "error" not in rows["bulkgen"], rows["bulkgen"]
    for row in rows.values():
        assert row["output_tokens"] == work.useful_tokens and row["output_tokens_per_s"] > 0
    # Static: groups of 4 then 2, each held for its longest output.
    lengths = work.output_lengths
    slot_steps = 4 * max(lengths[:4]) + 2 * max(lengths[4:])
    assert rows["hf_static"]["slot_efficiency"] == pytest.approx(work.useful_tokens / slot_steps, abs=1e-4)
    assert rows["bulkgen"]["slot_efficiency"] == pytest.approx(1.0)
    assert rows["hf_static"]["vs_hf_static"] == 1.0
    assert rows["bulkgen"]["vs_hf_static"] == pytest.approx(
        rows["bulkgen"]["output_tokens_per_s"] / rows["hf_static"]["output_tokens_per_s"], rel=1e-2
    )
