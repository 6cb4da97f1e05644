import io
import json

import matplotlib.image

from bulkgen.metrics import REPORT_JSON, REPORT_PNG, BatchMetrics, render_report_png, report_files


def filled_metrics() -> BatchMetrics:
    metrics = BatchMetrics()
    for i in range(50):
        metrics.add_request(
            {
                "arrival_time": 0.0,
                "first_scheduled_time": i / 100,
                "first_token_time": i / 50,
                "finished_time": 1 + i / 50,
                "num_prompt_tokens": 8,
                "num_output_tokens": 11,
                "ttft_s": i / 50,
                "tpot_s": 0.1,
                "queue_wait_s": i / 100,
            }
        )
    metrics.add_steps(
        "w0",
        [
            {
                "t": k / 20,
                "duration_s": 0.04,
                "active_seqs": k % 8 + 1,
                "max_num_seqs": 8,
                "decode_tokens": k % 8 + 1,
            }
            for k in range(60)
        ],
    )
    return metrics


def test_report_files_are_json_and_png():
    files = report_files(filled_metrics())
    report = json.loads(files[REPORT_JSON])
    assert report["summary"]["requests"] == 50
    assert sum(report["latency_histograms"]["ttft_ms"]["counts"]) == 50
    assert report["timeline"] and all(0 < p["occupancy"] <= 1 for p in report["timeline"])
    png = files[REPORT_PNG]
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    image = matplotlib.image.imread(io.BytesIO(png))
    assert image.shape[0] > 500 and image.shape[1] > 500  # three stacked panels


def test_empty_report_still_renders():
    png = render_report_png(BatchMetrics().report())
    assert png.startswith(b"\x89PNG")
