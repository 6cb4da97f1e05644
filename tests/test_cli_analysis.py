"""`bulkgen simulate`, `latency` and `bench` driven through click's CliRunner."""

import json

import pytest
from click.testing import CliRunner

from bulkgen.cli import cli
from bulkgen.lab.tiny import build_tiny_model

SEED = ["--max-batch", "4", "--lengths", "8,4,3,10,2,5,7,1"]


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_simulate_json_all_policies_by_default():
    result = run("simulate", *SEED, "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["policy"] for r in rows] == ["static", "dynamic", "continuous"]
    static, _, continuous = rows
    assert (static["makespan"], static["slot_steps"], static["useful_tokens"]) == (17, 68, 40)
    assert (continuous["makespan"], continuous["slot_steps"]) == (12, 40)
    assert static["finish_steps"]["r7"] == 17 and continuous["finish_steps"]["r7"] == 9


def test_simulate_single_policy_with_prefill():
    result = run(
        "simulate", "--policy", "static", *SEED, "--prompt-lengths", "12,200,30,45,5,6,7,8", "--json"
    )
    assert result.exit_code == 0, result.output
    (row,) = [json.loads(line) for line in result.output.splitlines()]
    assert (row["prefill_slots"], row["prefill_useful"]) == (832, 313)
    assert row["prefill_waste_pct"] == pytest.approx(62.38)


def test_simulate_table_and_timeline():
    result = run("simulate", "--policy", "static,continuous", *SEED)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["static", "continuous"]
    assert any(line.split() == ["makespan", "(steps)", "17", "12"] for line in lines)
    # static slot 2: r2 for 3 steps, padding until 10, then r6 for 7 steps.
    assert "slot 2|222.......6666666|" in lines
    # continuous slot 2: r2, r4, r6 back to back.
    assert "slot 2|222446666666|" in lines
    assert "finish steps: r0=8 r1=4 r2=3 r3=10 r4=5 r5=9 r6=12 r7=9" in lines


def test_simulate_plot(tmp_path):
    target = tmp_path / "slots.png"
    result = run("simulate", *SEED, "--arrivals", "0,0,1,1,2,6,9,9", "--plot", str(target))
    assert result.exit_code == 0, result.output
    assert target.read_bytes().startswith(b"\x89PNG")
    assert f"plot written to {target}" in result.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--max-batch", "0", "--lengths", "1,2"], "Invalid value for --max-batch: must be an integer >= 1"),
        (["--max-batch", "2", "--lengths", "3,-1"], "Invalid value for --lengths: r1 is -1"),
        (["--max-batch", "2", "--lengths", "3,x"], "Invalid value for --lengths: expected comma-separated"),
        (["--max-batch", "2", "--lengths", "3,1", "--arrivals", "0"], "--arrivals: got 1 values for 2"),
        (
            ["--max-batch", "2", "--lengths", "3,1", "--arrivals", "2,1"],
            "--arrivals: must be in request order",
        ),
        (["--max-batch", "2", "--lengths", "3,1", "--max-wait", "-1"], "--max-wait: must be an integer >= 0"),
        (["--max-batch", "2", "--lengths", "3,1", "--policy", "greedy"], "unknown policy 'greedy'"),
        (["--max-batch", "2", "--lengths", ""], "--lengths: need at least one request"),
    ],
)
def test_simulate_bad_input(args, words):
    result = run("simulate", *args)
    assert result.exit_code == 2
    assert words in result.output
    assert "Traceback" not in result.output


def test_latency():
    result = run("latency", "--ttft-ms", "200", "--tpot-ms", "20", "--output-tokens", "101", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["end_to_end_ms"] == 2200
    text = run("latency", "--ttft-ms", "200", "--tpot-ms", "20", "--output-tokens", "101").output
    assert "2200.00 ms" in text and "20 ms × 100 tokens" in text


def test_latency_bad_input():
    result = run("latency", "--ttft-ms", "200", "--tpot-ms", "20", "--output-tokens", "0")
    assert result.exit_code == 2 and "output_tokens must be an integer >= 1" in result.output


def test_bench_on_real_engine(tmp_path):
    model = build_tiny_model(tmp_path / "model", seed=1)
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": "xy" * (i + 1), "max_tokens": 3 + i},
        }
        for i in range(4)
    ]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(json.dumps(line) for line in lines))
    args = ["bench", str(batch), "--model", str(model), "--max-num-seqs", "2", "--ignore-eos"]
    result = run(*args, "--policy", "static,continuous", "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["policy"] for r in rows] == ["static", "continuous"]
    assert all(r["output_tokens"] == 3 + 4 + 5 + 6 for r in rows)
    table = run(*args, "--policy", "continuous").stdout
    assert "continuous" in table and "TTFT p50 ms" in table


def test_bench_bad_file(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    batch = tmp_path / "batch.jsonl"
    batch.write_text(
        '{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": -3}}\n'
    )
    result = run("bench", str(batch), "--model", str(model))
    assert result.exit_code == 2 and "batch.jsonl:1: body.max_tokens" in result.output
    missing = run("bench", str(tmp_path / "nope.jsonl"), "--model", str(model))
    assert missing.exit_code == 2 and "does not exist" in missing.output
