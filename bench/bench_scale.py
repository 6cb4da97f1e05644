"""A large batch end to end on this machine: validation, `bulkgen plan` and `bulkgen run` on one file of short
chat lines answered in one token (`max_tokens` 1), so the pipeline, not the model, is what is timed.

For a file of `--lines` requests (the bundled model, local storage by default, `--s3` for moto's S3 over HTTP
on 127.0.0.1), each step in its own process, as a user runs it:

- validation: the pass every door runs (runtime/validation.py's Checked over batch/validate.py), its seconds
  and the peak memory it added (VmHWM after a reset, bulkgen/engine/process_memory.py), per request;
- `bulkgen plan FILE --json`: seconds and the command's peak memory;
- `bulkgen run FILE`: seconds, lines per second, the command's peak memory and the largest of its children's
  (the Ray workers: sampled every 0.5 s), and on S3 its requests by class (a counting proxy in front of moto,
  tests/support/s3.py: put, get, list, delete, lease), per 1,000 lines; every minute, on stderr, the lines in
  the parts written so far and (on S3) the requests so far per 1,000 of them, so a run cut short still has
  its rate and its requests while running.

Each figure is printed with the rate that extrapolates it to 10M lines (the issue's target) and the load
average before and after: the machine's other work shows there.

    python bench/bench_scale.py [--lines 100000] [--s3] [--skip-plan] [--skip-run] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
TARGET = 10_000_000
PROGRESS_S = 60.0

# Runs a bulkgen command in this interpreter and reports its own peak memory on stderr's last line.
_WRAP = """
import sys
from bulkgen.engine.process_memory import peak_rss, reset_peak_rss
from bulkgen.cli import cli
start = reset_peak_rss()
code = 0
try:
    cli.main(sys.argv[1:], prog_name="bulkgen")
except SystemExit as exc:
    code = exc.code or 0
print(f"PEAK {peak_rss()} {start}", file=sys.stderr)
sys.exit(code)
"""

_VALIDATE = """
import sys, time
from bulkgen.engine.process_memory import peak_rss, reset_peak_rss
from bulkgen.batch.validate import Validator, validate_stream
from bulkgen.runtime.validation import Checked
start = reset_peak_rss()
t = time.perf_counter()
with open(sys.argv[1], "rb") as f:
    validator = Validator("/v1/chat/completions", [sys.argv[2]], 10**9)
    checked = Checked("", validator.result)
    validate_stream(f, validator, checked.add)
index = checked.builder.build()
print(time.perf_counter() - t, peak_rss() - start, len(index), checked.result.error_count)
"""


def write_file(path: Path, lines: int, model: str) -> int:
    with path.open("w") as f:
        for i in range(lines):
            body = {"model": model, "messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 1}
            f.write(
                json.dumps(
                    {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                )
            )
            f.write("\n")
    return path.stat().st_size


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def validate(path: Path, model: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _VALIDATE, str(path), model],
        capture_output=True,
        text=True,
        env=_env(),
        check=True,
    )
    seconds, added, indexed, errors = out.stdout.split()
    assert int(errors) == 0, out.stdout
    return {"seconds": float(seconds), "peak_bytes": int(added), "requests": int(indexed)}


def command(args: list[str], env: dict | None = None, progress: Callable[[], str] | None = None) -> dict:
    """Run `bulkgen ARGS` in its own process: seconds, its peak memory, the largest child's peak RSS;
    `progress()` printed on stderr every PROGRESS_S while it runs."""
    import psutil

    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRAP, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    children: dict[int, int] = {}
    done = threading.Event()

    def sample() -> None:
        report_at = time.perf_counter() + PROGRESS_S
        while not done.wait(0.5):
            if progress is not None and time.perf_counter() >= report_at:
                report_at += PROGRESS_S
                print(f"  [{time.perf_counter() - started:6.0f} s] {progress()}", file=sys.stderr, flush=True)
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        children[child.pid] = max(children.get(child.pid, 0), child.memory_info().rss)
                    except psutil.Error:
                        pass
            except psutil.Error:
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    done.set()
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"bulkgen {' '.join(args[:2])} failed ({proc.returncode}):\n{stderr[-3000:]}")
    peak_line = [line for line in stderr.splitlines() if line.startswith("PEAK ")][-1]
    peak, start = map(int, peak_line.split()[1:])
    return {
        "seconds": round(seconds, 2),
        "peak_bytes": peak,
        "peak_added_bytes": peak - start,
        "largest_child_bytes": max(children.values(), default=0),
        "stdout": stdout,
    }


def run_progress(store: Path, proxy) -> Callable[[], str]:
    """Lines in the result parts written so far (the S3 PUTs the proxy forwarded, or the local folder's
    files) and, on S3, the requests so far per 1,000 of those lines."""
    from bulkgen.store.layout import part_range
    from tests.support.s3 import tally

    def lines(keys) -> int:
        return sum(last - first + 1 for first, last in filter(None, map(part_range, keys)))

    def progress() -> str:
        if proxy is None:
            done = lines(str(f) for f in (store / "parts").glob("*/*"))
            return f"{done:,} lines in parts"
        log = list(proxy.log)
        done = lines(
            {path.split("?")[0] for method, path, status in log if method == "PUT" and status == 200}
        )
        per_1000 = {k: round(1000 * v / done, 1) for k, v in tally(log).items()} if done else {}
        return f"{done:,} lines in parts; S3 requests so far per 1,000 of them: {per_1000}"

    return progress


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--s3", action="store_true", help="storage on moto's S3 over HTTP (127.0.0.1)")
    parser.add_argument("--skip-plan", action="store_true")
    parser.add_argument("--skip-run", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from bulkgen.models.registry import DEFAULT_MODEL_NAME as BUNDLED_MODEL_NAME
    from tests.support.s3 import tally

    load_before = os.getloadavg()[0]
    report: dict = {"lines": args.lines, "storage": "s3 (moto)" if args.s3 else "local folder"}
    with tempfile.TemporaryDirectory(prefix="bulkgen-scale-") as tmp:
        path = Path(tmp) / "big.jsonl"
        t = time.perf_counter()
        report["file_bytes"] = write_file(path, args.lines, BUNDLED_MODEL_NAME)
        report["write_s"] = round(time.perf_counter() - t, 2)
        report["validation"] = validate(path, BUNDLED_MODEL_NAME)
        env, storage, moto, proxy = _env(), str(Path(tmp) / "store"), None, None
        if args.s3:  # moto in its own process, behind the tests' counting proxy (tests/support/s3.py)
            import boto3
            from bench_finalize import start_moto

            from tests.support.s3 import FlakyProxy

            moto, endpoint = start_moto()
            proxy = FlakyProxy(endpoint)
            proxy.thread.start()
            creds = {
                "AWS_ACCESS_KEY_ID": "x",
                "AWS_SECRET_ACCESS_KEY": "x",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
            os.environ.update(creds)
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="scale")
            env |= creds | {"AWS_ENDPOINT_URL": proxy.url}
            storage = "s3://scale/bulkgen"
        limit = ("--max-requests-per-batch", str(max(50_000, args.lines)))
        try:
            if not args.skip_plan:
                plan = command(["plan", str(path), "--json", "--storage", storage, *limit], env)
                if proxy is not None:
                    proxy.log.clear()  # the run's requests alone below
                plan.pop("stdout")
                report["plan"] = plan
            if not args.skip_run:
                out = Path(tmp) / "out.jsonl"
                progress = run_progress(Path(storage), proxy)
                run = command(
                    ["run", str(path), "--output", str(out), "--storage", storage, *limit], env, progress
                )
                run.pop("stdout")
                answered = sum(1 for _ in out.open()) if out.exists() else 0
                run["answered"] = answered
                run["lines_per_s"] = round(answered / run["seconds"], 1)
                if proxy is not None:  # the whole run's requests: upload, validation, run, finalize
                    counts = dict(tally(proxy.log))
                    run["s3_requests"] = counts
                    run["s3_per_1000_lines"] = {k: round(1000 * v / args.lines, 1) for k, v in counts.items()}
                report["run"] = run
        finally:
            if moto is not None:
                proxy.server.shutdown()
                moto.kill()
    report["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    scale = TARGET / args.lines
    if args.json:
        print(json.dumps(report, indent=1))
        return report
    mb = 1 << 20
    v = report["validation"]
    print(f"{args.lines:,} lines ({report['file_bytes'] / mb:.0f} MB), {report['storage']}")
    print(
        f"  validation  {v['seconds']:7.1f} s  {args.lines / v['seconds']:9.0f} lines/s  peak +{v['peak_bytes'] / mb:.0f} MB "
        f"({v['peak_bytes'] / args.lines:.0f} B a request)  -> 10M: {v['seconds'] * scale / 60:.0f} min, "
        f"{v['peak_bytes'] * scale / 2**30:.2f} GB"
    )
    for name in ("plan", "run"):
        r = report.get(name)
        if r is None:
            continue
        extra = f"  {r['lines_per_s']:.0f} lines/s" if name == "run" else ""
        print(
            f"  {name:10} {r['seconds']:7.1f} s{extra}  peak {r['peak_bytes'] / mb:.0f} MB (+{r['peak_added_bytes'] / mb:.0f}), "
            f"largest child {r['largest_child_bytes'] / mb:.0f} MB  -> 10M: {r['seconds'] * scale / 3600:.1f} h"
        )
        if "s3_per_1000_lines" in r:
            print(f"  S3 requests per 1,000 lines: {r['s3_per_1000_lines']}")
    print(f"  load average before / after: {report['load_average']}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
