"""Runs one packed forward pass: flat tokens in, logits for each sequence's last scheduled token out.

Logits are computed only where they are used: the last token of each sequence that samples now, and,
for a prompt_logprobs request, every prompt position of its prefill chunks (the request never takes
cached prefix blocks until they are all scored, since a cached prefix is never computed)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .attention import ATTN_IMPLEMENTATION, StepContext, attention_scope
from .attn_select import select_backend
from .config import EngineConfig
from .decode_graphs import DecodeGraphs, SlotTables, read_pending
from .hybrid_layers import (
    CHECKED_MIXERS,
    StateStep,
    attention_layers,
    find_mixers,
    probe_states,
    state_scope,
    wrap_mixers,
)
from .sequence import Sequence
from .state_slots import StatePool
from .step_plan import HostPack, StepPlan

CPU_KV_CAP_BYTES = 2 << 30
KV_HEADROOM = 1.25  # blocks beyond what max_num_seqs full contexts use: kept prefixes of finished requests


def kv_cache_blocks(
    cfg: EngineConfig, device: torch.device, block_bytes: int, max_model_len: int, reserved: int = 0
) -> int:
    """Blocks of the paged KV cache: what `max_num_seqs` full-length sequences can ever use (plus
    headroom for cached prefixes), within the budget. On CUDA the budget is a fraction of the memory
    free to this process: the device's free memory plus what torch's allocator holds unused (an earlier
    engine's freed cache stays reserved there). A tiny model on a big GPU gets the blocks it can use,
    not millions it never touches. `reserved`: bytes of the budget already taken (hybrid state slots)."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    full = cfg.max_num_seqs * -(-max_model_len // cfg.block_size)  # every slot at full context
    if cfg.kv_cache_bytes is not None:  # the user's budget, as given
        usable, budget = None, cfg.kv_cache_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        usable, budget = int(full * KV_HEADROOM), int((free + idle) * cfg.kv_cache_memory_fraction)
    else:
        usable, budget = full, CPU_KV_CAP_BYTES
    budget -= reserved
    num = budget // block_bytes if usable is None else min(usable, budget // block_bytes)
    if num < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {block_bytes} bytes")
    return int(num)


def kv_block_bytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across the layers that have attention (K and V)."""
    return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class StepLogits:
    """One forward's logits and what each row is for."""

    logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # float32 [rows, vocab]
    sampling: list[Sequence] = field(default_factory=list)  # they sample now: the first len(sampling) rows
    # (sequence, first position, count): the following rows, in order, are those positions' logits
    prompt_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)
    prefilled: list[Sequence] = field(default_factory=list)  # max_tokens 0: prompt done, nothing to sample
    pooled: list[Sequence] = field(default_factory=list)  # embedding sequences computed in this step
    # (query offset, tokens, start position, reaches the end) of each pooled chunk, as pooling.chunk_pools takes
    pool_spans: list[tuple[int, int, int, bool]] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # final hidden states [tokens, hidden] when anything is pooled


class ModelRunner:
    """Owns the paged KV cache and turns a scheduled batch into one call of the HF model."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, max_model_len: int):
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        _check_supported(model)
        hf = model.config
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.block_size = config.block_size
        self.states = self._state_pool()  # hybrid models' recurrent state: None otherwise
        self.backend = select_backend(
            self.device, self.dtype, hf.num_attention_heads, self.num_kv_heads, self.head_dim, self.block_size
        )
        self.num_blocks = self._num_blocks(max_model_len)
        shape = (self.num_blocks + 1, self.block_size, self.num_kv_heads, self.head_dim)  # + a scratch block
        self.k_caches = [self._kv_cache(i, shape) for i in range(self.num_layers)]
        self.v_caches = [self._kv_cache(i, shape) for i in range(self.num_layers)]
        self.pack = HostPack(self.device)
        # decoding sequences' block tables, one persistent device row each (decode-graph and packed steps)
        self.tables = SlotTables(
            config.max_num_seqs, -(-max_model_len // self.block_size), self.num_blocks, self.device
        )
        self.graphs = self._decode_graphs(max_model_len)

    def _decode_graphs(self, max_model_len: int) -> DecodeGraphs | None:
        on_cuda = self.device.type == "cuda"
        wanted = self.config.cuda_graphs
        if not (wanted or (wanted is None and on_cuda)):
            return None
        graphs = DecodeGraphs(
            self.model,
            self.k_caches,
            self.v_caches,
            self.block_size,
            self.num_blocks,
            self.config.max_num_seqs,
            -(-max_model_len // self.block_size),
            capture=on_cuda,
            decode_kernel=getattr(self.backend, "decode_kernel", None),
            tables=self.tables,
            states=self.states,
        )
        if on_cuda and graphs.paged:  # one graph per batch size: all captured now, none mid-run
            graphs.capture()
        return graphs

    def _num_blocks(self, max_model_len: int) -> int:
        block_bytes = kv_block_bytes(
            len(self.kv_layers), self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )
        reserved = 0 if self.states is None else self.states.bytes_per_slot * (self.states.num_slots + 1)
        return kv_cache_blocks(self.config, self.device, block_bytes, max_model_len, reserved)

    def _kv_cache(self, layer: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A layer's paged K or V cache; an empty tensor for a layer without attention (a hybrid's
        recurrent layers keep their state in slots instead)."""
        if layer not in self.kv_layers:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _state_pool(self) -> StatePool | None:
        """Hybrid models: one state slot per running sequence (`num_state_slots`, default `max_num_seqs`),
        reserved from the cache budget before KV blocks; every layer with attention gets KV blocks."""
        mixers = find_mixers(self.model)
        self.kv_layers = attention_layers(self.model) if mixers else set(range(self.num_layers))
        if not mixers:
            return None
        pool = StatePool(
            probe_states(mixers, self.model.config.hidden_size),
            self.config.num_state_slots or self.config.max_num_seqs,
            self.device,
        )
        wrap_mixers(mixers, pool)
        return pool

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]], pending: torch.Tensor | None = None) -> StepLogits:
        """Forward the scheduled (sequence, num_new_tokens) pairs; return float32 logits for sequences
        whose scheduled tokens reach their end (they sample now), then for the prompt positions of
        prompt-logprob prefills (see StepLogits). Changes no sequence (a hybrid model's state slots
        advance with the forward: state_slots.py). `pending`: the previous step's sampled tokens on the
        device, where stand-ins for tokens the host has not read (sequence.pending_id) are looked up."""
        if self.states is None:
            return self._run(batch, pending)
        self.states.begin(batch)
        step = self._run(batch, pending)
        self.states.commit(batch)
        return step

    def _run(self, batch: list[tuple[Sequence, int]], pending: torch.Tensor | None) -> StepLogits:
        ordered, plan = self._plan(batch)
        step, rows = self._rows(ordered)
        if self.graphs is not None and not plan.num_prefill and not step.pooled:
            # one row per sequence: row = query offset
            logits = self.graphs.run([s for s, _ in ordered], pending)
            if len(rows) != len(ordered) or step.prompt_spans:  # 1-token prefill chunks ride along
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            step.logits = logits
            return step
        tokens = [t for seq, n in ordered for t in seq.token_ids[seq.num_computed_tokens :][:n]]
        pack = self.pack
        ids = pack.add(tokens)
        positions = pack.add(plan.positions())
        # decodes read their block tables from the persistent device rows (only new entries travel) and
        # get their cache slots there; prefill chunks' slots come from the host
        on_device = plan.num_decode and getattr(self.backend, "device_decode_tables", False)
        updates: list[int] = []
        values: list[int] = []
        if on_device:
            decoding = [s for s, _ in ordered[plan.num_prefill :]]
            plan.decode_rows = pack.add(self.tables.rows_for(decoding, updates, values))
            plan.decode_table = self.tables.table
        slots = pack.add(plan.slots(plan.num_prefill if on_device else None))
        at = pack.add(updates)
        pack.add(values)
        keep = pack.add(rows)
        states, state_slots = self._state_step(ordered, plan.num_prefill)
        decode_slots = pack.add(state_slots)
        meta = self.backend.prepare(plan, pack)
        flat = pack.upload()
        slot_rows = flat[slots]
        if on_device:
            if updates:
                self.tables.table.view(-1).index_copy_(0, flat[at], flat[at.stop : at.stop + len(updates)])
            pos = flat[positions][plan.num_prefill_tokens :]
            table_rows = flat[plan.decode_rows]
            bs = self.block_size
            slot_rows = torch.cat([slot_rows, self.tables.table[table_rows, pos // bs] * bs + pos % bs])
        ctx = StepContext(
            slot_rows, self.k_caches, self.v_caches, self.backend, self.backend.bind(meta, flat)
        )
        input_ids = flat[ids] if pending is None else read_pending(flat[ids], pending)
        kwargs = dict(
            input_ids=input_ids[None], position_ids=flat[positions][None], use_cache=False, bulkgen_ctx=ctx
        )
        if states is not None:
            states.decode_slots = flat[decode_slots] if state_slots else None
        with attention_scope(self.model), _capture_hidden(self.model, step), state_scope(self.states, states):
            if not rows:  # only prefill chunks: the base model fills the cache, no logits needed
                self.model.get_decoder()(**kwargs)
                return step
            out = self.model(logits_to_keep=flat[keep], **kwargs)  # lm_head on the kept rows only
        step.logits = out.logits[0].float()
        return step

    def _state_step(
        self, ordered: list[tuple[Sequence, int]], num_prefill: int
    ) -> tuple[StateStep | None, list[int]]:
        """A hybrid model's StateStep for the packed row (its decode slots still to be read from the
        upload) and the decodes' slots to upload; (None, []) for a pure transformer."""
        if self.states is None:
            return None, []
        slot_of, step, q_off = self.states.slot_of, StateStep(), 0
        for seq, n in ordered[:num_prefill]:
            step.prefill.append((q_off, n, slot_of[seq.seq_id], seq.num_computed_tokens > 0))
            q_off += n
        step.decode_start = q_off
        return step, [slot_of[seq.seq_id] for seq, _ in ordered[num_prefill:]]

    def _rows(self, ordered: list[tuple[Sequence, int]]) -> tuple[StepLogits, list[int]]:
        """Which query rows need logits: sampling rows first, then prompt-logprob rows."""
        step, rows, prompt_rows, q_off = StepLogits(), [], [], 0
        for seq, n in ordered:
            start = seq.num_computed_tokens
            if seq.needs_prompt_logprobs:
                # position p's logits score prompt token p + 1; positions done before a preemption are skipped
                lo = max(start, len(seq.request.prompt_logprobs))
                hi = min(start + n, seq.num_prompt_tokens - 1)
                if hi > lo:
                    prompt_rows.extend(range(q_off + lo - start, q_off + hi - start))
                    step.prompt_spans.append((seq, lo, hi - lo))
            if seq.pools:
                step.pooled.append(seq)
                step.pool_spans.append((q_off, n, start, start + n == len(seq)))
            q_off += n
            if start + n == len(seq):
                if seq.max_tokens:
                    rows.append(q_off - 1)
                    step.sampling.append(seq)
                else:
                    step.prefilled.append(seq)
        return step, rows + prompt_rows

    def _plan(self, batch: list[tuple[Sequence, int]]) -> tuple[list[tuple[Sequence, int]], StepPlan]:
        """Prefill chunks first, then decodes (one token after cached context)."""
        prefill = [(s, n) for s, n in batch if not (n == 1 and s.num_computed_tokens > 0)]
        decode = [(s, n) for s, n in batch if n == 1 and s.num_computed_tokens > 0]
        ordered = prefill + decode
        plan = StepPlan(
            [s.num_computed_tokens for s, _ in ordered],
            [n for _, n in ordered],
            [s.block_table for s, _ in ordered],
            len(prefill),
            self.block_size,
        )
        return ordered, plan


@contextmanager
def _capture_hidden(model: torch.nn.Module, step: StepLogits):
    """Keep the decoder's final hidden states (after its last norm, before lm_head) in `step.hidden`
    when the step pools anything: the same forward serves generation and embeddings, still packed."""
    if not step.pooled:
        yield
        return

    def keep(_module, _args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        step.hidden = hidden[0]

    handle = model.get_decoder().register_forward_hook(keep)
    try:
        yield
    finally:
        handle.remove()


def check_attention_routing(model: torch.nn.Module) -> None:
    """Refuse models whose attention cannot be routed to bulkgen; leave the model's setting as it was."""
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        routed = model.config._attn_implementation == ATTN_IMPLEMENTATION
    finally:
        model.config._attn_implementation = previous
    if not routed:
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface; "
            "bulkgen cannot run it"
        )


def _check_supported(model: torch.nn.Module) -> None:
    """Refuse models with layers that are neither attention nor a recurrent mixer bulkgen can give a
    state slot (hybrid_layers.find_mixers): they would mix the sequences of a packed row."""
    layer_types = getattr(model.config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    mixers = find_mixers(model)
    unchecked = sorted({type(m).__name__ for m in mixers.values()} - CHECKED_MIXERS)
    if unchecked:
        raise ValueError(
            f"{type(model).__name__} has recurrent layers {unchecked} that bulkgen has not checked against "
            f"transformers; it runs {sorted(CHECKED_MIXERS)}"
        )
    if other and not set(mixers) | attention_layers(model) >= set(range(len(layer_types))):
        raise ValueError(
            f"{type(model).__name__} has non-attention layers {other}; bulkgen packs attention only"
        )
    check_attention_routing(model)
