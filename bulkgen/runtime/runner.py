"""One runner per batch: stream its requests to the worker pool, checkpoint results, finalize.

Runs in the Ray driver (the service process, or `bulkgen run`). Everything it needs to resume lives in
object storage: the batch record, the chunk plan and the result parts, so a runner that died is
resumed by another, which skips the chunks already written.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque

from bulkgen.batch.responses import not_run_line
from bulkgen.batch.schema import TERMINAL_STATUSES
from bulkgen.config import Context
from bulkgen.metrics import BatchMetrics
from bulkgen.runtime import parts
from bulkgen.runtime.dispatch import Dispatcher
from bulkgen.runtime.finalize import finalize
from bulkgen.runtime.prepare import make_plan, plan_from_bytes, plan_to_bytes, prepare
from bulkgen.store import NotFound

log = logging.getLogger(__name__)


class BatchRunner:
    def __init__(self, ctx: Context, pool, batch_id: str) -> None:
        self.ctx, self.pool, self.batch_id = ctx, pool, batch_id
        self.metrics = self._load_metrics()

    def run(self) -> dict:
        s = self.ctx.settings
        record = self.ctx.validate(self.batch_id)
        if record["status"] in TERMINAL_STATUSES:
            return record
        stop = self.stop_reason(record)
        if record["status"] == "finalizing" or (stop and record["request_counts"]["total"] == 0):
            return finalize(self.ctx, self.batch_id, stop, self.metrics)
        model_name = record["model"]
        model_path = s.models[model_name]
        tokenizer, max_model_len = _tokenizer(model_path, s.endpoint_url)
        items, refused = prepare(self.ctx.files.iter_lines(record["input_file_id"]), record["endpoint"],
                                 tokenizer, max_model_len)
        chunks = self._plan(items)
        index = parts.read_index(self.ctx.store, self.batch_id)
        if parts.REFUSED_CHUNK not in index.done:
            entries = [parts.entry(line, False, env) for line, env in sorted(refused.items())]
            parts.write_part(self.ctx.store, self.batch_id, parts.REFUSED_CHUNK, entries)
            for e in entries:
                index.tally.add(e)
        todo = deque(i for i in range(len(chunks)) if i not in index.done)
        if todo and not stop:
            self.pool.load(model_name, model_path, s.endpoint_url)
            dispatcher = Dispatcher(self, chunks, items, index.tally, model_name)
            stop = dispatcher.run(todo)
        if stop:
            self._write_not_run(chunks, todo, items, stop, index.tally)
        return finalize(self.ctx, self.batch_id, stop, self.metrics)

    def stop_reason(self, record: dict | None = None) -> str | None:
        """'batch_cancelled' or 'batch_expired' when the batch must stop now, else None."""
        record = record or self.ctx.batches.get(self.batch_id)
        if record["status"] == "cancelling":
            return "batch_cancelled"
        if time.time() >= record["expires_at"]:
            return "batch_expired"
        return None

    def publish(self, tally: parts.Tally, save_metrics: bool = False) -> dict:
        """Keep request_counts, usage and metrics current on the batch record."""
        summary = self.metrics.summary() if self.metrics.totals["requests"] else None
        if save_metrics:  # so a resumed runner reports the whole batch, not just its own part
            self.ctx.store.write_bytes(self._metrics_key, json.dumps(self.metrics.to_state()).encode())

        def apply(r: dict) -> dict:
            tally.apply(r)
            r["metrics"] = summary or r.get("metrics")
            return r

        return self.ctx.batches.update(self.batch_id, apply)

    @property
    def _metrics_key(self) -> str:
        return f"parts/{self.batch_id}/metrics-state.json"

    def _load_metrics(self) -> BatchMetrics:
        try:
            return BatchMetrics.from_state(json.loads(self.ctx.store.read_bytes(self._metrics_key)))
        except NotFound:
            return BatchMetrics()

    def _plan(self, items) -> list[list[int]]:
        key = f"parts/{self.batch_id}/plan.json"
        try:
            return plan_from_bytes(self.ctx.store.read_bytes(key))
        except NotFound:
            chunks = make_plan(items, self.ctx.settings.chunk_size)
            self.ctx.store.write_bytes(key, plan_to_bytes(chunks))
            return chunks

    def _write_not_run(self, chunks, todo, items, code: str, tally: parts.Tally) -> None:
        """Chunks never finished: whatever did finish is already in their parts; the rest go to errors."""
        for chunk in todo:
            entries = [parts.entry(line, False, not_run_line(items[line].request.custom_id, code))
                       for line in chunks[chunk]]
            parts.write_part(self.ctx.store, self.batch_id, chunk, entries)
            for e in entries:
                tally.add(e)
        self.publish(tally)


def _tokenizer(model_path: str, endpoint_url: str | None):
    from transformers import AutoConfig, AutoTokenizer

    from bulkgen.models.registry import resolve_model_path

    local = resolve_model_path(model_path, endpoint_url=endpoint_url)
    config = AutoConfig.from_pretrained(local)
    return AutoTokenizer.from_pretrained(local), int(getattr(config, "max_position_embeddings", 2048))
