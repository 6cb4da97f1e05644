"""BatchMetrics on synthetic inputs whose results are computed by hand."""

import json

import pytest

from bulkgen.batch.batchrecord import BatchRecord, new_batch_record
from bulkgen.metrics import BatchMetrics, percentiles
from bulkgen.metrics.batch import slot_efficiency


def request(i: int, **overrides) -> dict:
    """Request i arrives at 100 + i/100 s; TTFT i ms; TPOT i/10 ms; queue wait 2i ms."""
    out = {
        "arrival_time": 100.0 + i / 100,
        "first_scheduled_time": 100.0 + i / 100 + 2 * i / 1000,
        "first_token_time": 100.0 + i / 100 + i / 1000,
        "finished_time": 100.0 + i / 100 + 1.0,
        "num_prompt_tokens": 10,
        "num_output_tokens": 5,
        "num_cached_tokens": 3,
        "num_preemptions": 0,
        "ttft_s": i / 1000,
        "tpot_s": i / 10000,
        "queue_wait_s": 2 * i / 1000,
    }
    out.update(overrides)
    return out


def test_percentiles_by_hand():
    # 0..100: linear interpolation puts p50/p95/p99 exactly on 50/95/99.
    assert percentiles(list(range(101))) == {
        "p50": 50.0,
        "p95": 95.0,
        "p99": 99.0,
        "mean": 50.0,
        "count": 101,
    }
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None, "mean": None, "count": 0}
    # 1, 2, 3, 4: p50 = 2.5; p95 = 3 + 0.85 = 3.85; p99 = 3 + 0.97 = 3.97.
    p = percentiles([4.0, 1.0, 3.0, 2.0])
    assert (p["p50"], p["p95"], p["p99"], p["mean"]) == pytest.approx((2.5, 3.85, 3.97, 2.5))


def test_request_aggregates():
    metrics = BatchMetrics()
    for i in range(101):
        metrics.add_request(request(i))
    metrics.add_request(request(50, tpot_s=None, num_output_tokens=1))  # 1 token: no TPOT
    s = metrics.summary()
    assert s["requests"] == 102
    # TTFT ms: 0..50, 50, 51..100 (102 values); the sketch returns each percentile within 1%
    # of a value at (or next to) the exact rank: p50 = 50 ms, p95 ~ 95 ms, p99 ~ 99 ms.
    assert s["ttft_s"]["p50"] == pytest.approx(0.050, rel=0.011)
    assert s["ttft_s"]["p95"] == pytest.approx(0.095, rel=0.021) and s["ttft_s"]["p99"] == pytest.approx(
        0.099, rel=0.021
    )
    assert s["ttft_s"]["mean"] == pytest.approx((sum(range(101)) + 50) / 102 / 1000)
    assert s["tpot_s"]["count"] == 101 and s["tpot_s"]["p95"] == pytest.approx(0.0095, rel=0.021)
    assert s["queue_wait_s"]["p95"] == pytest.approx(2 * 0.095, rel=0.021)
    # first arrival 100.0, last finish 100 + 1.00 + 1.0 = 102.0
    assert s["wall_time_s"] == pytest.approx(2.0)
    assert s["output_tokens"] == 101 * 5 + 1
    assert s["output_tokens_per_s"] == pytest.approx(506 / 2.0)
    assert s["input_tokens"] == 1020 and s["cached_prompt_tokens"] == 306
    assert metrics.summary(wall_time_s=10.0)["output_tokens_per_s"] == pytest.approx(50.6)


def step(
    t: float, held: int, active: int, size: int | None = None, padding: int = 0, duration: float = 0.1
) -> dict:
    return {
        "t": t,
        "duration_s": duration,
        "num_seqs": held,
        "active_seqs": active,
        "prefill_tokens": 0,
        "decode_tokens": active,
        "padding_slots": padding,
        "max_num_seqs": 8,
        "batch_size": size or held,
    }


def test_steps_sum_per_worker_into_efficiency_padding_and_histogram():
    metrics = BatchMetrics()
    metrics.add_steps("w-a", [step(1.0, 4, 3, padding=1), step(1.1, 4, 4, size=8)])
    metrics.add_steps("w-b", [step(1.0, 2, 2, duration=0.5)])
    metrics.add_prefill_padding(25)
    metrics.add_request(request(1, num_preemptions=2))
    s = metrics.summary()
    assert s["slot_efficiency"] == pytest.approx(9 / 10)
    assert s["decode_padding_pct"] == pytest.approx(10.0)
    assert s["batch_size_histogram"] == {"2": 1, "4": 1, "8": 1}
    assert s["preemptions"] == 2
    # w-a's steps cover 0.9..1.1 s: 0.2 s busy, no gap; w-b: one step
    assert s["per_worker"]["w-a"] == {
        "busy_time_s": pytest.approx(0.2),
        "idle_time_s": pytest.approx(0.0, abs=1e-6),
        "steps": 2,
        "slot_efficiency": 0.875,
    }
    metrics.add_steps("w-a", [step(2.0, 4, 4)])  # 1.1 -> 1.9 s with no step of this batch: idle
    assert metrics.summary()["per_worker"]["w-a"]["idle_time_s"] == pytest.approx(0.8)
    assert s["per_worker"]["w-b"]["busy_time_s"] == pytest.approx(0.5)


def test_slot_efficiency_without_active_counter_uses_padding():
    assert slot_efficiency({"slot_steps": 200, "padding_slot_steps": 50}) == pytest.approx(0.75)


def test_state_does_not_grow_with_the_requests():
    """The state a batch's record carries is a sketch: as large after 250,000 requests as after 50,000 (so a
    10M-line batch's record stays small), and its percentiles still right."""
    metrics, sizes = BatchMetrics(), {}
    for i in range(250_000):
        metrics.add_request(
            {"ttft_s": (i % 5000) / 1000, "tpot_s": 0.01 + (i % 97) / 10_000, "queue_wait_s": i % 7}
        )
        if i + 1 in (50_000, 250_000):
            sizes[i + 1] = len(json.dumps(metrics.to_state()))
    assert sizes[250_000] < 100_000 and sizes[250_000] <= 1.1 * sizes[50_000], sizes
    assert metrics.summary()["ttft_s"]["p50"] == pytest.approx(2.5, rel=0.011)


def test_empty_batch_summary_is_json_able():
    s = BatchMetrics().summary()
    json.dumps(s)
    assert s["requests"] == 0 and s["output_tokens_per_s"] is None and s["slot_efficiency"] is None


def test_state_round_trip_and_resume():
    metrics = BatchMetrics()
    for i in range(10):
        metrics.add_request(request(i))
    metrics.add_steps(
        "w-a",
        [
            {"t": 100.0 + k / 10, "duration_s": 0.05, "active_seqs": 2, "max_num_seqs": 4, "decode_tokens": 2}
            for k in range(20)
        ],
    )
    restored = BatchMetrics.from_state(json.loads(json.dumps(metrics.to_state())))
    assert restored.summary() == metrics.summary()
    assert restored.timeline.points() == metrics.timeline.points()
    for i in range(10, 101):
        restored.add_request(request(i))
    assert restored.summary()["ttft_s"]["p50"] == pytest.approx(0.050, rel=0.011)


def test_bad_inputs_are_named():
    metrics = BatchMetrics()
    with pytest.raises(ValueError, match="'ttft_s'"):
        metrics.add_request(request(1, ttft_s="fast"))
    with pytest.raises(TypeError, match="dict"):
        metrics.add_request([1, 2])
    with pytest.raises(ValueError, match="step record 1 from worker 'w'"):
        metrics.add_steps("w", [{"t": 1.0}, {"duration_s": 1.0}])
    with pytest.raises(ValueError, match="version"):
        BatchMetrics.from_state({"version": 99})


def test_each_adapter_is_counted_and_kept_across_a_resume():
    from bulkgen.batch import totals
    from bulkgen.metrics.table import describe_summary

    metrics = BatchMetrics()
    metrics.add_request(request(1))  # the base model's: in the totals only
    for i, lora in enumerate(["a", "b", "a"]):
        metrics.add_request(request(i, lora=lora, num_output_tokens=i + 1))
    want = {
        "a": {"requests": 2, "input_tokens": 20, "output_tokens": 4},
        "b": {"requests": 1, "input_tokens": 10, "output_tokens": 2},
    }
    assert metrics.summary()["adapters"] == want
    restored = BatchMetrics.from_state(json.loads(json.dumps(metrics.to_state())))
    assert restored.summary()["adapters"] == want
    table = [line.split(None, 2) for line in describe_summary(metrics.summary()).splitlines()]
    assert ["adapter", "a", "2 requests, 4 output tokens"] in table
    sums = totals.empty()
    for _ in range(2):  # two ended batches
        stored = new_batch_record("file-x", "/v1/chat/completions", "24h", None).to_json()
        stored.update(status="completed", metrics=metrics.summary())
        stored["request_counts"].update(completed=4, failed=0, total=4)
        stored["usage"] = {
            "input_tokens": 40,
            "output_tokens": 11,
            "input_tokens_details": {"cached_tokens": 0},
        }
        totals.add(sums, BatchRecord.from_json(stored))
    assert sums["adapters"]["a"] == {"requests": 4, "input_tokens": 40, "output_tokens": 8}
