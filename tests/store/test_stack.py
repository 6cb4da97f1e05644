"""Static checks of the deployable stack: the image (Dockerfile, the wheel it installs), docker-compose.yml
and the KubeRay manifests, down to every `bulkgen` command line they run, parsed by the real CLI.

Docker and Kubernetes cannot run here; the parts that can run do (the wheel is built, the compose stack's
bucket-creation script runs against a real S3 server)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import click
import pytest
import yaml

from bulkgen import __version__
from bulkgen.cli import cli

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "infra" / "kuberay"
PINNED = re.compile(r"^[\w./-]+:\d+\.\d+\.\d+(-[\w.]+)?$")  # registry/name:X.Y.Z[-flavor]


def parse_cli(argv: list[str]) -> dict[str, object]:
    """Parse a `bulkgen ...` command line as the real CLI does (option names, values, types, choices)
    without running it; -> each option's parsed value, keyed by the option as written ("--storage")."""
    assert argv[0] == "bulkgen", argv
    name, args = argv[1], argv[2:]
    command = cli.commands.get(name)
    assert command is not None, f"bulkgen has no command {name!r}"
    try:
        with click.Context(cli, info_name="bulkgen") as parent:
            params = command.make_context(name, list(args), parent=parent).params
    except click.UsageError as exc:
        raise AssertionError(f"`{shlex.join(argv)}`: {exc.format_message()}") from None
    return {opt: params[p.name] for p in command.params if isinstance(p, click.Option) for opt in p.opts}


def shell_command(text: str) -> list[str]:
    """The `bulkgen ...` part of a shell line such as `ulimit -n 65536; ... && exec bulkgen serve ...`."""
    words = shlex.split(text)
    start = words.index("bulkgen")
    end = next((i for i in range(start, len(words)) if words[i] in ("&&", ";", "||", "|")), len(words))
    return words[start:end]


def test_parse_cli_rejects_what_the_cli_rejects():
    assert parse_cli(["bulkgen", "serve", "--port", "8000"])["--port"] == 8000
    for bad in (
        ["bulkgen", "serve", "--no-such-option"],
        ["bulkgen", "serve", "--port", "eighty"],
        ["bulkgen", "serve", "--scheduling", "random"],
        ["bulkgen", "nope"],
        ["bulkgen", "watch", "--input"],
    ):
        with pytest.raises(AssertionError):
            parse_cli(bad)


# ---- the image ---------------------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(word.upper(), rest.strip()) for word, _, rest in (line.partition(" ") for line in lines)]


def _all(instructions, word: str) -> list[str]:
    return [rest for w, rest in instructions if w == word]


def test_dockerfile_bases_are_pinned_and_gpu_is_the_default():
    docker = _dockerfile()
    args = dict(a.split("=", 1) for a in _all(docker, "ARG") if "=" in a)
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["RAY_VERSION"]) and args["FLAVOR"] == "gpu"
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    stages = dict(reversed(f.split(" AS ")) for f in _all(docker, "FROM"))
    assert stages["gpu-base"] == "rayproject/ray:${RAY_VERSION}-py311-cu128"
    assert stages["cpu-base"] == "rayproject/ray:${RAY_VERSION}-py311-cpu"
    assert stages["image"] == "${FLAVOR}-base" and docker[-1][0] != "FROM"
    text = (ROOT / "Dockerfile").read_text()
    assert "latest" not in text
    # the image's Ray is the cluster's Ray (KubeRay's rayVersion): drivers and workers must match
    cluster = next(
        d
        for d in yaml.safe_load_all((KUBERAY / "bulkgen-raycluster.yaml").read_text())
        if d["kind"] == "RayCluster"
    )
    assert cluster["spec"]["rayVersion"] == args["RAY_VERSION"]


def test_dockerfile_installs_torch_for_its_base_and_bulkgen_non_editable():
    docker = _dockerfile()
    envs = _all(docker, "ENV")
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128" in envs  # the gpu base's CUDA 12.8
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in envs
    runs = _all(docker, "RUN")
    assert any('--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in run for run in runs)
    (install,) = [run for run in runs if "pip install" in run and "/tmp/bulkgen-src " in run]
    # through the lock CI tests (requirements/lock.txt, copied in), not whatever is newest on build day
    assert "-c /tmp/bulkgen-src/requirements/lock.txt /tmp/bulkgen-src " in install
    assert " -e " not in install and "--editable" not in install and "rm -rf /tmp/bulkgen-src" in install
    assert "BUNDLED_MODEL" in install  # the built image proves its installed copy finds the model
    assert _all(docker, "USER")[-1] == "ray"
    assert json.loads(_all(docker, "ENTRYPOINT")[0]) == ["bulkgen"]
    assert json.loads(_all(docker, "CMD")[-1]) == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    parse_cli(["bulkgen", *json.loads(_all(docker, "CMD")[-1])])
    assert _all(docker, "EXPOSE") == ["8000"] and "/health" in _all(docker, "HEALTHCHECK")[0]


def test_dockerignore_sends_what_the_image_copies():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"  # an allowlist: nothing else reaches the build context
    for copy in _all(_dockerfile(), "COPY"):
        for source in [w for w in copy.split() if not w.startswith("--")][:-1]:
            assert f"!{source}" in patterns or f"!{source}/" in patterns, source


def test_the_wheel_ships_the_bundled_model_and_an_installed_copy_finds_it(tmp_path):
    """What a non-editable install (the image's) gets: build the wheel from a copy of the sources, look
    inside, install it into an empty folder and ask the installed package where its model is."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "bulkgen", src / "bulkgen", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("bulkgen-*.whl")
    bundled = ROOT / "bulkgen" / "models" / "bundled"
    with zipfile.ZipFile(wheel) as z:
        sizes = {i.filename: i.file_size for i in z.infolist()}
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert sizes[f"bulkgen/models/bundled/{name}"] == (bundled / name).stat().st_size, name

    site = tmp_path / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-compile", "--target", site, wheel], check=True, timeout=300
    )
    probe = "from bulkgen.models.registry import default_model_path; print(default_model_path())"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BULKGEN_DEFAULT_MODEL")}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, "PYTHONPATH": str(site)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert Path(out) == site / "bulkgen" / "models" / "bundled"
    assert json.loads((Path(out) / "config.json").read_text()) == json.loads(
        (bundled / "config.json").read_text()
    )


# ---- docker-compose.yml ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_services_and_pinned_images(compose):
    services = compose["services"]
    assert set(services) == {"s3", "create-bucket", "bulkgen", "watcher"}
    moto = services["s3"]["image"]
    assert PINNED.match(moto) and moto.startswith("motoserver/moto:5.")
    required = re.search(r'"moto\[[^]]*\]>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    tag = tuple(int(x) for x in moto.rsplit(":", 1)[1].split("."))
    assert tag >= tuple(int(x) for x in required.split("."))  # conditional writes need this moto
    for name in ("create-bucket", "bulkgen", "watcher"):
        assert services[name]["image"] == f"bulkgen:{__version__}-cpu"
        assert services[name]["build"] == {"context": ".", "args": {"FLAVOR": "cpu"}}


def test_compose_publishes_only_the_api_and_only_on_loopback(compose):
    services, networks = compose["services"], compose["networks"]
    assert networks["backend"]["internal"] is True
    assert [name for name, s in services.items() if "ports" in s] == ["bulkgen"]
    assert services["bulkgen"]["ports"] == ["127.0.0.1:8000:8000"]
    for name, service in services.items():
        assert "backend" in service["networks"]
        assert ("api" in service["networks"]) == (name == "bulkgen"), name
        assert service.get("network_mode") is None and not service.get("privileged")


def test_compose_start_order(compose):
    services = compose["services"]
    assert services["create-bucket"]["depends_on"] == {"s3": {"condition": "service_healthy"}}
    for name in ("bulkgen", "watcher"):
        assert services[name]["depends_on"] == {
            "create-bucket": {"condition": "service_completed_successfully"}
        }
    assert "healthcheck" in services["s3"]


def test_compose_commands_are_valid_bulkgen_command_lines(compose):
    services = compose["services"]
    serve = parse_cli(["bulkgen", *services["bulkgen"]["command"]])
    watch = parse_cli(["bulkgen", *services["watcher"]["command"]])
    bucket = services["create-bucket"]["environment"]["BULKGEN_BUCKET"]
    endpoint = services["bulkgen"]["environment"]["AWS_ENDPOINT_URL"]
    assert (serve["--host"], serve["--port"]) == ("0.0.0.0", 8000)
    assert (
        serve["--storage"] == watch["--storage"] == f"s3://{bucket}/bulkgen"
    )  # one storage: the API sees them
    assert serve["--endpoint-url"] == watch["--endpoint-url"] == endpoint == "http://s3:5000"
    assert (
        watch["--input"] == f"{watch['--storage']}/inbox/"
        and watch["--output"] == f"{watch['--storage']}/outbox/"
    )
    for name in ("bulkgen", "watcher", "create-bucket"):
        assert services[name]["environment"]["AWS_ENDPOINT_URL"] == endpoint


def test_compose_bucket_script_creates_the_bucket_once(compose, s3_server):
    """The create-bucket service's script, run against a real S3 server (twice: a restart is harmless)."""
    import boto3

    service = compose["services"]["create-bucket"]
    assert service["entrypoint"] == ["python", "-c"]
    env = {**os.environ, **service["environment"], "AWS_ENDPOINT_URL": s3_server}
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", service["command"][0]], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
    bucket = service["environment"]["BULKGEN_BUCKET"]
    names = [b["Name"] for b in boto3.client("s3", endpoint_url=s3_server).list_buckets()["Buckets"]]
    assert names.count(bucket) == 1 and f"bucket {bucket} ready" in out.stdout


def test_compose_s3_healthcheck_asks_what_moto_serves(compose, s3_server):
    """The s3 service's healthcheck, pointed at this moto server instead of the container's own port."""
    check = compose["services"]["s3"]["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"] and "http://127.0.0.1:5000/" in check[3]
    assert compose["services"]["s3"]["environment"]["MOTO_PORT"] == "5000"
    script = check[3].replace("http://127.0.0.1:5000", s3_server)
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 0
    broken = script.replace("/moto-api/", "/no-such-page/")
    assert subprocess.run([sys.executable, "-c", broken], capture_output=True, timeout=60).returncode != 0


# ---- KubeRay -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kube() -> list[dict]:
    docs = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def _pod_specs(kube: list[dict]):
    for doc in kube:
        if doc["kind"] == "RayCluster":
            yield "head", doc["spec"]["headGroupSpec"]["template"]["spec"]
            for group in doc["spec"]["workerGroupSpecs"]:
                yield group["groupName"], group["template"]["spec"]
        elif doc["kind"] == "Deployment":
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def test_kuberay_manifests_have_the_required_fields(kube):
    kinds = sorted(doc["kind"] for doc in kube)
    assert kinds == ["Deployment", "RayCluster", "Service", "ServiceAccount", "ServiceAccount"]
    for doc in kube:
        assert doc["apiVersion"] and doc["metadata"]["name"]
    (deployment,) = [d for d in kube if d["kind"] == "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    accounts = {d["metadata"]["name"] for d in kube if d["kind"] == "ServiceAccount"}
    for _, spec in _pod_specs(kube):
        assert spec["serviceAccountName"] in accounts and spec["securityContext"]["runAsNonRoot"] is True


def test_every_image_is_pinned_to_this_version(kube):
    for name, spec in _pod_specs(kube):
        for container in spec["containers"]:
            image = container["image"]
            assert PINNED.match(image) and image.rsplit(":", 1)[1] == f"{__version__}-cu128", (name, image)


def test_gpu_workers_run_one_engine_per_gpu_and_nothing_else_asks_for_gpus(kube):
    for name, spec in _pod_specs(kube):
        (container,) = spec["containers"]
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        if name == "gpu":
            assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"] == 1  # one GPU: one engine actor
            assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        else:
            assert "nvidia.com/gpu" not in limits, name  # the API head and the watcher run no engine
    cluster = next(d for d in kube if d["kind"] == "RayCluster")
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"


def test_kuberay_commands_are_valid_bulkgen_command_lines(kube):
    cluster = next(d for d in kube if d["kind"] == "RayCluster")
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    serve = parse_cli(shell_command(head["args"][0]))
    assert serve["--ray-address"] == "auto" and serve["--port"] == 8000
    env = {e["name"]: e for e in head["env"]}
    assert env["BULKGEN_WEBHOOK_SECRET"]["valueFrom"]["secretKeyRef"]["optional"] is True
    storage = env["BULKGEN_STORAGE"]["value"]

    (deployment,) = [d for d in kube if d["kind"] == "Deployment"]
    (watcher,) = deployment["spec"]["template"]["spec"]["containers"]
    (line,) = watcher["args"]  # a Ray node without GPUs first: a driver joins only from a Ray node
    assert line.startswith('ray start --address="$RAY_ADDRESS"') and "--num-gpus=0" in line
    watch = parse_cli(shell_command(line))
    assert watch["--storage"] == storage  # the API shows the watcher's batches
    assert watch["--input"] == f"{storage}/inbox/" and watch["--output"] == f"{storage}/outbox/"
    assert watch["--sqs-queue-url"].startswith("https://sqs.")
    watcher_env = {e["name"]: e.get("value") for e in watcher["env"]}
    assert (
        watcher_env["RAY_ADDRESS"] == f"{cluster['metadata']['name']}-head-svc:6379"
    )  # KubeRay's head service
