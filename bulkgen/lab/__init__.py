"""Teaching and analysis beside the service: `bulkgen simulate` (sim/), `bulkgen bench` (policy_bench.py
and the static and dynamic batching policies it compares, grouped.py), the training job's memory
arithmetic (memory.py), and tiny random-weight models for tests and benchmarks (tiny.py).

The service path (api, batch, runtime, plan) never imports this package; tests/lab/test_boundary.py
holds it to that.
"""
