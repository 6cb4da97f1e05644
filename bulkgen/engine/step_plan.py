"""One step's work as host data, and the single host-to-device copy of its integer metadata.

The runner turns the scheduled (sequence, tokens) pairs into a StepPlan of plain lists; attention
backends turn the plan into their own metadata. Every integer the device needs this step goes into
one HostPack and crosses to the device in one copy (from a persistent pinned buffer on CUDA,
non-blocking), and the backends slice views out of it: no per-field uploads, no syncs in the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepPlan:
    """Sequences in step order (prefill chunks first, then decodes), as host lists."""

    starts: list[int]  # tokens already in the cache
    counts: list[int]  # tokens computed now
    block_tables: list[list[int]]
    num_prefill: int
    block_size: int
    # the decodes' block tables as rows of the runner's persistent device table (SlotTables): the pack's
    # slice of their row numbers and that table; None: backends build the decodes' tables from block_tables
    decode_rows: slice | None = None
    decode_table: torch.Tensor | None = None
    # per prefill sequence, the [start, end) image blocks its chunk reaches whose tokens attend to each
    # other bidirectionally (image_blocks.step_blocks); None: every query is causal
    image_blocks: list[list[tuple[int, int]]] | None = None

    @property
    def ends(self) -> list[int]:
        return [s + n for s, n in zip(self.starts, self.counts, strict=True)]

    @property
    def num_decode(self) -> int:
        return len(self.starts) - self.num_prefill

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.counts[: self.num_prefill])

    def slots(self, num_seqs: int | None = None) -> list[int]:
        """Cache row (block * block_size + offset) of every token computed now, in step order (of the
        first `num_seqs` sequences only, if given)."""
        bs, out, end = self.block_size, [], len(self.starts) if num_seqs is None else num_seqs
        for start, n, table in zip(
            self.starts[:end], self.counts[:end], self.block_tables[:end], strict=True
        ):
            out.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        return out

    def positions(self) -> list[int]:
        out: list[int] = []
        for start, n in zip(self.starts, self.counts, strict=True):
            out.extend(range(start, start + n))
        return out


class HostPack:
    """Collects int lists, uploads them as one int64 tensor; `add` returns the slice to read back.

    On CUDA the values are staged in two persistent pinned buffers used in turn; a buffer is
    rewritten only after the event recorded behind its last copy has passed (a prefill-only step
    never syncs, so the previous copy may still be queued)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.values: list[int] = []
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._events: list[object | None] = [None, None]
        self._turn = 0

    def add(self, values: list[int]) -> slice:
        start = len(self.values)
        self.values.extend(values)
        return slice(start, len(self.values))

    def upload(self) -> torch.Tensor:
        host = torch.tensor(self.values, dtype=torch.int64)
        self.values = []
        if self.device.type != "cuda":
            return host
        return self._stage(host)

    def _stage(self, host: torch.Tensor) -> torch.Tensor:
        turn = self._turn = 1 - self._turn
        if self._events[turn] is not None:
            self._events[turn].synchronize()
        buf = self._pinned[turn]
        if buf is None or buf.numel() < host.numel():
            buf = self._pinned[turn] = torch.empty(
                max(host.numel(), 1 << 16), dtype=torch.int64, pin_memory=True
            )
        staged = buf[: host.numel()]
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[turn] = event
        return out
