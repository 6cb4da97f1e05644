"""Measures of real batches: the per-batch aggregator, its bounded timeline and the stored report."""

from bulkgen.metrics.batch import LATENCY_KEYS, BatchMetrics, percentiles
from bulkgen.metrics.report import REPORT_JSON, REPORT_PNG, render_report_png, report_files
from bulkgen.metrics.timeline import Timeline

__all__ = [
    "LATENCY_KEYS",
    "REPORT_JSON",
    "REPORT_PNG",
    "BatchMetrics",
    "Timeline",
    "percentiles",
    "render_report_png",
    "report_files",
]
