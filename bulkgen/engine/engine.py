"""The engine: requests in, one scheduling step + packed forward at a time, finished requests out.

`generate()` is the offline loop (`while unfinished: step()`); a worker uses add_request/step/abort
directly so its batch stays full across chunk boundaries.

Overlapped steps (`EngineConfig.async_scheduling`, on by default on CUDA; vLLM's async scheduling,
SGLang's overlap scheduler): a step is launched before the host reads the previous step's tokens. Each
sequence that sampled holds a stand-in last token (sequence.pending_id: a negative id naming a row of
the previous step's sampled tensor), which the next forward reads on the device; the host then waits
for that previous step's tokens alone (the new forward queued behind them keeps the GPU busy), fills
them in and runs the stop checks, detokenisation and result building while the GPU computes. So a stop
is seen one step late: the sequence's token of the step already launched is discarded (counted in stats
as discarded_tokens), and a request comes back from the step after the one that sampled its last token.
A sequence whose last token is known in advance (max_tokens) leaves the batch as soon as that token is
launched. A step with a row whose logits processing needs its tokens on the host (a grammar's matcher,
penalties, logit_bias) launches its forward the same way but samples once the previous step's tokens
are read and the matchers and penalty rows have caught up. Sampling rows settled only after the copy
(RandomDraw.settle, rare) had a wrong token on the device: the step that read it is discarded for them
and recomputed, so the tokens are exactly those of a step-by-step run.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from bulkgen.engine.config import EngineConfig, resolve_limits
from bulkgen.engine.features.grammar import GrammarRuntime
from bulkgen.engine.features.image_blocks import longest
from bulkgen.engine.features.lora import LoraError, load_adapter
from bulkgen.engine.features.lora_slots import AdapterRows
from bulkgen.engine.features.multimodal import (
    ImageInputs,
    RequestImages,
    VisionTower,
    check_vision_families,
    is_vision_model,
    load_processor,
    load_vision,
)
from bulkgen.engine.features.pooling import (
    EmbedParams,
    PoolingConfig,
    add_chunks,
    check_embed,
    finish,
    model_pooling,
)
from bulkgen.engine.kv.block_manager import BlockManager
from bulkgen.engine.model.fingerprint import system_fingerprint
from bulkgen.engine.model.loading import load_model
from bulkgen.engine.model.quantize import ensure_quantized
from bulkgen.engine.model_runner import ModelRunner, StepLogits
from bulkgen.engine.outputs import CompletionOutput, RequestOutput, best_of
from bulkgen.engine.overlap import OverlappedSteps, _InFlight
from bulkgen.engine.parallel.rank_memory import check_device_fits
from bulkgen.engine.sampling.penalties import LogitAdjustments
from bulkgen.engine.sampling.sampler import SampledTokens, SamplingRows, prompt_logprobs, sample_async
from bulkgen.engine.sampling.sampling_params import SamplingParams, generation_defaults
from bulkgen.engine.sampling.stopping import check_stop, completion_text
from bulkgen.engine.scheduler import ScheduledBatch, Scheduler
from bulkgen.engine.sequence import Request, Sequence, SequenceStatus, pending_id
from bulkgen.engine.stats import EngineStats
from bulkgen.engine.step_features import Features, StepFeature

if TYPE_CHECKING:
    from bulkgen.engine.parallel.tensor_parallel import Launcher

log = logging.getLogger(__name__)

SchedulerFactory = Callable[[EngineConfig, BlockManager, StepFeature], Scheduler]


class Engine(OverlappedSteps):
    """Continuous-batching generation over any HF decoder-only model.

    The model's attention is switched to bulkgen's paged implementation only inside the engine's
    own forward calls, so the caller can still use the model (e.g. `model.generate()`) between steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        pooling: PoolingConfig | None = None,
        scheduler: SchedulerFactory = Scheduler,
        vision: VisionTower | None = None,
        **engine_kwargs,
    ) -> None:
        """`pooling`: how embedding requests pool; None reads the model's own folder (pooling.load_pooling).
        `scheduler`: the admission rule, continuous batching unless a caller brings another
        (bulkgen/lab/grouped.py: the static and dynamic batching it is measured against).
        `vision`: a vision-language model's encoder, `model` being its language half (multimodal.py)."""
        self._make_scheduler = scheduler
        self.vision = vision
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.config = resolve_limits(EngineConfig(**engine_kwargs), self.device)
        ensure_quantized(model, self.config.quantize)
        overlap = self.config.async_scheduling
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.max_model_len = _max_model_len(model.config, self.config.max_model_len)
        if (self.config.tensor_parallel > 1) != hasattr(model, "bulkgen_tp"):
            raise ValueError(
                "tensor_parallel > 1 needs Engine.from_pretrained: each rank loads its own shard"
            )
        self.runner = ModelRunner(model, self.config, self.max_model_len, vision)
        self.config = self.runner.states.configure(self.config)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        # generation_config.json's sampling defaults, for requests that set none (sampling_params)
        self.sampling_defaults = (
            generation_defaults(getattr(model, "generation_config", None))
            if self.config.generation_config == "auto"
            else {}
        )
        head = model.get_output_embeddings()
        self.vocab_size = (
            getattr(head, "vocab_size", None) or head.weight.shape[0]
        )  # a vocab-parallel head: all
        self.pooling = pooling or model_pooling(getattr(model, "name_or_path", None))
        self.stats_ = EngineStats(self.config.max_num_seqs)
        self._seq_ids = itertools.count()
        self._order = itertools.count()
        self._grammars: GrammarRuntime | None = None  # built with the first constrained request
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="bulkgen-masks")
        self.reset()

    def reset(self) -> None:
        """Drop every request and start the scheduler and KV bookkeeping afresh; weights stay loaded.

        A worker calls this after a failed step instead of reloading the model. The cache tensors are
        kept (stale contents are never read: a slot is written before it is attended to)."""
        self.requests: dict[str, Request] = {}
        self._guided: set[str] = set()  # requests under a grammar: steps without any skip the mask work
        self._host_bound: set[str] = set()  # requests whose rows need their tokens on the host (see step)
        self._inflight: _InFlight | None = None  # a launched step whose tokens the host has not read
        self._instant: list[Request] = []  # max_tokens 0 without prompt logprobs: done at the next step
        self.adjustments = LogitAdjustments()  # penalty and logit_bias rows, on the logits' device
        self.constants = SamplingRows()  # random rows' temperature, top_p, top_k and key, on that device
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            self.config.block_size,
            self.config.enable_prefix_caching,
            self.runner.layout.kinds,
        )
        self.runner.states.reset()
        features = Features(self.runner.states, AdapterRows(self.config.max_loras))
        self.scheduler = self._make_scheduler(self.config, self.block_manager, features)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
        launcher: Launcher | None = None,
        **engine_kwargs,
    ) -> Engine:
        """Load a local HF checkpoint (never a hub download). Defaults: CUDA+bf16 if available, else CPU+fp32.
        A quantized checkpoint loads through transformers' quantizer; `quantize="fp8"` quantizes a float one.
        A vision-language checkpoint loads with its processor (multimodal.load_vision).
        `launcher` starts the other ranks of a tensor_parallel > 1 engine (tensor_parallel.Launcher): processes
        of this machine unless the caller places them (a Ray worker's group, runtime/groups.py)."""
        from transformers import AutoTokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype is None:
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        elif isinstance(dtype, str):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"dtype {dtype!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")
            dtype = getattr(torch, dtype)
        fields = EngineConfig.__dataclass_fields__  # engine_kwargs also carry the Engine's own (scheduler)
        config = EngineConfig(
            **{k: v for k, v in engine_kwargs.items() if k in fields}
        )  # before any rank starts
        vision = is_vision_model(path)
        if vision:
            check_vision_families(path)
        else:
            check_device_fits(path, dtype, config.tensor_parallel, device)
        if (
            config.tensor_parallel > 1
        ):  # a vision-language model's encoder runs on rank 0 alone (vision_shards)
            from bulkgen.engine.parallel.tensor_parallel import launch

            timeout = config.collective_timeout_s
            model = launch(path, config.tensor_parallel, device, dtype, timeout, launcher, config.quantize)
            if vision:
                tower = VisionTower(model.bulkgen_tp.vlm, load_processor(path))
                return cls(model, tower.processor.tokenizer, vision=tower, **engine_kwargs)
        elif vision:
            model, tower = load_vision(path, device, dtype, config)
            return cls(model, tower.processor.tokenizer, vision=tower, **engine_kwargs)
        else:
            model = load_model(path, device, dtype, config.quantize)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(model, tokenizer, **engine_kwargs)

    @functools.cached_property
    def system_fingerprint(self) -> str:
        """A stable hash of the checkpoint, tokenizer and chat template, dtype and quantization, bulkgen's
        version and the settings that change tokens (fingerprint.py): every line of a batch answers it."""
        settings = {
            "dtype": str(getattr(self.model, "dtype", None)),
            "quantize": self.config.quantize,
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "tensor_parallel": self.config.tensor_parallel,
            "max_model_len": self.max_model_len,
            "generation_config": self.config.generation_config,
            "sampling_defaults": self.sampling_defaults,
        }
        return system_fingerprint(getattr(self.model.config, "_name_or_path", None), self.tokenizer, settings)

    def sampling_params(self, kwargs: dict) -> SamplingParams:
        """SamplingParams of a request's `kwargs`: a field they leave out takes the model's
        generation_config.json default (sampling_defaults; none with generation_config="none"), else
        SamplingParams' own (OpenAI's)."""
        return SamplingParams(**{**self.sampling_defaults, **kwargs})

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | EmbedParams,
        tag: str | None = None,
        lora: str | None = None,
        images: ImageInputs | None = None,
    ) -> None:
        """Queue a request; ValueError if the id is in use or the prompt or params do not fit this engine.

        The whole request (all its sequences: best_of or n) is built and checked before any part is queued.
        A max_tokens 0 request comes back from the next step() with empty completions, after a prefill
        only if it asks for prompt_logprobs (computed once, by completion 0).
        `tag` is opaque (the runtime passes a batch id); step records count work per tag.
        EmbedParams make an embedding request: a prefill-only sequence in the same packed steps, whose KV
        blocks are allocated like any prompt's (later chunks attend to earlier ones) and freed as soon as
        its last chunk is computed; it finishes with `RequestOutput.embedding`.
        `lora`: the name of an adapter added with add_lora (LoraError if unknown); None runs the base model.
        `images`: the prompt's images, preprocessed by the model's processor; the prompt is then token ids
        with each image's placeholder tokens already expanded (they count as prompt tokens)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        adapter = None if lora is None else self.runner.loras.get(lora)
        embed = params if isinstance(params, EmbedParams) else None
        if embed is not None:
            check_embed(self.pooling, embed, self.model.config.hidden_size)
            params = SamplingParams(max_tokens=0)
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}"
            )
        self._check_vocab(request_id, params)
        ids = self._tokenize(request_id, prompt)
        with_images = self._images(request_id, ids, images)
        max_tokens, count = self._fit(request_id, len(ids), params, embed is not None, longest(with_images))
        stop_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        request = Request(
            request_id, ids, params, next(self._order), tag, stop_ids, embed, adapter, with_images
        )
        self._queue(request, max_tokens, count)

    def _queue(self, request: Request, max_tokens: int, count: int) -> None:
        """Give a checked request its `count` sequences and hand them to the scheduler."""
        params, request_id = request.params, request.request_id
        request.seqs = [Sequence(next(self._seq_ids), request, i, max_tokens) for i in range(count)]
        for seq in request.seqs:
            seq.pools_every_position = seq.pools and self.pooling.method != "last"
        if params.constrained:
            for seq in request.seqs:  # one matcher per completion
                seq.matcher = self.grammars.matcher(params.guide, params.reasoning)
            self._guided.add(request_id)
        if params.constrained or params.adjusts_logits:
            self._host_bound.add(request_id)
        for seq in request.seqs:
            self.scheduler.add(seq)
        if not request.seqs:
            self._instant.append(request)
        self.requests[request_id] = request

    def add_lora(self, name: str, path: str | os.PathLike) -> None:
        """Load the PEFT adapter folder at `path` (local) into the host cache as `name`, for requests
        that name it; LoraError naming what is refused (lora.py). Its device slot is filled when a step
        first schedules one of its requests."""
        # on a tensor-parallel rank 0: its shard; the followers load theirs as the step plan says (lora_tp.py)
        loras = self.runner.loras
        if name in loras.adapters:
            raise LoraError(f"adapter {name!r} is already loaded; remove it first")
        loras.add(load_adapter(name, path, self.model, self.config.max_lora_rank))

    def remove_lora(self, name: str) -> None:
        """Drop adapter `name`; LoraError if unknown or if requests in the engine still run with it."""
        adapter = self.runner.loras.get(name)
        users = sum(r.lora is adapter for r in self.requests.values())
        if users:
            raise LoraError(f"adapter {name!r} is in use by {users} requests; abort or finish them first")
        self.runner.loras.remove(name)

    def loras(self) -> list[str]:
        """Names of the adapters loaded, sorted."""
        return sorted(self.runner.loras.adapters)

    def _fit(
        self, request_id: str, prompt_len: int, params: SamplingParams, embed: bool, chunk: int = 0
    ) -> tuple[int, int]:
        """(max_tokens within the context, sequences to run) of a request whose prompt fits the context
        and whose every sequence fits the KV cache alone; ValueError naming the limit otherwise. `chunk`:
        its longest prefill chunk where that may exceed the step budget (an image block: image_blocks.py)."""
        if prompt_len >= self.max_model_len + embed:  # a prompt to embed may fill the context
            raise ValueError(
                f"request {request_id!r}: prompt of {prompt_len} tokens exceeds the context length "
                f"({self.max_model_len}); it must be shorter"
            )
        max_tokens = min(params.max_tokens, self.max_model_len - prompt_len)  # Python ints: no overflow
        count = params.num_sequences if max_tokens else int(params.prompt_logprobs is not None or embed)
        blocks = self.runner.peak_blocks(prompt_len + max_tokens, chunk)  # over every KV group
        if count and blocks > self.runner.num_blocks:  # its sequences never need to be resident together
            raise ValueError(
                f"request {request_id!r}: each of its {count} sequences needs {blocks} KV blocks but the cache "
                f"has {self.runner.num_blocks}"
            )
        return max_tokens, count

    def _images(self, request_id: str, ids: list[int], images: ImageInputs | None) -> RequestImages | None:
        if images is None:
            return None
        if self.vision is None:
            raise ValueError(f"request {request_id!r}: this model takes no images")
        try:
            return self.vision.admit(ids, images)
        except ValueError as exc:
            raise ValueError(f"request {request_id!r}: {exc}") from None

    def _check_vocab(self, request_id: str, params: SamplingParams) -> None:
        """The limits that need the model: top-k counts and token ids within the vocabulary."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise ValueError(
                    f"request {request_id!r}: {name}={value} exceeds the vocabulary ({self.vocab_size})"
                )
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"request {request_id!r}: logit_bias token ids {bad[:5]} outside vocab [0, {self.vocab_size})"
            )

    def _tokenize(self, request_id: str, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"request {request_id!r}: token ids {bad[:5]} outside vocab [0, {self.vocab_size})"
                )
            ids = list(prompt)
        else:
            raise ValueError(f"request {request_id!r}: prompt must be a str or a list of int token ids")
        if not ids:
            raise ValueError(f"request {request_id!r}: prompt is empty")
        return ids

    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one forward pass; returns requests that finished in this step
        (with overlapped steps: whose last token the host read in this step, see the module docstring).

        The forward pass and sampling change no sequence: if either raises, every sequence still
        holds its blocks and counts (and a pending token its in-flight step), so the next step
        recomputes the same tokens (or the caller aborts a request, or calls reset())."""
        return self._step_function(self._finish_instant())

    @property
    def overlap(self) -> bool:
        """Whether steps overlap (the module docstring). Setting it, between steps, chooses the step function
        once; a step left in flight by overlapped steps is read by the next plain one."""
        return self._step_function == self._next_overlapped

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self._step_function = self._next_overlapped if on else self._next_in_order

    def _next_in_order(self, done: list[RequestOutput]) -> list[RequestOutput]:
        if self._inflight is not None:  # switched off with a step in flight: read it first, so what it
            done += self._drain()  # finishes is not scheduled again
        batch = self.scheduler.schedule()
        if not batch.items:
            return done or self._idle()
        return done + self._step_in_order(batch)

    def _next_overlapped(self, done: list[RequestOutput]) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.items:
            if self._inflight is not None:
                return done + self._drain()
            return done or self._idle()
        return done + self._step_overlapped(batch)

    def _idle(self) -> list[RequestOutput]:
        """Nothing to schedule: wait a moment for a request the scheduler holds back (fair admission)."""
        wait = self.scheduler.idle_wait()
        if wait is None and self.requests:
            raise RuntimeError(f"scheduler made no progress with {len(self.requests)} requests unfinished")
        if wait:
            time.sleep(min(wait, 0.01))
        return []

    def _step_in_order(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Step by step: launch, wait for this step's tokens, then apply them."""
        start = time.time()
        step, sampled, scored = self._launch(batch, None, sample=True, now=start)
        tokens = sampled.result() if sampled is not None else None
        # no sequence changed up to here
        discarded = self._advance(batch, set())
        for seq, entries in scored:
            seq.request.prompt_logprobs.extend(entries)
        done = self._take_tokens(step.sampling, tokens[0], tokens[1]) if tokens is not None else []
        done += self._finish_prefilled(step.prefilled)
        self.stats_.record_step(batch, time.time() - start, step.sampling, discarded)
        return done

    def _launch(
        self, batch: ScheduledBatch, pending: torch.Tensor | None, sample: bool, now: float
    ) -> tuple[StepLogits, SampledTokens | None, list[tuple[Sequence, list[dict]]]]:
        """The step's forward (reading stand-in tokens from `pending`, the previous step's sampled tensor),
        its sampling queued on the device when `sample`, its prompt logprobs and pooled chunks. Changes no
        sequence but the pooled ones' running sums."""
        self._mark_scheduled(batch.items, now)
        masks = self._start_masks(batch.items) if sample else None  # on a GPU: filled during the forward
        try:
            step = self.runner.run(batch.items, pending)
        finally:
            bitmask = masks[1].result() if masks else None  # never leave a fill running on a matcher
        sampled = None
        if sample and step.sampling:
            rows = self._constrained_rows(step.sampling, masks[0], bitmask) if masks else None
            logits = step.logits[: len(step.sampling)]
            sampled = sample_async(logits, step.sampling, self.adjustments, rows, self.constants)
        scored = self._score_prompts(step)
        if step.pooled:
            add_chunks(step.pooled, step.hidden, step.pool_spans, self.pooling.method)
        return step, sampled, scored

    def _advance(self, batch: ScheduledBatch, voided: set[int]) -> int:
        """Count the step's computed tokens into its sequences, committing filled blocks; returns the
        items discarded: sequences that ended, or whose input token was corrected, after the launch."""
        bs, finished, discarded = self.config.block_size, SequenceStatus.FINISHED, 0
        for seq, n in batch.items:
            if seq.status is finished or (voided and seq.seq_id in voided):
                discarded += 1
                continue
            seq.num_computed_tokens += n
            if seq.num_computed_tokens // bs != (seq.num_computed_tokens - n) // bs:  # a block filled
                self.block_manager.commit(seq)
        return discarded

    @property
    def grammars(self) -> GrammarRuntime:
        if self._grammars is None:
            self._grammars = GrammarRuntime(self.tokenizer, self.vocab_size)
        return self._grammars

    def _start_masks(self, items: list[tuple[Sequence, int]]) -> tuple[list[Sequence], Future] | None:
        """Constrained sequences that sample this step (their scheduled tokens reach their end): their
        masks depend only on tokens already consumed, so on a GPU they fill in a thread while the forward
        runs; on a CPU the forward already uses every core, and a thread beside it only slows it down."""
        if not self._guided:
            return None
        guided = [
            s for s, n in items if s.matcher is not None and s.num_computed_tokens + n >= len(s.token_ids)
        ]
        return self._fill_masks(guided) if guided else None

    def _fill_masks(self, guided: list[Sequence]) -> tuple[list[Sequence], Future]:
        """`guided` and the fill of their masks: in a thread on a GPU, at once on a CPU."""
        matchers = [s.matcher for s in guided]
        if self.device.type == "cpu":
            done: Future = Future()
            done.set_result(self.grammars.masks(matchers, unpacked=True))
            return guided, done
        return guided, self._mask_thread.submit(self.grammars.masks, matchers)

    @staticmethod
    def _constrained_rows(
        sampling: list[Sequence], guided: list[Sequence], bitmask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of `sampling` that are constrained, their packed masks) for the sampler."""
        where = {s.seq_id: i for i, s in enumerate(guided)}
        rows = [i for i, s in enumerate(sampling) if s.matcher is not None]
        if not rows:
            return None
        return torch.tensor(rows), bitmask[[where[sampling[i].seq_id] for i in rows]]

    def _finish_instant(self) -> list[RequestOutput]:
        """Requests with nothing to compute (max_tokens 0) that were not aborted since they were added."""
        if not self._instant:
            return []
        now, instant, self._instant = time.time(), self._instant, []
        return [self._finish_request(r, now) for r in instant if self.requests.get(r.request_id) is r]

    def _score_prompts(self, step: StepLogits) -> list[tuple[Sequence, list[dict]]]:
        """Prompt-logprob entries of this step's prompt rows (host lists; nothing is changed yet)."""
        if not step.prompt_spans:
            return []
        targets, ks = [], []
        for seq, first, count in step.prompt_spans:
            targets += seq.token_ids[first + 1 : first + 1 + count]
            ks += [seq.params.prompt_logprobs] * count
        rows = prompt_logprobs(step.logits[len(step.sampling) :], targets, ks)
        out, at = [], 0
        for seq, _, count in step.prompt_spans:
            out.append(
                (
                    seq,
                    [
                        self._logprob_entry(t, lp)
                        for t, lp in zip(targets[at : at + count], rows[at : at + count], strict=True)
                    ],
                )
            )
            at += count
        return out

    def _finish_prefilled(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """max_tokens 0 sequences whose prompt was just scored: finished without sampling."""
        done = []
        for seq in seqs:
            seq.finish_reason = "length"
            self.scheduler.finish(seq)
            if seq.request.finished:
                done.append(self._finish_request(seq.request, time.time()))
        return done

    def _mark_scheduled(self, items: list[tuple[Sequence, int]], now: float) -> None:
        for seq, _ in items:
            metrics = seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.num_cached_tokens = seq.num_cached_tokens
                self.stats_.add_cached(seq.num_cached_tokens)

    def _take_tokens(
        self, seqs: list[Sequence], tokens: list[int], logprobs: list, placed: bool = False
    ) -> list[RequestOutput]:
        """Append each sequence's new token (or, `placed`, replace its stand-in for row i of the step that
        sampled it: `seqs` are that step's sampling rows) and run its stop checks; returns the requests
        that ended, built once all their tokens are in."""
        now = time.time()
        ended: dict[str, Request] = {}
        for row, seq in enumerate(seqs):
            if seq.request.error is not None:
                continue  # another sequence of its request failed it in this loop
            token, lp = tokens[row], logprobs[row]
            if placed:
                if seq.token_ids[-1] != pending_id(row):
                    continue  # it holds no token of this step: ended, corrected or aborted since
                seq.token_ids[-1] = token
            else:
                seq.token_ids.append(token)
            if lp is not None:
                seq.cumulative_logprob += lp[0]
                if seq.logprobs is not None:
                    seq.logprobs.append(self._logprob_entry(token, lp))
            metrics = seq.request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if self._ends(seq, token):
                if seq.status is not SequenceStatus.FINISHED:  # a last token was known: it left already
                    self.scheduler.finish(seq)
                if seq.request.finished:
                    ended[seq.request.request_id] = seq.request
        return [self._finish_request(request, now) for request in ended.values()]

    def _ends(self, seq: Sequence, token: int) -> bool:
        """Whether `token` ends `seq`: a stop or its length (check_stop), a complete document (its matcher
        stopped: a stop), or a grammar that failed, which fails the whole request (never a stop)."""
        matcher = seq.matcher
        if matcher is not None and matcher.is_error():  # failed filling the mask `token` was drawn under
            self._fail_guided(seq.request, matcher)
            return True
        if check_stop(seq, self.tokenizer):
            return True
        if matcher is None:
            return False
        if not self.grammars.consume(matcher, token):
            self._fail_guided(seq.request, matcher)
            return True
        if not matcher.is_stopped():
            return False
        seq.finish_reason = "stop"
        return True

    def _fail_guided(self, request: Request, matcher) -> None:
        """End every sequence of `request`, whose grammar failed, wherever it is (as abort does); it comes
        back with `error` and no completions."""
        request.error = self.grammars.failure(matcher)
        self._drop([s for s in request.seqs if s.status is not SequenceStatus.FINISHED])

    def _drop(self, seqs: list[Sequence]) -> None:
        """End `seqs` wherever they are and free their KV blocks."""
        if seqs:
            self.scheduler.abort(seqs)
        for seq in seqs:
            if seq.token_ids[-1] < 0:  # a token in flight: dropped when read
                seq.token_ids.pop()

    def _logprob_entry(self, token: int, lp: tuple) -> dict:
        chosen, ids, vals = lp
        decode = self.tokenizer.decode
        top = [{"token": decode([i]), "logprob": v} for i, v in zip(ids, vals, strict=True)]
        return {"token": decode([token]), "logprob": chosen, "top_logprobs": top}

    def _finish_request(self, request: Request, now: float) -> RequestOutput:
        del self.requests[request.request_id]
        self._guided.discard(request.request_id)
        self._host_bound.discard(request.request_id)
        for seq in request.seqs:
            self.adjustments.release(seq)
            self.constants.release(seq)
        metrics = request.metrics
        metrics.finished_time = now
        metrics.num_output_tokens = sum(s.num_output_tokens for s in request.seqs)
        metrics.num_preemptions = sum(s.num_preemptions for s in request.seqs)
        params = request.params
        if request.error is not None:
            return RequestOutput(
                request.request_id, request.prompt_token_ids, [], metrics, error=request.error
            )
        if request.embed is not None:
            vector = finish(
                request.seqs[0].pool_state, len(request.prompt_token_ids), self.pooling, request.embed
            )
            return RequestOutput(request.request_id, request.prompt_token_ids, [], metrics, embedding=vector)
        if params.max_tokens == 0:
            cumulative = 0.0 if params.logprobs is not None or params.best_of is not None else None
            outputs = [
                CompletionOutput(i, [], "", "length", None if params.logprobs is None else [], cumulative)
                for i in range(params.n)
            ]
        else:
            outputs = [
                CompletionOutput(
                    s.index,
                    s.output_token_ids,
                    completion_text(s, self.tokenizer),
                    s.finish_reason,
                    s.logprobs,
                    s.cumulative_logprob,
                )
                for s in request.seqs
            ]
            if params.best_of is not None:
                outputs = best_of(outputs, params.n)
        return RequestOutput(
            request.request_id, request.prompt_token_ids, outputs, metrics, request.prompt_logprobs
        )

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams | EmbedParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order (request ids are str(index))."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if self.requests:
            raise ValueError(
                f"generate() needs an idle engine; {len(self.requests)} requests are still in it"
            )
        ids = [str(i) for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, p)
        results: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id] = out
        return [results[i] for i in ids]

    def embed(
        self, prompts: list[str] | list[list[int]], params: EmbedParams | None = None
    ) -> list[list[float]]:
        """Embed every prompt (packed, sorted, chunked like any prefill); vectors in input order."""
        return [out.embedding for out in self.generate(prompts, [params or EmbedParams()] * len(prompts))]

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (a no-op for a single-process engine)."""
        self.runner.ranks.close()

    @property
    def accepts_images(self) -> bool:
        """Whether requests may carry images (a vision-language model); its `processor` prepares them."""
        return self.vision is not None

    @property
    def processor(self):
        """The vision-language model's AutoProcessor (multimodal.process takes it); None for a text model."""
        return None if self.vision is None else self.vision.processor

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_unfinished(self) -> int:
        return len(self.requests)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop requests wherever they are and free their KV blocks; unknown ids are ignored."""
        seqs = []
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            self._guided.discard(rid)
            self._host_bound.discard(rid)
            if request is not None:
                seqs.extend(request.seqs)
        self._drop(seqs)
        for seq in seqs:
            self.adjustments.release(seq)
            self.constants.release(seq)

    def free_capacity(self) -> dict:
        """Room for more work: a worker pulls new requests while free_slots > 0 and blocks remain."""
        sched = self.scheduler
        return {
            "free_slots": self.config.max_num_seqs - (len(sched.running) + sched.num_waiting),
            "free_blocks": self.block_manager.num_free_blocks,
            "waiting": sched.num_waiting,
            "block_size": self.config.block_size,
            "max_num_seqs": self.config.max_num_seqs,
        }

    def stats(self) -> dict:
        return self.stats_.snapshot(self.scheduler.num_preemptions, self.scheduler.prefill_padding_tokens)

    def pop_step_records(self) -> list[dict]:
        return self.stats_.pop_records()


def _max_model_len(hf_config, requested: int | None) -> int:
    """Context length: the model's positions (a sliding window limits what a layer reads, not how long
    a sequence may grow), or less if asked."""
    limit = getattr(hf_config, "max_position_embeddings", None) or requested or 2048
    return min(requested, limit) if requested else limit


def _eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), model.config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids
