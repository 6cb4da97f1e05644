"""BatchMetrics on synthetic inputs whose results are computed by hand."""

import json

import pytest

from bulkgen.metrics import BatchMetrics, percentiles


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
    # TTFT ms sorted: 0..50, 50, 51..100 (102 values). p99 sits at rank 0.99 * 101 = 99.99, between
    # sorted[99] = 98 and sorted[100] = 99 -> 98.99 ms; p95 at rank 95.95 -> 94.95 ms.
    assert s["ttft_s"]["p50"] == pytest.approx(0.050) and s["ttft_s"]["p99"] == pytest.approx(0.09899)
    assert s["ttft_s"]["p95"] == pytest.approx(0.09495)
    assert s["tpot_s"]["count"] == 101 and s["tpot_s"]["p95"] == pytest.approx(0.0095)
    assert s["queue_wait_s"]["p95"] == pytest.approx(2 * 0.09495)
    # first arrival 100.0, last finish 100 + 1.00 + 1.0 = 102.0
    assert s["wall_time_s"] == pytest.approx(2.0)
    assert s["output_tokens"] == 101 * 5 + 1
    assert s["output_tokens_per_s"] == pytest.approx(506 / 2.0)
    assert s["input_tokens"] == 1020 and s["cached_prompt_tokens"] == 306
    assert metrics.summary(wall_time_s=10.0)["output_tokens_per_s"] == pytest.approx(50.6)


STATS_A = {
    "steps": 40,
    "busy_time_s": 4.0,
    "slot_steps": 100,
    "active_slot_steps": 80,
    "useful_tokens": 380,
    "prefill_tokens": 300,
    "decode_tokens": 80,
    "output_tokens": 90,
    "padding_slot_steps": 20,
    "prefill_padding_tokens": 100,
    "preemptions": 2,
    "batch_size_histogram": {"2": 3, "4": 5, "10": 1},
}
STATS_B = {
    "steps": 10,
    "busy_time_s": 1.5,
    "slot_steps": 50,
    "active_slot_steps": 50,
    "useful_tokens": 150,
    "prefill_tokens": 100,
    "decode_tokens": 50,
    "output_tokens": 55,
    "padding_slot_steps": 0,
    "prefill_padding_tokens": 0,
    "preemptions": 1,
    "batch_size_histogram": {"4": 1, "8": 2},
}


def test_engine_stats_replace_and_merge():
    metrics = BatchMetrics()
    metrics.add_engine_stats("w-a", {**STATS_A, "slot_steps": 10, "active_slot_steps": 1})  # superseded
    metrics.add_engine_stats("w-a", STATS_A)
    metrics.add_engine_stats("w-b", STATS_B)
    s = metrics.summary()
    assert s["slot_efficiency"] == pytest.approx(130 / 150, abs=1e-6)
    assert s["decode_padding_pct"] == pytest.approx(100 * 20 / 150, abs=1e-4)
    assert s["prefill_padding_pct"] == pytest.approx(100 * 100 / 500)
    assert s["batch_size_histogram"] == {"2": 3, "4": 6, "8": 2, "10": 1}
    assert list(s["batch_size_histogram"]) == ["2", "4", "8", "10"]
    assert s["preemptions"] == 3
    assert s["per_worker"]["w-a"]["busy_time_s"] == 4.0 and s["per_worker"]["w-a"]["steps"] == 40
    assert s["per_worker"]["w-a"]["slot_efficiency"] == pytest.approx(0.8)
    assert s["per_worker"]["w-b"]["slot_efficiency"] == 1.0


def test_slot_efficiency_without_active_counter_uses_padding():
    metrics = BatchMetrics()
    metrics.add_engine_stats("w", {"slot_steps": 200, "padding_slot_steps": 50})
    assert metrics.summary()["slot_efficiency"] == pytest.approx(0.75)


def test_empty_batch_summary_is_json_able():
    s = BatchMetrics().summary()
    json.dumps(s)
    assert s["requests"] == 0 and s["output_tokens_per_s"] is None and s["slot_efficiency"] is None


def test_state_round_trip_and_resume():
    metrics = BatchMetrics()
    for i in range(10):
        metrics.add_request(request(i))
    metrics.add_engine_stats("w-a", STATS_A)
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
    assert restored.summary()["ttft_s"]["p50"] == pytest.approx(0.050)


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
