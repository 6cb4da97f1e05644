"""Run the same batch file through the real engine under each scheduling policy, side by side.

This is the simulator's claim checked on the user's own hardware: same model, same requests, same
seeds, a fresh engine per policy, and the batch measures (``BatchMetrics``) for each run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from bulkgen.batch.prepare import split_prompts, tokenize
from bulkgen.batch.requests import (
    CHAT,
    COMPLETIONS,
    Fill,
    LineError,
    NotABatchFile,
    ParsedRequest,
    RequestLine,
)
from bulkgen.batch.schema import InvalidRequest
from bulkgen.metrics.batch import BatchMetrics
from bulkgen.metrics.table import text_table

ENDPOINTS = (CHAT, COMPLETIONS)
# The bench runs every line on the model it is given, so a line may leave body.model out; a line without a
# limit gets a short one, since the point is the policies' timing, not long outputs.
LINE_DEFAULTS = Fill({"model": "bench", "max_tokens": 16})


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
    """An OpenAI batch JSONL read as the workers read it (one parser, one chat template, one tokenizer
    call), its chat and completions lines side by side; a line with several prompts gives one request each."""
    path = Path(path)
    requests: list[BenchRequest] = []
    with path.open("rb") as lines:
        for lineno, raw in enumerate(lines, 1):
            if raw.strip():
                where = f"{path}:{lineno}"
                try:
                    parsed = _parse(raw, lineno, where)
                    requests += [
                        _bench_request(one, tokenizer, len(requests)) for one in split_prompts(parsed)
                    ]
                except LineError as err:
                    raise BenchInputError(f"{where}: {err.message}") from None
    if not requests:
        raise BenchInputError(f"{path}: no requests in the file")
    return requests


def _parse(raw: bytes, lineno: int, where: str) -> ParsedRequest:
    """The line under whichever of the bench's endpoints its url names."""
    try:
        line = RequestLine.read(raw, lineno, None, LINE_DEFAULTS)
    except NotABatchFile:  # no JSON object, or no url: the parser's own words for what is wrong (LineError)
        line = RequestLine.read(raw, lineno, CHAT, LINE_DEFAULTS)
    except InvalidRequest:
        line = None
    if line is None or line.url not in ENDPOINTS:
        raise BenchInputError(f"{where}: url must be one of {', '.join(ENDPOINTS)}")
    return line.request()


def _bench_request(request: ParsedRequest, tokenizer, index: int) -> BenchRequest:
    sampling = request.sampling
    if sampling["max_tokens"] < 1:  # nothing generated: no step a policy could schedule differently
        raise LineError("invalid_parameter", f"body.{request.limit_field} must be >= 1 for a bench run")
    seed = index if sampling["seed"] is None else sampling["seed"]  # every policy draws the same tokens
    return BenchRequest(
        request.custom_id,
        tokenize(request, tokenizer),
        sampling["max_tokens"],
        sampling.get("temperature", 1.0),
        seed,
    )


def run_policy(
    model_path: str | Path,
    requests: list[BenchRequest],
    policy: str,
    max_num_seqs: int,
    ignore_eos: bool = False,
) -> dict:
    """One fresh engine, every request at once; returns the batch summary of the run."""
    from bulkgen.engine import Engine, SamplingParams
    from bulkgen.lab.grouped import scheduler_for

    engine = Engine.from_pretrained(
        str(model_path), max_num_seqs=max_num_seqs, scheduler=scheduler_for(policy)
    )
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
