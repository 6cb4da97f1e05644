"""A real multi-node Ray cluster on one machine, made of Linux network namespaces (the cluster tests' rig).

    bgt-sw    the switch: bridge br0 and one veth end per namespace; no address, no route out
    bgt-head  10.231.0.1   Ray head (GCS, no GPU) and `bulkgen serve`
              10.231.0.5   the S3 server (moto): an address of its own, as it would be another machine
    bgt-a     10.231.0.2   Ray node with one fake GPU (a Ray resource: the engine runs on CPU)
    bgt-b     10.231.0.3   Ray node with one fake GPU
    bgt-cli   10.231.0.10  no Ray: the test's openai/boto3 client (a thread of pytest entered here)
    bgt-drv   10.231.0.11  no Ray until its driver joins: a host that only runs a bulkgen driver

Every address lives inside these namespaces, none has a default route, IPv6 is off: nothing leaves
10.231.0.0/24. Each process group (a node's Ray, the service, moto) runs in a PID namespace of its own
(`unshare --pid --fork --kill-child --mount-proc`), so a node dies by one SIGKILL to the PID this rig
started (the kernel then kills everything in it), and Ray's process scans (`ray start --head`'s
"already running" check, a driver looking for its local raylet) see only their own node. Token auth is
on (RAY_AUTH_MODE=token, a token file of our own); HOME and every Ray temp dir are under the rig's
folder, so ~/.ray and /tmp/ray are never touched. Teardown kills only the PIDs started here.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PREFIX = "bgt"
SUBNET = "10.231.0"
IP = {
    "head": f"{SUBNET}.1",
    "a": f"{SUBNET}.2",
    "b": f"{SUBNET}.3",
    "cli": f"{SUBNET}.10",
    "drv": f"{SUBNET}.11",
}
HEAD_IP = IP["head"]
S3_IP = f"{SUBNET}.5"  # in the head's namespace, so that a route can keep a node from one and not the other
GCS = f"{HEAD_IP}:6379"
S3_URL = f"http://{S3_IP}:5000"
API_PORT = 8000
# fixed ports: each node has a network namespace of its own, so they never collide
PORTS = [
    "--node-manager-port=6380",
    "--object-manager-port=6381",
    "--dashboard-agent-grpc-port=6382",
    "--dashboard-agent-listen-port=6383",
    "--runtime-env-agent-port=6384",
    "--metrics-export-port=6385",
    "--min-worker-port=10002",
    "--max-worker-port=10999",
]
# Ray declares a silent node dead after failure_threshold x (timeout + period); its defaults make that
# ~64 s, these ~30 s (set on the head, where the GCS runs the checks). ~15 s was too short on 2 loaded
# cores: a node busy loading its model missed its checks and was declared dead while alive.
HEALTH = {
    "RAY_health_check_period_ms": "2000",
    "RAY_health_check_timeout_ms": "3000",
    "RAY_health_check_failure_threshold": "6",
}
# A raylet that loses the GCS lives on (with its engine actors: orphans) for this long, 60 s by default;
# longer in the rig, so that orphans are certainly alive when the head-death scenario lets them reach S3
NODE_ENV = {"RAY_gcs_rpc_server_reconnect_timeout_s": "150"}
START_ATTEMPTS = 3
CLONE_NEWNET = 0x40000000


class RigUnavailable(RuntimeError):
    """The machine cannot build the rig (not root, no `ip netns`, no unshare): the tests fail with this."""


def ns(name: str) -> str:
    return f"{PREFIX}-{name}"


def _sbin(tool: str) -> str | None:
    """`tool`'s path, looked for in the sbin folders too: a root shell's PATH may lack them (sysctl is
    /usr/sbin's), and `ip netns exec` runs what it is given by PATH."""
    return shutil.which(tool, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_sbin("ip") or "ip", *args], capture_output=True, text=True, check=check, timeout=30
    )


def check_available() -> None:
    """Fail loudly (never skip): CI runs as root on a machine with iproute2 and util-linux."""
    missing = [tool for tool in ("ip", "unshare", "sysctl") if _sbin(tool) is None]
    if os.geteuid() != 0 or missing:
        raise RigUnavailable(
            f"the cluster tests build Ray nodes in network namespaces and need root and "
            f"`ip netns` + `unshare` (uid {os.geteuid()}, missing: {missing or 'none'})"
        )
    probe = ns(f"probe{os.getpid()}")
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    if made.returncode != 0:
        raise RigUnavailable(
            f"`ip netns add` fails here, so the cluster tests cannot run: {made.stderr.strip()}"
        )


class Rig:
    def __init__(self, root: Path) -> None:
        self.root = root  # keys, logs, Ray temp dirs (short: Unix socket paths)
        self.procs: dict[str, subprocess.Popen] = {}
        self.made: list[str] = []  # namespaces this rig created
        self.token = root / "auth_token"
        self.logs = root / "logs"

    # -- environment ------------------------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """The whole environment of every process of the cluster (nothing inherited from the test)."""
        return {
            "HOME": str(self.root / "home"),
            "PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ADDRESS": GCS,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": S3_URL,
            **extra,
        }

    # -- network --------------------------------------------------------------------------------------
    def net_up(self, names=("head", "a", "b", "cli", "drv")) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.root / "home").mkdir(exist_ok=True)
        self.token.write_text(secrets.token_hex(32))
        self.token.chmod(0o600)
        self._add_ns("sw")
        _ip("-n", ns("sw"), "link", "add", "br0", "type", "bridge")
        _ip("-n", ns("sw"), "link", "set", "br0", "up")
        for name in names:
            self._add_ns(name)
            # the veth pair is made in the switch and its peer moved straight into the node: nothing is
            # ever created in the root namespace
            _ip(
                "-n",
                ns("sw"),
                "link",
                "add",
                f"p-{name}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns(name),
            )
            _ip("-n", ns("sw"), "link", "set", f"p-{name}", "master", "br0", "up")
            _ip("-n", ns(name), "addr", "add", f"{IP[name]}/24", "dev", "eth0")
            _ip("-n", ns(name), "link", "set", "eth0", "up")
        _ip("-n", ns("head"), "addr", "add", f"{S3_IP}/24", "dev", "eth0")

    def _add_ns(self, name: str) -> None:
        _ip("netns", "del", ns(name), check=False)  # a leftover of a run that was killed itself
        _ip("netns", "add", ns(name))
        self.made.append(ns(name))
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns(name),
                _sbin("sysctl") or "sysctl",
                "-qw",
                "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        _ip("-n", ns(name), "link", "set", "lo", "up")

    def link(self, name: str, up: bool) -> None:
        """Take a node's cable out of the switch (a partition), or put it back."""
        _ip("-n", ns("sw"), "link", "set", f"p-{name}", "up" if up else "down")

    def block(self, name: str, address: str, blocked: bool) -> None:
        """Node `name` cannot reach `address` (the head's or S3's; connections refused at once), or can again."""
        _ip("-n", ns(name), "route", "add" if blocked else "del", "prohibit", f"{address}/32")

    def worker_logs(self, name: str) -> str:
        """The engine actors' stderr on node `name` (Ray writes each worker's under its temp dir)."""
        return "".join(
            p.read_text(errors="replace")
            for p in (self.root / f"r-{name}").glob("session_*/logs/worker-*.err")
        )

    # -- processes ------------------------------------------------------------------------------------
    def spawn(
        self, key: str, where: str, argv: list[str], env: dict[str, str] | None = None, on_node: bool = False
    ) -> subprocess.Popen:
        """`argv` in namespace `where`, in a PID namespace of its own (killing the returned PID kills it
        all), or with `on_node` in that of the node's Ray (a process of that host: a driver there finds
        its raylet, and dies with the node)."""
        log = (self.logs / f"{key}.log").open("ab")
        if on_node:
            isolate = ["nsenter", f"--target={self.node_pid(where)}", "--pid", "--mount"]
        else:
            isolate = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
        cmd = [_sbin("ip") or "ip", "netns", "exec", ns(where), *isolate, *argv]
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env or self.env(),
            start_new_session=True,
        )
        log.close()
        self.procs[key] = proc
        return proc

    def node_pid(self, name: str) -> int:
        """PID (as seen here) of PID 1 in node `name`'s PID namespace: the child of its unshare."""
        unshare = self.procs[f"ray-{name}"].pid
        return int(Path(f"/proc/{unshare}/task/{unshare}/children").read_text().split()[0])

    def kill(self, key: str) -> None:
        """SIGKILL one process group this rig started, as when its machine dies; wait until it is gone."""
        proc = self.procs.pop(key, None)
        if proc is None:
            return
        try:
            # its own session: unshare (whose --kill-child takes PID 1 of its namespace, and so the whole
            # namespace, with it) or nsenter and the process it started
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def log_text(self, key: str) -> str:
        path = self.logs / f"{key}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start_ray(self, name: str, *args: str, timeout: float = 120) -> float:
        """`ray start --block` on node `name`, retried: under load the raylet waits a fixed 15 s for its
        dashboard agent and aborts ("The current node timed out during startup"). -> seconds taken."""
        env = self.env(**(HEALTH if name == "head" else NODE_ENV))
        t0 = time.monotonic()
        for attempt in range(1, START_ATTEMPTS + 1):
            key = f"ray-{name}"
            self.kill(key)
            (self.logs / f"{key}.log").write_bytes(b"")
            temp = self.root / f"r-{name}"
            argv = [
                "ray",
                "start",
                "--block",
                *args,
                *PORTS,
                "--disable-usage-stats",
                "--object-store-memory=100000000",
                f"--temp-dir={temp}",
            ]
            proc = self.spawn(key, name, argv, env)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                if "Ray runtime started" in self.log_text(key):
                    return time.monotonic() - t0
                time.sleep(0.2)
            print(
                f"rig: ray start on {name} failed (attempt {attempt}): {self.log_text(key)[-600:]}",
                flush=True,
            )
        self.kill(f"ray-{name}")
        raise RuntimeError(
            f"ray start on {name} failed {START_ATTEMPTS} times; see {self.logs}/ray-{name}.log"
        )

    def head_up(self, gpus: int = 0) -> float:
        return self.start_ray(
            "head",
            "--head",
            f"--node-ip-address={HEAD_IP}",
            "--port=6379",
            "--num-cpus=1",
            f"--num-gpus={gpus}",
            "--include-dashboard=false",
        )

    def node_up(self, name: str) -> float:
        return self.start_ray(
            name, f"--address={GCS}", f"--node-ip-address={IP[name]}", "--num-cpus=1", "--num-gpus=1"
        )

    def s3_up(self) -> None:
        self.spawn("s3", "head", [sys.executable, "-m", "moto.server", "-H", S3_IP, "-p", "5000"])

    def up(self) -> dict[str, float]:
        """Network, S3, head and two GPU nodes; -> how long each start took."""
        self.net_up()
        self.s3_up()
        took = {"head": self.head_up()}
        for name in ("a", "b"):
            took[name] = self.node_up(name)
        return took

    def down(self) -> None:
        """Kill every PID started here (each takes its PID namespace with it), then delete our namespaces."""
        for key in list(self.procs):
            try:
                self.kill(key)
            except Exception as exc:  # go on: the namespaces must go too
                print(f"rig: could not kill {key}: {exc}", flush=True)
        for name in reversed(self.made):
            _ip("netns", "del", name, check=False)
        self.made.clear()


class InNamespace:
    """A thread that lives in a network namespace: `run(fn, *args)` calls fn there (setns is per thread),
    so the test's openai and boto3 clients reach 10.231.0.0/24 while pytest itself stays where it is."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"netns-{name}", initializer=self._enter, initargs=(name,)
        )
        self.run(lambda: None)

    @staticmethod
    def _enter(name: str) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{ns(name)}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {ns(name)} failed")
        finally:
            os.close(fd)

    def run(self, fn, *args, **kwargs):
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
