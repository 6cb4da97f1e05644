"""Helpers that test files import (conftest modules hold only fixtures).

service        a real service in this process: uvicorn on 127.0.0.1, local Ray, tiny random models;
               batch rows, uploads, and waits on a batch's status
serve_process  `bulkgen serve` as a subprocess (for tests that kill or double the service)
watch          `bulkgen watch` as a subprocess
held_engine    the engine every worker builds in tests: requests marked HOLD wait at a gate the test
               opens, so cancel, kill and expiry tests catch a batch in progress on any machine
cpu_account    each test's wall and machine CPU seconds (BULKGEN_TEST_CPU), and a report of them
fresh          a measurement in a fresh interpreter (tracemalloc counts every thread of a process)
clock          a fake clock for leases, claims and the work queue: expiry without waiting
wait           wait_until: a condition with a deadline, never a sleep "long enough"
gated_store    a LocalStore whose chosen calls a test holds, to interleave writers
receiver       a webhook receiver that verifies events with the `openai` package
s3             a fault-injecting proxy in front of the moto S3 server
screens        dashboard screenshots
tiers          what a test starts (Ray, a server, a subprocess): the marks behind `pytest -m fast`
tiny_models    tiny models built once per session, keyed by builder and config (the `tiny_model` fixture)
"""
