"""The runtime flags are made from the settings' fields: each setting a user may set has exactly one flag,
`serve`, `run` and `watch` list them with the dataclass's default, and a bad value is a usage error that
names its flag. Nothing here starts Ray or a server."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from bulkgen.cli import cli
from bulkgen.cli.server_cmds import run, serve
from bulkgen.settings import ENGINE_FLAGS, MIB, ImageSettings, Settings, WorkerSettings
from bulkgen.settings_flags import flag_fields, from_flags

# The flags users have today: none may disappear or be renamed without this list changing with it.
SHARED_FLAGS = {
    "--storage", "--endpoint-url", "--model", "--ray-address", "--workers", "--cpu-workers", "--max-num-seqs",
    "--max-num-batched-tokens", "--range-size", "--max-requests-per-batch", "--max-embedding-inputs-per-batch",
    "--max-file-mb", "--scheduling",
    "--fair-share-after", "--tenant-weight", "--lease-ttl", "--tenant", "--worker-poll-deadline",
    "--model-load-deadline", "--model-load-seconds-per-gb",
    "--storage-outage-timeout", "--scan-interval", "--async-scheduling", "--lora", "--lora-file", "--max-loras",
    "--quantize", "--kv-cache-dtype", "--generation-config", "--tensor-parallel", "--reasoning-parser", "--tool-parser", "--chat-template-kwargs", "--thinking-token-budget", "--image-url-hosts", "--max-image-mb", "--max-image-pixels",
    "--max-images-per-line", "--image-fetch-timeout", "--image-decode-threads", "--image-memory-mb",
}  # fmt: skip
SERVE_ONLY = {"--refuse-infeasible"}
NO_FLAG = {
    "workers",
    "cpu_threads",
    "engine_kwargs",
    "images",
}  # nested settings, set by code, or flagged per key
WIDE = {"terminal_width": 1000, "max_content_width": 1000}  # a default never split over two lines


def test_every_user_setting_has_exactly_one_flag():
    settable = set(ENGINE_FLAGS)
    for cls in (Settings, WorkerSettings, ImageSettings):
        for field in dataclasses.fields(cls):
            assert "flag" in field.metadata, f"{cls.__name__}.{field.name}: declare its flag (None: no flag)"
            if field.metadata["flag"] is not None:
                settable.add(field.name)
            else:
                assert field.name in NO_FLAG, f"{cls.__name__}.{field.name} has no flag"
    params = [item.param for item in flag_fields()]
    names = [item.flag.name for item in flag_fields()]
    assert sorted(params) == sorted(settable)  # one flag each, none twice
    assert len(set(names)) == len(names)
    assert {item.flag.name for item in flag_fields() if item.flag.shared} == SHARED_FLAGS
    assert {item.flag.name for item in flag_fields() if not item.flag.shared} == SERVE_ONLY


def _option_entries(help_text: str) -> dict[str, str]:
    """Option name -> its whole entry in `--help` (click starts a long option's help on the next line)."""
    entries: dict[str, str] = {}
    name = None
    for line in help_text.split("Options:", 1)[1].splitlines():
        if line.strip().startswith("-"):
            name = next(word for word in line.replace(",", " ").split() if word.startswith("--"))
            entries[name] = ""
        if name is not None:
            entries[name] += " " + line.strip()
    return entries


@pytest.mark.parametrize("command", ["serve", "run", "watch"])
def test_help_lists_every_flag_with_the_dataclass_default(command):
    result = CliRunner().invoke(cli, [command, "--help"], **WIDE)
    assert result.exit_code == 0, result.output
    lines = _option_entries(result.output)
    expected = SHARED_FLAGS | (SERVE_ONLY if command == "serve" else set())
    assert expected <= set(lines)
    assert not (SERVE_ONLY - expected) & set(lines)
    for item in flag_fields():
        if item.flag.name in expected and item.default is not None and not isinstance(item.default, bool):
            assert f"[default: {item.default}]" in lines[item.flag.name]
    assert "[default: 200]" in lines["--max-file-mb"]  # MiB, as the field's bytes are shown to users
    assert "[default: fifo]" in lines["--scheduling"] and "[fifo|deadline]" in lines["--scheduling"]


def _run_settings(tmp_path, *args: str) -> Settings:
    (tmp_path / "in.jsonl").write_text("")
    ctx = run.make_context("run", [str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out"), *args])
    return from_flags(ctx.params)


def test_defaults_come_from_the_dataclass_and_flags_reach_their_fields(tmp_path, monkeypatch):
    for name in (
        "BULKGEN_STORAGE",
        "BULKGEN_TENANT",
        "AWS_ENDPOINT_URL",
        "RAY_ADDRESS",
        "BULKGEN_ASYNC_SCHEDULING",
    ):
        monkeypatch.delenv(name, raising=False)
    assert _run_settings(tmp_path) == Settings()
    monkeypatch.setenv("BULKGEN_TENANT", "team-x")
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    settings = _run_settings(
        tmp_path,
        *("--max-file-mb", "3", "--max-num-seqs", "8", "--workers", "2", "--worker-poll-deadline", "5"),
        *("--tenant-weight", "a=2", "--model", "m=/models/m", "--scheduling", "deadline", "--lease-ttl", "4"),
        *("--async-scheduling", "off", "--quantize", "fp8"),
        *("--image-url-hosts", "Images.Example,*.cdn.example"),
        *("--image-url-hosts", "other.example", "--max-image-pixels", "1000", "--max-image-mb", "2"),
    )
    assert settings.max_file_bytes == 3 * MIB and settings.models == {"m": "/models/m"}
    assert settings.workers == WorkerSettings(
        ray_address="auto",
        num_workers=2,
        engine_kwargs={"max_num_seqs": 8, "async_scheduling": False, "quantize": "fp8"},
        poll_deadline_s=5.0,
        images=ImageSettings(
            image_url_hosts=("images.example", "*.cdn.example", "other.example"),
            max_image_pixels=1000,
            max_image_bytes=2 * MIB,
        ),
    )
    monkeypatch.setenv("BULKGEN_ASYNC_SCHEDULING", "on")
    assert _run_settings(tmp_path).workers.engine_kwargs == {"async_scheduling": True}
    assert (settings.tenant, settings.tenant_weights) == ("team-x", {"a": 2.0})
    assert (settings.scheduling, settings.lease_ttl_s) == ("deadline", 4.0)


@pytest.mark.parametrize(
    "flag, value, error",
    [
        ("--range-size", "0", "--range-size 0: must be a positive int"),
        ("--max-file-mb", "0", "--max-file-mb 0: must be a positive int"),
        ("--max-requests-per-batch", "-5", "--max-requests-per-batch -5: must be a positive int"),
        ("--workers", "0", "--workers 0: must be a positive int"),
        ("--cpu-workers", "0", "--cpu-workers 0: must be a positive int"),
        ("--max-num-seqs", "0", "--max-num-seqs 0: must be a positive int"),
        (
            "--async-scheduling",
            "maybe",
            "Invalid value for '--async-scheduling': 'maybe' is not a valid boolean",
        ),
        ("--quantize", "int3", "Invalid value for '--quantize': 'int3' is not 'fp8'"),
        (
            "--worker-poll-deadline",
            "0.3",
            "--worker-poll-deadline 0.3: must be over 0.5 s (a healthy poll's wait)",
        ),
        ("--lease-ttl", "0.5", "--lease-ttl 0.5: must be at least 1 second"),
        ("--fair-share-after", "-1", "--fair-share-after -1: must be at least 0"),
        ("--storage-outage-timeout", "0", "--storage-outage-timeout 0: must be over 0 seconds"),
        ("--tenant", "Not A Tenant", "--tenant 'Not A Tenant': tenant name 'Not A Tenant' is not valid"),
        ("--tenant-weight", "a=0", "--tenant-weight 'a=0': the weight of tenant 'a' must be a number > 0"),
        ("--tenant-weight", "a", "--tenant-weight 'a': expected TENANT=W"),
        ("--model", "=x", "--model '=x': expected NAME=PATH"),
        ("--image-url-hosts", "http://x/", "--image-url-hosts 'http://x/': not a host name"),
        ("--max-images-per-line", "0", "--max-images-per-line 0: must be a positive int"),
        (
            "--tensor-parallel",
            "0",
            "--tensor-parallel '0': the rank count must be a whole number of at least 1",
        ),
        (
            "--tensor-parallel",
            "bulkgen-tiny=-2",
            "--tensor-parallel 'bulkgen-tiny=-2': the rank count must be",
        ),
        ("--tensor-parallel", "=2", "--tensor-parallel '=2': expected N or NAME=N"),
        (
            "--reasoning-parser",
            "deepthought",
            "--reasoning-parser 'deepthought': the parser must be one of auto, think, harmony, none",
        ),
        ("--reasoning-parser", "big=think", "--reasoning-parser: no served model is named 'big'"),
        ("--tool-parser", "yaml", "--tool-parser 'yaml': the format must be one of auto, hermes"),
        ("--tool-parser", "big=hermes", "--tool-parser: no served model is named 'big'"),
        ("--chat-template-kwargs", "{nope", "--chat-template-kwargs '{nope': not JSON"),
        (
            "--chat-template-kwargs",
            "bulkgen-tiny=[1]",
            "--chat-template-kwargs 'bulkgen-tiny=[1]': expected a JSON object of the template's options",
        ),
        (
            "--tensor-parallel",
            "big=2",
            "--tensor-parallel: no served model is named 'big' (--model NAME=PATH names them: bulkgen-tiny)",
        ),
    ],
)
def test_a_bad_value_names_its_flag(tmp_path, flag, value, error):
    (tmp_path / "in.jsonl").write_text("")
    args = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out"), "--storage", str(tmp_path / "s")]
    result = CliRunner().invoke(cli, [*args, flag, value])
    assert result.exit_code == 2, result.output
    assert f"Error: {error}" in result.output
    assert not (tmp_path / "s").exists()  # refused before the storage is touched


@pytest.mark.parametrize("command", ["serve", "watch"])
def test_serve_and_watch_check_their_settings_the_same_way(tmp_path, command):
    (tmp_path / "inbox").mkdir()
    # were the flag accepted, each would stop at once: serve on its conflicting key options, watch after one poll
    extra = {
        "serve": ["--api-key", "k", "--api-keys", str(tmp_path / "keys")],
        "watch": ["--input", str(tmp_path / "inbox"), "--output", str(tmp_path / "outbox"), "--once"],
    }[command]
    result = CliRunner().invoke(
        cli, [command, *extra, "--storage", str(tmp_path / "s"), "--worker-poll-deadline", "0.3"]
    )
    assert result.exit_code == 2, result.output
    assert "Error: --worker-poll-deadline 0.3: must be over 0.5 s (a healthy poll's wait)" in result.output


def test_settings_built_in_code_name_the_field():
    with pytest.raises(ValueError, match=r"^range_size 0: must be a positive int$"):
        Settings(range_size=0)
    with pytest.raises(ValueError, match=r"^poll_deadline_s 0.2: must be over 0.5 s"):
        WorkerSettings(poll_deadline_s=0.2)
    with pytest.raises(ValueError, match=r"^max_num_seqs 0: must be a positive int$"):
        WorkerSettings(engine_kwargs={"max_num_seqs": 0})
    with pytest.raises(ValueError, match=r"^tensor_parallel 2: set WorkerSettings.tensor_parallel instead$"):
        WorkerSettings(engine_kwargs={"tensor_parallel": 2})  # one place says a model's ranks


def test_tensor_parallel_is_set_for_every_model_or_per_model_by_name(tmp_path):
    models = ("--model", "big=/models/big", "--model", "small=/models/small", "--model", "mid=/models/mid")
    settings = _run_settings(tmp_path, *models, "--tensor-parallel", "4", "--tensor-parallel", "small=1")
    assert settings.workers.tensor_parallel == {"*": 4, "small": 1}
    assert [settings.workers.ranks_of(m) for m in ("big", "small", "mid")] == [4, 1, 4]
    assert settings.rank_counts() == [1, 4]  # one class of workers per count in use
    settings = _run_settings(tmp_path, *models, "--tensor-parallel", "big=2")
    assert [settings.workers.ranks_of(m) for m in ("big", "small", "mid")] == [2, 1, 1]
    assert settings.rank_counts() == [1, 2]
    assert _run_settings(tmp_path, *models).rank_counts() == [1]
    with pytest.raises(ValueError, match=r"^--tensor-parallel 'big=3': 'big' is given twice$"):
        _run_settings(tmp_path, *models, "--tensor-parallel", "big=2", "--tensor-parallel", "big=3")


def test_serve_alone_takes_refuse_infeasible_into_its_settings():
    assert from_flags(serve.make_context("serve", ["--refuse-infeasible"]).params).refuse_infeasible is True
    assert from_flags(serve.make_context("serve", []).params).refuse_infeasible is False
