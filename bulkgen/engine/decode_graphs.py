"""Decode-only steps over static buffers, replayed from CUDA graphs captured per shape bucket.

Each decoding sequence's block table lives in one row of a persistent device tensor (SlotTables), kept
up to date incrementally: a step uploads only the entries appended since the row was last written
(one block per sequence every block_size steps), never the B x W table. A step's own inputs are four
ints per row (token, position, table row, length), staged with any table updates in one HostPack and
copied in one non-blocking upload; the slots its K/V are written to are computed on the device.

The batch size is rounded up to the next of 1, 2, 3, 4, 6, 8, 12, ... (at most 1.5x padding) and each
bucket gets static device buffers and, on CUDA, one graph (the ~1,000 eager kernel launches of a
forward become one replay). With the paged decode kernel (triton, CUDA's default) a bucket depends on
the batch size only: the kernel reads each sequence's real blocks in place whatever the table's width,
so every bucket is captured once, at engine start (what vLLM does), and no capture stalls a step. The
padded-SDPA kernel (CPU, and CUDA without triton) gathers the table's whole width, so there the width
(blocks, rounded the same way) is a second key and buckets are built on first use or by `capture()`.
Padded rows use a padding table row whose blocks are the scratch block past the last real one: they
read and write only it, and their logits are dropped. A hybrid model's rows also carry their state
slot (state_slots.py), a fifth int per row: its recurrent layers gather and scatter the slots by that
device index inside the graph, and padded rows use the scratch slot. On CPU the same path runs eagerly
(`EngineConfig.cuda_graphs=True`), so its padding and table bookkeeping are tested there.

Captures run under inference mode whoever calls them: with autograd on, every captured forward would
keep its graph (and the gathered K/V it saved) alive, hundreds of GB at a 1B model's shapes. A capture
that fails is contained: the original error is logged, that bucket and every later one run eagerly
(a failed capture can leave the CUDA context unusable for further captures), and the step goes on.

Tensor parallel (tensor_parallel.py): every rank captures the same buckets, in the same order, each
forward's collectives inside its graph (NCCL collectives are capturable; the warm-up runs before a
capture are real collectives, so no rank may skip a bucket another captures: after each capture the ranks
agree, and one rank's failure makes every rank run eagerly from then on). Rank 0 picks a step's bucket
(`key`) and its step plan carries it; the followers replay that bucket.
"""

from __future__ import annotations

import logging
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bulkgen.engine.attention import triton_decode
from bulkgen.engine.attention.attn_plain import DecodeMeta, PlainBackend
from bulkgen.engine.attention.interface import LayerCaches, StepContext, attention_scope
from bulkgen.engine.attention.layer_attention import AttnKind
from bulkgen.engine.features.hybrid_layers import StateStep, state_scope
from bulkgen.engine.sequence import Sequence
from bulkgen.engine.step_plan import HostPack

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


def read_pending(ids: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
    """`ids` with each stand-in (sequence.pending_id(row), negative) replaced by `pending[row]`: the
    tokens a step consumes before the host has read them, on the device (no wait)."""
    return torch.where(ids < 0, pending.index_select(0, (-2 - ids).clamp(min=0)), ids)


class SlotTables:
    """Block tables of the decoding sequences as rows of one persistent [groups, rows + 1, width] device
    tensor: a row per sequence, in each KV group's table (kv_layout; the groups' tables of a sequence
    always have one length, so a row's entries are sent for every group at once).

    A sequence keeps its row while it decodes; a row is rewritten from scratch when its sequence's
    tables were replaced (a preemption, an engine reset) and otherwise gets only its new entries (an entry
    a sliding group gave back keeps its old id on the device: no query reads behind its window). When
    every row is taken, the rows of sequences absent from the current step are reclaimed (finished or
    waiting sequences: one that comes back is rewritten). The last row is padding: every entry the
    scratch block."""

    def __init__(self, rows: int, width: int, pad_block: int, device: torch.device, groups: int = 1) -> None:
        self.width, self.pad_row = width, rows
        self.all = torch.full((groups, rows + 1, width), pad_block, dtype=torch.int64, device=device)
        self.table = self.all[0]  # the first group's (a model with one kind of attention has only it)
        self.free = list(range(rows - 1, -1, -1))
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.seq_of: list[int | None] = [None] * rows
        self.owner: list[list[list[int]] | None] = [None] * rows  # the block_tables list the row mirrors
        self.written = [0] * rows  # entries of those tables already on the device

    def rows_for(self, seqs: list[Sequence], index: list[int], values: list[int]) -> list[int]:
        """Each sequence's row, appending (flat index into `all`, block id) of entries the device lacks."""
        rows, width, group_stride = [], self.width, self.all.stride(0)
        for seq in seqs:
            tables = seq.block_tables
            row = self.row_of.get(seq.seq_id)
            if row is None:
                row = self._assign(seq.seq_id, seqs)
            if self.owner[row] is not tables:
                self.owner[row], self.written[row] = tables, 0
            done, length = self.written[row], len(tables[0])
            if length > done:
                for g, table in enumerate(tables):
                    base = g * group_stride + row * width
                    index.extend(range(base + done, base + length))
                    values.extend(table[done:])
                self.written[row] = length
            rows.append(row)
        return rows

    def _assign(self, seq_id: int, step: list[Sequence]) -> int:
        if not self.free:  # reclaim every row whose sequence is not in this step, at once
            present = {s.seq_id for s in step}
            for row, owner in enumerate(self.seq_of):
                if owner is not None and owner not in present:
                    del self.row_of[owner]
                    self.seq_of[row], self.owner[row] = None, None
                    self.free.append(row)
        row = self.free.pop()
        self.row_of[seq_id], self.seq_of[row], self.owner[row] = row, seq_id, None
        return row


@dataclass
class _Bucket:
    batch: int
    width: int  # table columns the forward reads
    buf: (
        torch.Tensor
    )  # device int64 [batch * fields]: token ids, positions, table rows, lengths[, state slots]
    graph: object | None = None
    out: torch.Tensor | None = None

    def views(self):
        b = self.batch
        return tuple(self.buf[i * b : (i + 1) * b] for i in range(self.buf.numel() // b))


class DecodeGraphs:
    def __init__(
        self,
        model,
        caches: LayerCaches,
        kinds: list[AttnKind],
        block_size: int,
        scratch_block: int,
        max_batch: int,
        max_width: int,
        capture: bool,
        decode_kernel: str | None = None,
        tables: SlotTables | None = None,
        states=None,
        agree: Callable[[int], int] | None = None,
    ):
        """`caches`: the model's KV cache as its layers see it; `kinds`: each KV group's attention kind;
        `max_width`: blocks of the longest sequence (max_model_len); `scratch_block`: a block past the
        last real one, which padded rows read and write; `tables`: the runner's, shared with its packed
        path (a sequence keeps its row whichever path its steps take); `states`: a hybrid model's
        state_slots.StatePool; `agree`: a tensor-parallel group's minimum over its ranks (RankGroup.agree_min)."""
        self.model, self.caches, self.kinds = model, caches, kinds
        self.block_size, self.max_batch, self.max_width = block_size, max_batch, max_width
        self.device = caches.k[0].device
        self.use_graphs = capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = None
        self.plain = PlainBackend(decode_kernel)
        self.paged = (decode_kernel or triton_decode.default_kernel(self.device)) == "triton"
        self.tables = tables or SlotTables(max_batch, max_width, scratch_block, self.device, len(kinds))
        self.pack = HostPack(self.device)
        self.states = states
        self.fields = 4 if states is None else 5
        self.agree = agree
        self.replays: Counter[tuple[int, int]] = Counter()  # steps run per bucket (batch, width)

    @torch.inference_mode()
    def capture(self, max_context: int | None = None) -> int:
        """Build (and on CUDA capture) every bucket for contexts up to `max_context` tokens (default: the
        longest), so no capture happens mid-run; returns the number of buckets. With the paged kernel
        that is one bucket per batch size whatever `max_context`."""
        widths = [self.max_width]
        if not self.paged:
            blocks = -(-(max_context or self.max_width * self.block_size) // self.block_size)
            top = bucket(max(blocks, MIN_WIDTH), self.max_width)
            widths = [w for w in buckets_up_to(top) if w >= min(MIN_WIDTH, top)]
        for batch in buckets_up_to(self.max_batch):
            for width in widths:
                self._bucket(batch, width)
        return len(self.buckets)

    def key(self, seqs: list[Sequence]) -> tuple[int, int]:
        """The bucket (batch, width) a decode step of `seqs` runs in."""
        width = self.max_width
        if not self.paged:
            top = max(s.num_computed_tokens for s in seqs) + 1
            width = bucket(max(-(-top // self.block_size), MIN_WIDTH), self.max_width)
        return bucket(len(seqs), self.max_batch), width

    def run(
        self, seqs: list[Sequence], pending: torch.Tensor | None = None, key: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Logits [B, vocab] (float32) of one new token for each of `seqs` (at position
        num_computed_tokens, its blocks already allocated). A token the host has not read yet (a
        sequence.pending_id stand-in) is read on the device from `pending`, the previous step's tokens.
        `key`: the bucket to run in (a tensor-parallel follower's is rank 0's), by default `key(seqs)`."""
        num = len(seqs)
        starts = [s.num_computed_tokens for s in seqs]
        ids = [s.token_ids[p] for s, p in zip(seqs, starts, strict=True)]
        index: list[int] = []
        values: list[int] = []
        rows = self.tables.rows_for(seqs, index, values)
        key = key or self.key(seqs)
        b = self._bucket(*key)
        self.replays[key] += 1
        pad = b.batch - num
        pack = self.pack
        pack.add(ids + [0] * pad)
        pack.add(starts + [0] * pad)
        pack.add(rows + [self.tables.pad_row] * pad)
        pack.add([p + 1 for p in starts] + [1] * pad)
        if self.states is not None:
            pack.add([self.states.slot(s) for s in seqs] + [self.states.scratch] * pad)
        updates = pack.add(index)
        pack.add(values)
        flat = pack.upload()
        b.buf.copy_(flat[: self.fields * b.batch], non_blocking=True)
        if pending is not None:
            ids_view = b.buf[: b.batch]
            ids_view.copy_(read_pending(ids_view, pending))
        if index:
            count = len(index)
            self.tables.all.view(-1).index_copy_(0, flat[updates], flat[updates.stop : updates.stop + count])
        if b.graph is not None:
            b.graph.replay()
            return b.out[:num].float()
        return self._forward(b)[:num].float()

    def _bucket(self, batch: int, width: int) -> _Bucket:
        key = (batch, width)
        if key not in self.buckets:
            buf = torch.zeros(batch * self.fields, dtype=torch.int64, device=self.device)
            b = _Bucket(batch, width, buf)
            _, _, rows, lengths, *slots = b.views()
            rows.fill_(self.tables.pad_row)  # an all-padding step: safe to run while capturing
            lengths.fill_(1)
            if slots:
                slots[0].fill_(self.states.scratch)
            if self.use_graphs:
                self._try_capture(b)
                if self.agree is not None and not self.agree(int(b.graph is not None)):
                    b.graph, b.out, self.use_graphs = None, None, False  # a rank failed: all run eagerly
            self.buckets[key] = b
        return self.buckets[key]

    def _forward(self, b: _Bucket) -> torch.Tensor:
        ids, pos, rows, lengths, *state_slots = b.views()
        bs, slots, metas = self.block_size, [], []
        for group, kind in zip(self.tables.all, self.kinds, strict=True):
            table = group.index_select(0, rows)
            if b.width < table.shape[1]:
                table = table[:, : b.width]
            slots.append(table.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs)
            metas.append(([], DecodeMeta(0, b.batch, table, lengths, kind=kind)))
        ctx = StepContext(slots, self.caches, self.plain, metas, pos)
        states = StateStep(decode_slots=state_slots[0]) if state_slots else None
        with attention_scope(self.model), state_scope(self.states, states):
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
                "decode CUDA graph for batch %d, width %d failed to capture (%s: %s; at %s); decode steps "
                "run eagerly from now on",
                b.batch,
                b.width,
                type(root).__name__,
                root,
                _where(root),
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


def _where(error: BaseException, frames: int = 4) -> str:
    """The innermost `frames` of `error`'s traceback, innermost first ("file.py:12 fn <- ..."): where in
    the forward a capture broke (a host copy in a model's or a kernel's Python code, say)."""
    stack = traceback.extract_tb(error.__traceback__)[-frames:]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack)) or "?"
