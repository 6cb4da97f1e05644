import pytest

from bulkgen.metrics import Timeline


def step(t, active=2, capacity=4, decode=2, duration=0.01):
    return {
        "t": t,
        "duration_s": duration,
        "active_seqs": active,
        "max_num_seqs": capacity,
        "decode_tokens": decode,
        "prefill_tokens": 0,
    }


def test_rates_and_occupancy_per_bucket():
    timeline = Timeline(max_buckets=10, initial_width_s=1.0)
    for k in range(10):  # the first step starts at 49.99: ten 10 ms steps, 2 of 4 slots, 2 tokens each
        timeline.add(step(50.0 + k / 10))
    timeline.add(step(52.5, active=4, decode=4, duration=0.5))  # 52.0..52.5: bucket 2
    points = timeline.points()
    assert [p["t_s"] for p in points] == [0.0, 1.0, 2.0]
    assert points[0]["output_tokens_per_s"] == pytest.approx(20.0)
    assert points[0]["occupancy"] == pytest.approx(0.5)
    assert points[0]["busy_workers"] == pytest.approx(0.1)
    assert points[0]["steps"] == 10
    assert points[1] == {
        "t_s": 1.0,
        "width_s": 1.0,
        "steps": 0,
        "output_tokens_per_s": 0.0,
        "busy_workers": 0.0,
        "occupancy": 0.0,
    }  # idle second
    assert points[2]["occupancy"] == pytest.approx(1.0) and points[2]["steps"] == 1


def test_long_step_is_spread_over_the_buckets_it_covers():
    timeline = Timeline(max_buckets=10, initial_width_s=1.0)
    timeline.add(step(10.0, decode=0, duration=0.0))  # origin 10.0
    timeline.add(step(13.0, active=4, decode=10, duration=2.0))  # 11..13: half in bucket 1, half in 2
    timeline.add(step(13.0, active=4, decode=6, duration=1.5))  # 11.5..13: 1/3 in bucket 1, 2/3 in 2
    points = timeline.points()
    assert [p["output_tokens_per_s"] for p in points] == pytest.approx([0.0, 5.0 + 2.0, 5.0 + 4.0])
    assert [p["busy_workers"] for p in points] == pytest.approx([0.0, 1.5, 2.0])
    assert [p["steps"] for p in points] == [1, 0, 2]


def test_memory_is_bounded_and_totals_kept():
    timeline = Timeline(max_buckets=100, initial_width_s=0.001)
    for k in range(20_000):
        timeline.add(step(k * 0.01))
    assert len(timeline.buckets) <= 100
    points = timeline.points()
    assert sum(p["steps"] for p in points) == 20_000
    tokens = sum(p["output_tokens_per_s"] * p["width_s"] for p in points)
    assert tokens == pytest.approx(40_000)


def test_out_of_order_records_from_other_workers():
    timeline = Timeline(max_buckets=8, initial_width_s=1.0)
    timeline.add(step(10.0))
    timeline.add(step(3.0))  # earlier than the origin: the timeline extends to the left
    timeline.add(step(30.0))
    assert len(timeline.buckets) <= 8
    assert timeline.origin <= 3.0
    assert sum(p["steps"] for p in timeline.points()) == 3


def test_bad_settings():
    with pytest.raises(ValueError, match="max_buckets"):
        Timeline(max_buckets=3)
    with pytest.raises(ValueError, match="initial_width_s"):
        Timeline(initial_width_s=0)
