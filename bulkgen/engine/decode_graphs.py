"""Decode-only steps over static buffers, replayed from CUDA graphs captured per shape bucket.

A decode step's shapes depend only on its batch size and the widest block table, so both are rounded
up to the next of 1, 2, 3, 4, 6, 8, 12, ... (at most 1.5x padding) and each (batch, width) bucket
gets static device buffers and, on CUDA, one graph, captured on first use or ahead by `capture()`
(the ~1,000 eager kernel launches of a forward become one replay). Padded rows read block 0 and
write their K/V to a scratch slot past the last real block; their logits are dropped. The step's
integers are staged in a pinned host buffer and copied in one non-blocking copy. On CPU the same
path runs eagerly (`EngineConfig.cuda_graphs=True`), so its padding is tested there. Decode
attention inside graphs is the engine's probed decode kernel: the triton paged kernel on CUDA (it reads
only each sequence's real blocks, so a wide bucket costs table entries, not attention work), else the
padded SDPA (static shapes, float32 score accumulation).

Captures run under inference mode whoever calls them: with autograd on, every captured forward would
keep its graph (and the gathered K/V it saved) alive, hundreds of GB at a 1B model's shapes. A capture
that fails is contained: the original error is logged, that bucket and every later one run eagerly
(a failed capture can leave the CUDA context unusable for further captures), and the step goes on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .attention import StepContext, attention_scope
from .attn_backends import DecodeMeta, PlainBackend
from .step_plan import StepPlan

log = logging.getLogger(__name__)
MIN_WIDTH = 4


def bucket(n: int, limit: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... that is >= n, capped at `limit` (itself >= n)."""
    power = 1 << max(0, n - 1).bit_length()
    return min(power * 3 // 4 if power >= 4 and power * 3 // 4 >= n else power, limit)


def buckets_up_to(limit: int) -> list[int]:
    sizes, n = [], 1
    while True:
        size = bucket(n, limit)
        sizes.append(size)
        if size >= limit:
            return sizes
        n = size + 1


@dataclass
class _Bucket:
    batch: int
    width: int
    buf: torch.Tensor  # device int64 [batch * (4 + width)]: ids, positions, slots, lengths, table
    staging: torch.Tensor  # host (pinned on CUDA) twin of buf
    graph: object | None = None
    out: torch.Tensor | None = None
    copied: object | None = None  # CUDA event behind the last staging copy

    def views(self):
        b = self.batch
        ids, pos, slots, lengths = (self.buf[i * b : (i + 1) * b] for i in range(4))
        return ids, pos, slots, lengths, self.buf[4 * b :].view(b, self.width)


class DecodeGraphs:
    def __init__(
        self,
        model,
        k_caches,
        v_caches,
        block_size: int,
        scratch_slot: int,
        max_batch: int,
        max_width: int,
        capture: bool,
        decode_kernel: str | None = None,
    ):
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self.block_size, self.scratch_slot = block_size, scratch_slot
        self.max_batch, self.max_width = max_batch, max_width
        self.device = k_caches[0].device
        self.use_graphs = capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = None
        self.plain = PlainBackend(decode_kernel)

    @torch.inference_mode()
    def capture(self, max_context: int) -> int:
        """Build (and on CUDA capture) every bucket for contexts up to `max_context` tokens, so no
        capture happens mid-run (what vLLM does at startup); returns the number of buckets."""
        top = bucket(max(-(-max_context // self.block_size), MIN_WIDTH), self.max_width)
        widths = [w for w in buckets_up_to(top) if w >= MIN_WIDTH]
        for batch in buckets_up_to(self.max_batch):
            for width in widths:
                self._bucket(batch, width)
        return len(self.buckets)

    def run(self, plan: StepPlan, ids: list[int]) -> torch.Tensor:
        """Logits [B, vocab] (float32) of a decode-only plan."""
        num = len(ids)
        width = max(-(-(s + 1) // self.block_size) for s in plan.starts)
        b = self._bucket(bucket(num, self.max_batch), bucket(max(width, MIN_WIDTH), self.max_width))
        if b.copied is not None:
            b.copied.synchronize()  # the staging buffer's previous copy has left it
        self._stage(b, plan, ids)
        b.buf.copy_(b.staging, non_blocking=True)
        if self.device.type == "cuda":
            b.copied = torch.cuda.Event()
            b.copied.record()
        if b.graph is not None:
            b.graph.replay()
            return b.out[:num].float()
        return self._forward(b)[:num].float()

    def _stage(self, b: _Bucket, plan: StepPlan, ids: list[int]) -> None:
        num, bs = len(ids), self.block_size
        lengths = [s + 1 for s in plan.starts]
        table = []
        for t, n in zip(plan.block_tables, lengths, strict=True):
            used = t[: -(-n // bs)]
            table.extend(used + [0] * (b.width - len(used)))
        pad = b.batch - num
        values = (
            ids
            + [0] * pad
            + plan.starts
            + [0] * pad
            + plan.slots()
            + [self.scratch_slot] * pad
            + lengths
            + [1] * pad
            + table
            + [0] * (pad * b.width)
        )
        b.staging.copy_(torch.tensor(values, dtype=torch.int64))

    def _bucket(self, batch: int, width: int) -> _Bucket:
        key = (batch, width)
        if key not in self.buckets:
            size = batch * (4 + width)
            pinned = self.device.type == "cuda"
            b = _Bucket(
                batch,
                width,
                torch.zeros(size, dtype=torch.int64, device=self.device),
                torch.zeros(size, dtype=torch.int64, pin_memory=pinned),
            )
            _, _, slots, lengths, _ = b.views()
            slots.fill_(self.scratch_slot)  # an all-padding step: safe to run while capturing
            lengths.fill_(1)
            if self.use_graphs:
                self._try_capture(b)
            self.buckets[key] = b
        return self.buckets[key]

    def _forward(self, b: _Bucket) -> torch.Tensor:
        ids, pos, slots, lengths, table = b.views()
        meta = ([], DecodeMeta(0, b.batch, table, lengths))
        ctx = StepContext(slots, self.k_caches, self.v_caches, self.plain, meta)
        with attention_scope(self.model):
            out = self.model(
                input_ids=ids[None],
                position_ids=pos[None],
                use_cache=False,
                bulkgen_ctx=ctx,
                logits_to_keep=0,
            )
        return out.logits[0]

    def _try_capture(self, b: _Bucket) -> None:
        """Capture `b`, or leave it eager (and stop capturing) with the root cause in the log."""
        failure: list[BaseException] = []
        try:
            self._capture(b, failure)
        except Exception as exc:  # noqa: BLE001 - any capture failure: this bucket runs eagerly
            root = failure[0] if failure else exc
            log.error(
                "decode CUDA graph for batch %d, width %d failed to capture (%s: %s); decode steps run "
                "eagerly from now on",
                b.batch,
                b.width,
                type(root).__name__,
                root,
            )
            b.graph, b.out, self.use_graphs = None, None, False

    @torch.inference_mode()
    def _capture(self, b: _Bucket, failure: list[BaseException]) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            try:
                b.out = self._forward(b)
            except BaseException as exc:  # graph.__exit__ raises its own error over this one: keep it
                failure.append(exc)
                raise
        self.pool = graph.pool()
        b.graph = graph
