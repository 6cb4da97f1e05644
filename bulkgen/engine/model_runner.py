"""Runs one packed forward pass: flat tokens in, logits for each sequence's last scheduled token out.

Logits are computed only where they are used: the last token of each sequence that samples now, and,
for a prompt_logprobs request, every prompt position of its prefill chunks (the request never takes
cached prefix blocks until they are all scored, since a cached prefix is never computed)."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from bulkgen.engine.attention.attn_select import select_backend
from bulkgen.engine.attention.interface import LayerCaches, StepContext, attention_scope
from bulkgen.engine.attention.layer_attention import describe, probe_layers
from bulkgen.engine.attention.mla import find_mla, wrap_mla
from bulkgen.engine.config import EngineConfig
from bulkgen.engine.decode_graphs import DecodeGraphs, SlotTables, read_pending
from bulkgen.engine.features.hybrid_layers import check_supported, state_slots
from bulkgen.engine.features.lora_slots import LoraSlots
from bulkgen.engine.features.multimodal import VisionTower
from bulkgen.engine.kv import kv_cache
from bulkgen.engine.kv.kv_layout import KVLayout
from bulkgen.engine.sequence import Sequence
from bulkgen.engine.step_features import NO_FEATURE, SingleRank
from bulkgen.engine.step_plan import HostPack, StepPlan

log = logging.getLogger(__name__)

CPU_KV_CAP_BYTES = 2 << 30
KV_HEADROOM = 1.25  # blocks beyond what max_num_seqs full contexts use: kept prefixes of finished requests


def kv_cache_blocks(
    cfg: EngineConfig, device: torch.device, block_bytes: int, blocks_per_seq: int, reserved: int = 0
) -> int:
    """Blocks of the paged KV cache: what `max_num_seqs` full-length sequences can ever use
    (`blocks_per_seq` each, over all KV groups; plus headroom for cached prefixes), within the budget. On CUDA the budget is a fraction of the memory
    free to this process: the device's free memory plus what torch's allocator holds unused (an earlier
    engine's freed cache stays reserved there). A tiny model on a big GPU gets the blocks it can use,
    not millions it never touches. `reserved`: bytes of the budget already taken (hybrid state slots)."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    full = cfg.max_num_seqs * blocks_per_seq  # every slot at full context
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
    """Bytes of one KV block across `num_layers` layers of one K/V head shape (K and V) stored in `dtype`:
    what bench_hybrid_memory.py sizes a cache with; the engine's own layouts are kv_layout.KVLayout's."""
    return 2 * num_layers * block_size * kv_heads * kv_cache.row_bytes(head_dim, dtype)


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

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        max_model_len: int,
        vision: VisionTower | None = None,
    ):
        """Probe the model's layers, size and allocate the paged KV cache (and a hybrid model's state slots),
        pick the attention backend, and capture decode graphs where they run. Kept as one body (just over 50
        lines): each allocation depends on the one before it (layout -> blocks -> caches -> tables -> graphs)."""
        self.model = model
        # the forward's inputs: a vision-language model's encoder splices image embeddings into prefills
        # (multimodal.VisionTower); a text model's no-op step feature passes token ids and positions
        self.forward_inputs = vision or NO_FEATURE
        self.config = config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_cache.cache_dtype(config.kv_cache_dtype, self.dtype)
        self.tp = getattr(model, "bulkgen_tp", None)  # a sharded model's tensor_parallel.RankGroup, else None
        self.ranks = self.tp or SingleRank()  # what the step runs through: one process's is step_features'
        self.ranks.publish_config(config, max_model_len)  # rank 0's, for the followers
        mixers = check_supported(model)  # a sharded model's were checked to split (sharding.py)
        wrap_mla(find_mla(model))  # MLA layers hand attention their latent: the cache stores only it
        self.layers = probe_layers(model, recurrent=set(mixers))  # None for a layer without attention
        self.layout = layout = KVLayout(self.layers)
        log.info(
            "attention: %s; %d KV groups of %d layers",
            describe(self.layers),
            len(layout.groups),
            layout.slots,
        )
        self.block_size = config.block_size
        # hybrid models' recurrent state (state_slots.StatePool); the no-op step feature otherwise
        slots = config.num_state_slots or config.max_num_seqs
        self.states = state_slots(model, mixers, slots, self.device, self.ranks)
        attending = [layer for layer in self.layers if layer is not None]
        self.backend = select_backend(self.device, self.dtype, attending, self.block_size, self.kv_dtype)
        self.backend = self.forward_inputs.route(self.backend)
        self.num_blocks = self._num_blocks(max_model_len)
        rows = (self.num_blocks + 1, self.block_size, layout.kv_heads)  # + a scratch block
        k_slots = [
            kv_cache.allocate(rows, layout.k_dim, self.kv_dtype, self.device) for _ in range(layout.slots)
        ]
        v_slots = [  # MLA's latent cache: V is a view of K's leading columns (mla.py)
            kv_cache.leading(k, layout.v_dim)
            if layout.latent
            else kv_cache.allocate(rows, layout.v_dim, self.kv_dtype, self.device)
            for k in k_slots
        ]
        # per layer, groups sharing slots; an empty tensor for a recurrent layer (its state is in a slot)
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self.k_caches = [empty if slot < 0 else k_slots[slot] for slot in layout.layer_slot]
        self.v_caches = [empty if slot < 0 else v_slots[slot] for slot in layout.layer_slot]
        self.caches = LayerCaches(self.k_caches, self.v_caches, layout.layer_group, self.layers)
        self.pack = HostPack(self.device)
        # decoding sequences' block tables, one persistent device row each (decode-graph and packed steps)
        width = -(-max_model_len // self.block_size)
        self.tables = SlotTables(config.max_num_seqs, width, self.num_blocks, self.device, len(layout.groups))
        self.graphs = self._decode_graphs(max_model_len)
        self.loras = LoraSlots(model, config.max_loras, config.max_lora_rank)
        self.embedding = model.get_input_embeddings()

    def _decode_graphs(self, max_model_len: int) -> DecodeGraphs | None:
        on_cuda = self.device.type == "cuda"
        wanted = self.config.cuda_graphs
        if not (wanted or (wanted is None and on_cuda)) or not self.forward_inputs.decode_graphs:
            return None
        graphs = DecodeGraphs(
            self.model,
            self.caches,
            self.layout.kinds,
            self.block_size,
            self.num_blocks,
            self.config.max_num_seqs,
            -(-max_model_len // self.block_size),
            capture=on_cuda,
            decode_kernel=getattr(self.backend, "decode_kernel", None),
            tables=self.tables,
            states=self.states.graph_pool,
            agree=self.ranks.agree_min,
        )
        if on_cuda and graphs.paged:  # one graph per batch size: all captured now, none mid-run
            graphs.capture()
        return graphs

    def _num_blocks(self, max_model_len: int) -> int:
        block_bytes = self.layout.block_bytes(self.block_size, self.kv_dtype)
        per_seq = self.peak_blocks(max_model_len)
        blocks = kv_cache_blocks(self.config, self.device, block_bytes, per_seq, self.states.reserved_bytes)
        return self.ranks.agree_min(blocks)

    def peak_blocks(self, num_tokens: int, longest_chunk: int = 0) -> int:
        """The most block ids one sequence of `num_tokens` tokens holds at once (kv_layout), its chunks
        being at most the step's budget, or `longest_chunk` (an image block taken whole: image_blocks.py)."""
        step = max(self.config.max_num_batched_tokens, longest_chunk)
        return self.layout.peak_blocks(num_tokens, step, self.block_size)

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]], pending: torch.Tensor | None = None) -> StepLogits:
        """Forward the scheduled (sequence, num_new_tokens) pairs; return float32 logits for sequences
        whose scheduled tokens reach their end (they sample now), then for the prompt positions of
        prompt-logprob prefills (see StepLogits). Changes no sequence (a hybrid model's state slots
        advance with the forward: state_slots.py). `pending`: the previous step's sampled tokens on the
        device, where stand-ins for tokens the host has not read (sequence.pending_id) are looked up."""
        self.loras.prepare(batch)
        graph = self._graph_bucket(batch)
        with self.ranks.step(batch, pending, graph):  # the other ranks run this same step (follow)
            self.states.begin(batch)
            step = self._run(batch, pending, graph)
            self.states.commit(batch)
        return step

    @torch.inference_mode()
    def follow(
        self, batch: list[tuple[Sequence, int]], pending: torch.Tensor | None, graph: tuple[int, int] | None
    ) -> StepLogits:
        """A tensor-parallel follower's step: rank 0's `run`, in the decode-graph bucket rank 0 chose (its step
        plan). Its sequences are stand-ins carrying rank 0's state slots (plan_codec), held nowhere here."""
        with self.ranks.step(batch, pending, graph):
            return self._run(batch, pending, graph)

    def _graph_bucket(self, batch: list[tuple[Sequence, int]]) -> tuple[int, int] | None:
        """The decode-graph bucket of a step of decodes alone, or None for the packed path: a step with a
        prefill chunk (`_plan`'s rule: more than one token, or none computed yet), a pooled sequence, or
        an adapter row (decode graphs hold no LoRA ops)."""
        if self.graphs is None or not batch:
            return None
        for seq, n in batch:
            if n != 1 or not seq.num_computed_tokens or seq.packed_only:
                return None
        return self.graphs.key([s for s, _ in batch])

    def _run(
        self, batch: list[tuple[Sequence, int]], pending: torch.Tensor | None, graph: tuple[int, int] | None
    ) -> StepLogits:
        """One forward of the scheduled rows. Kept as one body (over 50 lines): the order of the `pack.add`
        calls is the layout of the step's single host-to-device upload, and the offsets they return are read
        back from the uploaded tensor right below; split apart, those offsets would travel between functions."""
        ordered, plan = self._plan(batch)
        step, rows = self._rows(ordered)
        if graph is not None:  # decodes alone (_graph_bucket); one row per sequence: row = query offset
            logits = self.graphs.run([s for s, _ in ordered], pending, graph)
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
        plans = self._group_plans(plan, ordered, on_device)
        slots = [pack.add(p.slots(plan.num_prefill if on_device else None)) for p in plans]
        at = pack.add(updates)
        pack.add(values)
        keep = pack.add(rows)
        states, state_rows = self.states.packed(ordered, plan.num_prefill)
        decode_slots = pack.add(state_rows)
        metas = [
            self.backend.prepare(p, pack, kind) for p, kind in zip(plans, self.layout.kinds, strict=True)
        ]
        flat = pack.upload()
        slot_rows = [flat[s] for s in slots]
        if on_device:
            if updates:
                self.tables.all.view(-1).index_copy_(0, flat[at], flat[at.stop : at.stop + len(updates)])
            self._decode_slots(slot_rows, flat[positions][plan.num_prefill_tokens :], flat[plan.decode_rows])
        ctx = StepContext(
            slot_rows, self.caches, self.backend, [self.backend.bind(m, flat) for m in metas], flat[positions]
        )
        input_ids = flat[ids] if pending is None else read_pending(flat[ids], pending)
        kwargs = self.forward_inputs.inputs(ordered, input_ids, flat[positions], self.embedding)
        kwargs.update(use_cache=False, bulkgen_ctx=ctx)
        with (
            self.loras.scope(ordered, len(tokens)),
            attention_scope(self.model),
            _capture_hidden(self.model, step),
            self.states.scope(states, flat, decode_slots),
        ):
            if not rows:  # only prefill chunks: the base model fills the cache, no logits needed
                self.model.get_decoder()(**kwargs)
                return step
            out = self.model(logits_to_keep=flat[keep], **kwargs)  # lm_head on the kept rows only
        step.logits = out.logits[0].float()
        return step

    def _group_plans(self, plan: StepPlan, ordered: list[tuple[Sequence, int]], on_device) -> list[StepPlan]:
        """Each KV group's view of the step: the plan with that group's block tables."""
        return [
            replace(
                plan,
                block_tables=[s.block_tables[g] for s, _ in ordered],
                decode_table=self.tables.all[g] if on_device else None,
            )
            for g in range(len(self.layout.groups))
        ]

    def _decode_slots(
        self, slot_rows: list[torch.Tensor], pos: torch.Tensor, table_rows: torch.Tensor
    ) -> None:
        """Append each group's cache rows of the decode tokens, read from the device tables."""
        bs = self.block_size
        for g, table in enumerate(self.tables.all):
            slot_rows[g] = torch.cat([slot_rows[g], table[table_rows, pos // bs] * bs + pos % bs])

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
        """Prefill chunks first, then decodes (one token after cached context); each part sorted by LoRA
        adapter when any row has one, so an adapter's rows are one segment of each (lora_slots.py)."""
        prefill = [(s, n) for s, n in batch if not (n == 1 and s.num_computed_tokens > 0)]
        decode = [(s, n) for s, n in batch if n == 1 and s.num_computed_tokens > 0]
        self.loras.order(prefill)
        self.loras.order(decode)
        ordered = prefill + decode
        plan = StepPlan(
            [s.num_computed_tokens for s, _ in ordered],
            [n for _, n in ordered],
            [s.block_table for s, _ in ordered],
            len(prefill),
            self.block_size,
        )
        self.forward_inputs.plan(plan, prefill)
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
