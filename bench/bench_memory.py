"""The service's memory on a maximal batch, measured in one run: a 200 MB, 50,000-line file.

A `bulkgen serve` subprocess (local storage, one CPU worker, the bundled model) gets the file over real
HTTP from the openai client, then the batch is created and validated by the runtime (one streamed pass
that also builds the line index), and then either
- (default) runs for --run-s seconds and is cancelled, so the 50,000 lines end in the error file as a
  cancelled batch's do. The prompts are ~4 KB of text each (that is how a file reaches 200 MB); the
  bundled model's 512-token context refuses them at run time, so the run writes
  `context_length_exceeded` lines: the worker → parts → driver path without generation; or
- (--prompt-chars 200 --full) runs to its end: 200-character prompts, max_tokens 4, the rest of each
  ~4 KB line padding in the `user` field (accepted and ignored), so all 50,000 requests generate and
  the output file gets 50,000 lines.

Reported: the serve process's (the API + batch driver; not the Ray workers) resident memory when idle,
and its peak above idle while uploading, validating, running, finalizing and serving the result files
(sampled from /proc every 20 ms; VmHWM, the kernel's own peak, as a check); upload, validation (create
-> in_progress), run and finalize times. The goal: peak service RSS above idle < 500 MB.

    python bench/bench_memory.py [--lines 50000] [--mb 200] [--run-s 20 | --prompt-chars 200 --full] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

WORDS = (
    "the data batch model token cache queue worker prompt result slot stream range part lease "
    "engine offline bulk label summary review answer question detail"
).split()


def workload(path: Path, lines: int, total_bytes: int, prompt_chars: int | None = None) -> Path:
    """`lines` chat requests of ~total_bytes / lines bytes each (ASCII words, so JSON length = text length).
    With `prompt_chars`, prompts are that long and the rest of each line is padding in the `user` field
    (accepted and ignored), so the requests fit the bundled model's context and really generate."""
    rng = random.Random(0)
    per_line = total_bytes // lines
    pool = " ".join(rng.choice(WORDS) for _ in range(400_000))  # ~2.5 MB of text; lines are slices of it
    with path.open("w") as f:
        for i in range(lines):
            row = {
                "custom_id": f"request-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "bulkgen-tiny",
                    "max_tokens": 4,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": ""}],
                },
            }
            if prompt_chars is not None:
                row["body"]["user"] = ""
            need = per_line - len(json.dumps(row)) - 1
            start = rng.randrange(len(pool) - need)
            text = pool[start : start + need]
            if prompt_chars is None:
                row["body"]["messages"][0]["content"] = text
            else:
                row["body"]["messages"][0]["content"] = text[:prompt_chars]
                row["body"]["user"] = "u" * (need - min(prompt_chars, need))
            f.write(json.dumps(row) + "\n")
    return path


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Sampler(threading.Thread):
    """Peak RSS of `pid` per phase, sampled every 20 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.phase, self.peaks, self.stop = pid, "idle", {}, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                kb = rss_kb(self.pid)
            except OSError:
                return
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), kb)
            time.sleep(0.02)


def start_serve(storage: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    log = open(f"{storage}.serve.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bulkgen",
            "serve",
            "--storage",
            storage,
            "--port",
            str(port),
            "--cpu-workers",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    raise SystemExit(f"bulkgen serve did not start; see {log.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--mb", type=float, default=200, help="file size in MB (10**6 bytes)")
    parser.add_argument("--run-s", type=float, default=20.0, help="seconds to run before cancelling")
    parser.add_argument("--full", action="store_true", help="run the batch to its end instead of cancelling")
    parser.add_argument(
        "--prompt-chars",
        type=int,
        help="short prompts of this many characters, the rest of each line padding in `user`",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from openai import OpenAI

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.support.service import free_port

    load = round(os.getloadavg()[0], 2)
    work = Path(tempfile.mkdtemp(prefix="bulkgen-bench-memory-"))
    path = workload(work / "big.jsonl", args.lines, int(args.mb * 1e6), args.prompt_chars)
    port = free_port()
    proc = start_serve(str(work / "storage"), port)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
    try:
        time.sleep(5)  # let the service settle (Ray workers up, model loaded)
        idle = rss_kb(proc.pid)
        sampler = Sampler(proc.pid)
        sampler.start()
        times = {}
        sampler.phase = "upload"
        t = time.perf_counter()
        with path.open("rb") as f:
            uploaded = client.files.create(file=(path.name, f), purpose="batch")
        times["upload_s"] = time.perf_counter() - t
        sampler.phase = "validate"
        t = time.perf_counter()
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.status == "validating", batch.status
        while (batch := client.batches.retrieve(batch.id)).status == "validating":
            time.sleep(0.05)
        times["validate_s"] = time.perf_counter() - t
        assert batch.status == "in_progress", batch.errors
        sampler.phase = "run"
        t = time.perf_counter()
        while args.full and client.batches.retrieve(batch.id).status == "in_progress":
            time.sleep(1)
        time.sleep(0 if args.full else args.run_s)
        ran = client.batches.retrieve(batch.id).request_counts
        times["run_s"] = time.perf_counter() - t
        sampler.phase = "finalize" if args.full else "cancel+finalize"
        t = time.perf_counter()
        if not args.full:
            client.batches.cancel(batch.id)
        while (batch := client.batches.retrieve(batch.id)).status not in ("cancelled", "completed", "failed"):
            time.sleep(0.1)
        times["finalize_s"] = time.perf_counter() - t
        sampler.phase = "download"
        error_lines = (
            len(client.files.content(batch.error_file_id).text.splitlines()) if batch.error_file_id else 0
        )
        output_lines = (
            len(client.files.content(batch.output_file_id).text.splitlines()) if batch.output_file_id else 0
        )
        sampler.stop.set()
        sampler.join()
        hwm = rss_kb(proc.pid, "VmHWM")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    peaks = {phase: round((kb - idle) / 1024, 1) for phase, kb in sampler.peaks.items()}
    result = {
        "load_avg_1m_at_start": load,
        "file_bytes": uploaded.bytes,
        "lines": args.lines,
        "idle_rss_mb": round(idle / 1024, 1),
        "peak_above_idle_mb": peaks,
        "vmhwm_above_idle_mb": round((hwm - idle) / 1024, 1),
        **{k: round(v, 2) for k, v in times.items()},
        "status": batch.status,
        "ran_before_cancel": {"completed": ran.completed, "failed": ran.failed},
        "request_counts": batch.request_counts.model_dump(),
        "error_file_lines": error_lines,
        "output_file_lines": output_lines,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"file: {uploaded.bytes / 1e6:.1f} MB, {args.lines} lines; serve idle RSS {idle / 1024:.0f} MB "
        f"(machine load {load} at start)"
    )
    for phase, mb in peaks.items():
        print(f"  peak RSS above idle while {phase:16s} {mb:8.1f} MB")
    print(f"  VmHWM above idle: {result['vmhwm_above_idle_mb']} MB (goal < 500 MB)")
    print(
        f"upload {times['upload_s']:.1f} s, validation {times['validate_s']:.1f} s (create -> in_progress), "
        f"run {times['run_s']:.1f} s, {'finalize' if args.full else 'cancel+finalize'} {times['finalize_s']:.1f} s"
    )
    print(
        f"counts when the run phase ended: {ran.completed} completed, {ran.failed} failed; "
        f"final {batch.status} {batch.request_counts.model_dump()}, error file {error_lines} lines, "
        f"output file {output_lines} lines"
    )


if __name__ == "__main__":
    main()
