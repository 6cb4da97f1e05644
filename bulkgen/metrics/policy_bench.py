"""Run the same batch file through the real engine under each scheduling policy, side by side.

This is the simulator's claim checked on the user's own hardware: same model, same requests, same
seeds, a fresh engine per policy, and the batch measures (``BatchMetrics``) for each run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from bulkgen.metrics.batch import BatchMetrics
from bulkgen.metrics.table import text_table

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
DEFAULT_MAX_TOKENS = 16


class BenchInputError(ValueError):
    """A bad batch file line or option; the message names the file, line and field."""


@dataclass(frozen=True)
class BenchRequest:
    custom_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int


def load_requests(path: str | Path, tokenizer) -> list[BenchRequest]:
    """Parse an OpenAI batch JSONL into token-id prompts (chat messages go through the chat template)."""
    path = Path(path)
    requests = []
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, 1):
            if line.strip():
                requests.append(_parse_line(line, f"{path}:{lineno}", tokenizer, len(requests)))
    if not requests:
        raise BenchInputError(f"{path}: no requests in the file")
    return requests


def _parse_line(line: str, where: str, tokenizer, index: int) -> BenchRequest:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BenchInputError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(item, dict) or not isinstance(item.get("body"), dict):
        raise BenchInputError(f"{where}: each line must be an object with a 'body' object")
    url, body = item.get("url"), item["body"]
    if url not in ENDPOINTS:
        raise BenchInputError(f"{where}: url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    if url == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BenchInputError(f"{where}: body.messages must be a non-empty list")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise BenchInputError(f"{where}: body.prompt must be a non-empty string")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BenchInputError(f"{where}: body.max_tokens must be an integer >= 1, got {max_tokens!r}")
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature < 0:
        raise BenchInputError(f"{where}: body.temperature must be a number >= 0, got {temperature!r}")
    seed = body.get("seed", index)
    custom_id = str(item.get("custom_id", f"request-{index}"))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return BenchRequest(custom_id, list(ids), max_tokens, float(temperature), int(seed))


def run_policy(
    model_path: str | Path,
    requests: list[BenchRequest],
    policy: str,
    max_num_seqs: int,
    ignore_eos: bool = False,
) -> dict:
    """One fresh engine, every request at once; returns the batch summary of the run."""
    from bulkgen.engine import Engine, SamplingParams

    engine = Engine.from_pretrained(str(model_path), max_num_seqs=max_num_seqs, policy=policy)
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed, ignore_eos=ignore_eos)
        for r in requests
    ]
    started = time.perf_counter()
    outputs = engine.generate([r.prompt_ids for r in requests], params)
    wall = time.perf_counter() - started
    metrics = BatchMetrics()
    for out in outputs:
        metrics.add_request(out.metrics.as_dict())
    metrics.add_steps("engine", engine.pop_step_records())
    metrics.add_prefill_padding(engine.stats()["prefill_padding_tokens"])
    return {"policy": policy, **metrics.summary(wall_time_s=wall)}


def warm_up(model_path: str | Path, requests: list[BenchRequest]) -> None:
    """Pay one-off costs (imports, kernel selection, allocator growth) before anything is timed,
    so the first policy measured is not penalised."""
    from bulkgen.engine import Engine, SamplingParams

    engine = Engine.from_pretrained(str(model_path), max_num_seqs=2)
    engine.generate([requests[0].prompt_ids], SamplingParams(max_tokens=2, temperature=0.0))


def compare_policies(
    model_path: str | Path,
    batch_file: str | Path,
    policies: list[str],
    max_num_seqs: int = 64,
    ignore_eos: bool = False,
) -> list[dict]:
    """Summaries per policy, each with ``speedup_vs_static`` (wall-time ratio) when static ran."""
    from transformers import AutoTokenizer

    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise BenchInputError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    requests = load_requests(batch_file, tokenizer)
    warm_up(model_path, requests)
    rows = [run_policy(model_path, requests, policy, max_num_seqs, ignore_eos) for policy in policies]
    static = next((row for row in rows if row["policy"] == "static"), None)
    for row in rows:
        row["speedup_vs_static"] = (
            round(static["wall_time_s"] / row["wall_time_s"], 3)
            if static and row["wall_time_s"] > 0
            else None
        )
    return rows


def format_comparison(rows: list[dict]) -> str:
    """One table: a row per policy, the columns a reader compares."""
    header = [
        "policy",
        "wall s",
        "out tok/s",
        "slot eff",
        "pad dec %",
        "pad pre %",
        "TTFT p50 ms",
        "TTFT p95 ms",
        "TPOT p50 ms",
        "TPOT p95 ms",
        "vs static",
    ]
    table = [header] + [
        [
            row["policy"],
            _fmt(row["wall_time_s"], "{:.2f}"),
            _fmt(row["output_tokens_per_s"], "{:.1f}"),
            _fmt(row["slot_efficiency"], "{:.3f}"),
            _fmt(row["decode_padding_pct"], "{:.1f}"),
            _fmt(row["prefill_padding_pct"], "{:.1f}"),
            _ms(row["ttft_s"]["p50"]),
            _ms(row["ttft_s"]["p95"]),
            _ms(row["tpot_s"]["p50"]),
            _ms(row["tpot_s"]["p95"]),
            _fmt(row.get("speedup_vs_static"), "{:.2f}x"),
        ]
        for row in rows
    ]
    return text_table(table)


def _fmt(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}"
