"""Runs one packed forward pass: flat tokens in, logits for each sequence's last scheduled token out."""

from __future__ import annotations

import torch

from .attention import ATTN_IMPLEMENTATION, DecodeBatch, PrefillSegment, StepContext
from .config import EngineConfig
from .sequence import Sequence

CPU_KV_CAP_BYTES = 2 << 30


class ModelRunner:
    """Owns the paged KV cache and turns a scheduled batch into one call of the HF base model."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, max_model_len: int):
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        _check_supported(model)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"{type(model).__name__} does not route attention through transformers' AttentionInterface; "
                "bulkgen cannot run it"
            )
        hf = model.config
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.block_size = config.block_size
        self.num_blocks = self._num_blocks(max_model_len)
        shape = (self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def _num_blocks(self, max_model_len: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        block_bytes = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        block_bytes *= torch.empty((), dtype=self.dtype).element_size()
        if cfg.kv_cache_bytes is not None:
            budget = cfg.kv_cache_bytes
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cfg.kv_cache_memory_fraction)
        else:
            want = cfg.max_num_seqs * -(-max_model_len // self.block_size) * block_bytes
            budget = min(want, CPU_KV_CAP_BYTES)
        num = budget // block_bytes
        if num < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {block_bytes} bytes")
        return int(num)

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Forward the scheduled (sequence, num_new_tokens) pairs; return float32 logits for sequences
        whose scheduled tokens reach their end (they sample now), in that order."""
        input_ids, positions, ctx, rows, sampling = self._prepare(batch)
        if not rows:  # only prefill chunks: the base model fills the cache, no logits needed
            self.model.get_decoder()(input_ids=input_ids, position_ids=positions, use_cache=False, bulkgen_ctx=ctx)
            return torch.empty(0), []
        keep = torch.tensor(rows, device=self.device)  # lm_head (and any logit scaling) on these rows only
        out = self.model(
            input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep, bulkgen_ctx=ctx
        )
        return out.logits[0].float(), sampling

    def _prepare(self, batch: list[tuple[Sequence, int]]):
        """Build the flat row and all attention metadata once per step: prefill chunks first, then decodes."""
        prefill = [(s, n) for s, n in batch if not (n == 1 and s.num_computed_tokens > 0)]
        decode = [(s, n) for s, n in batch if n == 1 and s.num_computed_tokens > 0]
        ordered = prefill + decode
        starts = [s.num_computed_tokens for s, _ in ordered]
        counts = [n for _, n in ordered]
        ids: list[int] = []
        for (seq, n), start in zip(ordered, starts, strict=True):
            ids.extend(seq.token_ids[start : start + n])
        tables = _block_tables(ordered, self.device)
        tok_seq, tok_pos = _ranges(starts, counts, self.device)
        bs = self.block_size
        ctx = StepContext(
            write_rows=self._write_rows(tables[tok_seq, tok_pos // bs], tok_pos % bs),
            k_caches=self.k_caches,
            v_caches=self.v_caches,
        )
        rows, sampling, q_off = [], [], 0
        for i, (seq, n) in enumerate(ordered):
            if i < len(prefill):
                ctx.prefills.append(self._segment(seq, q_off, n, starts[i]))
            if starts[i] + n == len(seq):
                rows.append(q_off + n - 1)
                sampling.append(seq)
            q_off += n
        if decode:
            ctx.decode = self._decode_batch([s for s, _ in decode], q_off - len(decode), q_off)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        return input_ids, tok_pos.unsqueeze(0), ctx, rows, sampling

    def _write_rows(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Row of each (token, kv head) in the cache viewed as [-1, head_dim], token-major."""
        heads = torch.arange(self.num_kv_heads, device=self.device)
        rows = (blocks[:, None] * self.num_kv_heads + heads[None, :]) * self.block_size + offsets[:, None]
        return rows.reshape(-1)

    def _segment(self, seq: Sequence, q_off: int, n: int, start: int) -> PrefillSegment:
        if start == 0:
            return PrefillSegment(q_off, q_off + n)
        end = start + n
        blocks = torch.tensor(seq.block_table[: -(-end // self.block_size)], device=self.device)
        q_pos = torch.arange(start, end, device=self.device)
        mask = torch.arange(end, device=self.device)[None, :] <= q_pos[:, None]
        return PrefillSegment(q_off, q_off + n, blocks, end, mask)

    def _decode_batch(self, seqs: list[Sequence], start: int, end: int) -> DecodeBatch:
        bs = self.block_size
        lengths = [s.num_computed_tokens + 1 for s in seqs]
        counts = [-(-n // bs) for n in lengths]
        blocks: list[int] = []
        for seq, count in zip(seqs, counts, strict=True):
            blocks.extend(seq.block_table[:count])
        counts_t = torch.tensor(counts, device=self.device)
        owner = torch.repeat_interleave(torch.arange(len(seqs), device=self.device), counts_t)
        valid = torch.full((len(blocks),), bs, device=self.device)
        last = torch.cumsum(counts_t, 0) - 1
        valid[last] = torch.tensor(lengths, device=self.device) - (counts_t - 1) * bs
        pad = torch.arange(bs, device=self.device)[None, :] >= valid[:, None]
        return DecodeBatch(start, end, torch.tensor(blocks, device=self.device), owner, pad)


def _check_supported(model: torch.nn.Module) -> None:
    """Refuse hybrid models: their recurrent/conv layers would mix the sequences of a packed row."""
    layer_types = getattr(model.config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        raise ValueError(f"{type(model).__name__} has non-attention layers {other}; bulkgen packs attention only")


def _block_tables(batch: list[tuple[Sequence, int]], device: torch.device) -> torch.Tensor:
    """[B, max_blocks] block ids (metadata only; rows are padded with 0 and never read past their length)."""
    width = max(len(s.block_table) for s, _ in batch)
    return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s, _ in batch], device=device)


def _ranges(starts: list[int], counts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated ranges [start, start+count) as (owner index, value) tensors, without a Python loop per item."""
    counts_t = torch.tensor(counts, device=device)
    owner = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t)
    offsets = torch.cumsum(counts_t, 0) - counts_t
    base = torch.tensor(starts, device=device) - offsets
    return owner, torch.arange(int(counts_t.sum()), device=device) + base[owner]
