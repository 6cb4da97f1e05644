"""A real bulkgen service for tests: uvicorn on 127.0.0.1, local Ray, a tiny random model, the openai client.

The service mechanics (cancel, expiry, resume, exact token counts) are tested on a random-weight model: it
almost never samples <|end|>, so max_tokens runs to its end. Tests that need a request still in flight
hold it at the engine gate (held_engine.py) rather than making it long. The trained bundled model (512-token context, stops at <|end|>) is what
`bulkgen run` uses by default; tests/models and the `bulkgen run` tests here check it.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

import uvicorn

from bulkgen.api import create_app
from bulkgen.batch.service import BatchService
from bulkgen.runtime.manager import BatchManager
from bulkgen.settings import Settings, WorkerSettings
from tests.support.wait import wait_until

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
MODEL = "bulkgen-tiny"


@lru_cache(maxsize=1)
def random_model() -> Path:
    """Built once per test session from a config (fixed seed); Ray workers load it from this folder."""
    from bulkgen.lab.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="bulkgen-random-model-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return build_tiny_model(
        root / "model",
        arch="llama",
        seed=1234,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=4096,
    )


# A Hermes-style chat template (what Qwen and Hermes models ship): it renders tool definitions, assistant tool
# calls as <tool_call> JSON and tool results, and takes a reasoning_effort option.
HERMES_TEMPLATE = """{%- if tools %}<|system|>
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|end|>
{% endif %}
{%- if reasoning_effort %}<|system|>
effort: {{ reasoning_effort }}<|end|>
{% endif %}
{%- for m in messages %}<|{{ m['role'] }}|>
{%- if m.tool_calls is defined and m.tool_calls %}
{%- for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>
{%- endfor %}
{%- else %}
{{ m['content'] }}
{%- endif %}<|end|>
{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% endif %}"""
TOOLS_MODEL = "bulkgen-tools"


def tool_model() -> Path:
    """The random model with HERMES_TEMPLATE as its chat template (a copy: the weights are the same)."""
    return model_with_template(HERMES_TEMPLATE)


@lru_cache(maxsize=8)
def model_with_template(template: str) -> Path:
    """A copy of the random model whose tokenizer carries `template` as its chat template."""
    from transformers import AutoTokenizer

    root = Path(tempfile.mkdtemp(prefix="bulkgen-tool-model-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    path = Path(shutil.copytree(random_model(), root / "model"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_process_group(proc) -> None:
    """SIGKILL a process started with start_new_session=True and everything in its group (its local Ray),
    as when a node or pod dies: no shutdown handler runs."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def start_uvicorn(app) -> tuple[uvicorn.Server, threading.Thread, int]:
    """Serve `app` on a free port of 127.0.0.1 in a thread; -> (server, thread, port) once it listens."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "uvicorn to start")
    return server, thread, port


class Service:
    """A running service: its base URL, its storage context, and a way to stop it.

    Services in one process share their workers: Ray runs once per process and worker actors are named, so
    a module's own service takes over the session's (`service` in tests/conftest.py) and its loaded models.
    Stopping one ends only the workers no other running service uses: the session's stay up, loaded, for
    the tests after it instead of being started again (a fresh process that imports torch and loads)."""

    running: ClassVar[list[Service]] = []

    def __init__(
        self, settings: Settings, api_key: str | None = None, keyring=None, on_batch_end=None
    ) -> None:
        self.svc = BatchService(settings, on_batch_end=on_batch_end)
        self.manager = BatchManager(self.svc)
        self.manager.start()
        Service.running.append(self)
        self.server, self.thread, port = start_uvicorn(create_app(self.svc, self.manager, api_key, keyring))
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def client(self, api_key: str = "test-key"):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        if self in Service.running:
            Service.running.remove(self)
        stop_manager(self.manager)
        self.thread.join(10)


def stop_manager(manager: BatchManager) -> None:
    """Stop a test's batch manager and end the workers no running Service uses (see Service)."""
    manager.stop(kill_workers=False)
    manager.pool.shutdown(keep=set().union(*(other.manager.pool.names() for other in Service.running)))


def settings_for(storage: str, **overrides) -> Settings:
    workers = WorkerSettings(
        cpu_workers=overrides.pop("cpu_workers", 1),
        engine_kwargs={"max_num_seqs": 64, "max_num_batched_tokens": 1024},
    )
    models = overrides.pop("models", None) or {MODEL: str(random_model()), TOOLS_MODEL: str(tool_model())}
    return Settings(storage=storage, models=models, range_size=16, workers=workers, **overrides)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def chat_row(custom_id: str, content: str, max_tokens: int = 8, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    }


def completion_row(custom_id: str, prompt: str, max_tokens: int = 8, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body},
    }


def wait_for(client, batch_id: str, predicate, timeout: float = 120.0):
    """The batch, once `predicate(batch)` holds; AssertionError with its last status after `timeout` s."""
    last = []

    def reached():
        last[:] = [client.batches.retrieve(batch_id)]
        return last[0] if predicate(last[0]) else None

    return wait_until(
        reached,
        timeout,
        f"{batch_id}",
        interval=0.1,
        details=lambda: f"{last[0].status} {last[0].request_counts}" if last else "",
    )


def validated(client, batch_id: str, timeout: float = 60.0):
    """A created batch answers `validating`; the runtime then moves it to in_progress or failed."""
    return wait_for(client, batch_id, lambda b: b.status != "validating", timeout)


def wait_done(client, batch_id: str, timeout: float = 120.0):
    terminal = {"completed", "failed", "expired", "cancelled"}
    return wait_for(client, batch_id, lambda b: b.status in terminal, timeout)


def read_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def upload(client, path: Path):
    with path.open("rb") as f:
        return client.files.create(file=(path.name, f), purpose="batch")


def run_bodies(tmp_path: Path, name: str, rows: list[dict], *flags: str) -> dict[str, dict]:
    """`bulkgen run` in this process on `rows` with `flags` (e.g. --model NAME=PATH): each output line's body by
    custom_id, once every line succeeded."""
    from click.testing import CliRunner

    from bulkgen.cli import cli

    out = tmp_path / f"{name}.out.jsonl"
    args = ["run", str(write_jsonl(tmp_path / f"{name}.jsonl", rows)), "--output", str(out)]
    result = CliRunner().invoke(cli, [*args, "--storage", str(tmp_path / "store"), *flags])
    assert result.exit_code == 0, result.output
    assert f"{len(rows)} completed, 0 failed" in result.output, result.output
    return {x["custom_id"]: x["response"]["body"] for x in map(json.loads, out.read_text().splitlines())}
