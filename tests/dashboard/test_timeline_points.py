"""The dashboard's timeline: bounded for the page, rates kept as rates (no browser, no service)."""

from __future__ import annotations

from bulkgen.api.dashboard import _points, downsample
from bulkgen.metrics import BatchMetrics


def test_points_carry_batch_size_and_downsample_keeps_rates():
    metrics = BatchMetrics()
    # 600 steps of 0.05 s, 8 active sequences each, 8 tokens per step: 160 tokens/s, mean batch size 8
    records = [
        {
            "t": 100.0 + 0.05 * (i + 1),
            "duration_s": 0.05,
            "num_seqs": 8,
            "active_seqs": 8,
            "decode_tokens": 8,
            "max_num_seqs": 16,
        }
        for i in range(600)
    ]
    metrics.add_steps("w0", records)
    points = _points(metrics)
    assert len(points) >= 500
    assert all(abs(p["batch_size"] - 8) < 1e-6 for p in points if p["steps"])
    small = downsample(points, 100)
    assert len(small) <= 100
    assert sum(p["steps"] for p in small) == sum(p["steps"] for p in points) == 600
    busy = [p for p in small if p["steps"]]
    assert all(
        abs(p["output_tokens_per_s"] - 160) < 1 and abs(p["occupancy"] - 0.5) < 1e-6 for p in busy[:-1]
    )
    assert small[-1]["t_s"] + small[-1]["width_s"] >= points[-1]["t_s"]
    assert downsample(points[:10], 100) == points[:10]
