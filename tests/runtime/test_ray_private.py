"""A `ray start` head on the same machine is not joined uninvited: `bulkgen run` starts its own private Ray,
joins the head only with `--ray-address auto`, and says in one line when the cluster it was told to join
does not answer.

The head is a real `ray start --head` on 127.0.0.1 with its own TMPDIR (where Ray keeps the
ray_current_cluster file that `ray.init()` would find), so no other Ray on this machine sees it; teardown
kills only its processes, by PID (never `ray stop`, which stops every Ray of the user).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from tests.support.service import free_port

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "chat.jsonl"


def _ray_cli() -> list[str]:
    found = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    return [found] if os.path.exists(found) else [sys.executable, "-m", "ray.scripts.scripts"]


def _processes_of(tmpdir: str) -> list[psutil.Process]:
    """The head's processes: they carry its TMPDIR (or its session folder on their command line)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid == os.getpid():
                continue
            if tmpdir in " ".join(proc.info["cmdline"] or []) or proc.environ().get("TMPDIR") == tmpdir:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.fixture(scope="module")
def foreign_head():
    tmpdir = tempfile.mkdtemp(prefix="bgray-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    env.update(TMPDIR=tmpdir, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    port = free_port()
    started = subprocess.run(
        [
            *_ray_cli(),
            "start",
            "--head",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-cpus",
            "1",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert (Path(tmpdir) / "ray" / "ray_current_cluster").exists()  # what an uninvited ray.init() reads
        yield env
    finally:
        head = _processes_of(tmpdir)
        for proc in head:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(head, timeout=30)  # returns as soon as all are gone
        shutil.rmtree(tmpdir, ignore_errors=True)


def _run(env: dict, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    small = tmp_path / "two.jsonl"
    small.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:2]))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "bulkgen",
            "run",
            str(small),
            "-o",
            str(tmp_path / "out.jsonl"),
            "--storage",
            str(tmp_path / "store"),
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )


def test_run_beside_a_ray_start_head_uses_its_own_ray(foreign_head, tmp_path):
    proc = _run(foreign_head, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 completed, 0 failed" in proc.stdout
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2


def test_ray_address_auto_joins_the_head(foreign_head, tmp_path):
    proc = _run(foreign_head, tmp_path, "--ray-address", "auto")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 completed, 0 failed" in proc.stdout


def test_a_ray_address_where_nothing_answers_is_one_line(tmp_path):
    port = free_port()  # nothing listens there
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = _run(env, tmp_path, "--ray-address", f"127.0.0.1:{port}")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines() == [
        f"Error: cannot join the Ray cluster at 127.0.0.1:{port}: nothing answers there (Connection refused)"
    ]
