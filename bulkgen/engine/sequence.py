"""A sequence is one completion being generated; a request groups its `n` sequences."""

from __future__ import annotations

import enum
import secrets
import time

from bulkgen.engine.outputs import RequestMetrics
from bulkgen.engine.sampling.counter_rng import stream_key
from bulkgen.engine.sampling.sampling_params import SamplingParams


def pending_id(row: int) -> int:
    """The stand-in id of a sampled token the host has not read yet (the engine's overlapped steps):
    row `row` of the in-flight step's device tokens, as a negative id the next forward decodes on the
    device (decode_graphs.read_pending). Real ids are never negative."""
    return -2 - row


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """The unit the caller sees: a prompt, its sampling params, and `n` sequences."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        order: int,
        tag: str | None = None,
        stop_ids: frozenset[int] = frozenset(),
        embed=None,
        lora=None,
        images=None,
    ):
        self.request_id = request_id
        self.lora = lora  # lora.LoraAdapter the request runs with; None: the base model
        self.images = images  # multimodal.RequestImages: a prompt with images, None for text alone
        self.embed = embed  # pooling.EmbedParams: a prefill-only request answered with its pooled vector
        self.tag = tag or ""
        self.stop_ids = stop_ids  # EOS (unless ignored) plus stop_token_ids: one set lookup per token
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.order = order
        self.metrics = RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(prompt_token_ids))
        self.seqs: list[Sequence] = []
        # one entry per prompt token after the first, filled by completion 0's prefill when asked for
        self.prompt_logprobs: list[dict] | None = [] if params.prompt_logprobs is not None else None
        self.error: str | None = None  # why it failed on its own (its grammar), set when it ends

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)


class Sequence:
    """Token ids (prompt + output), how many have KV in the cache, and the blocks holding them."""

    def __init__(self, seq_id: int, request: Request, index: int, max_tokens: int):
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.params = request.params
        self.max_tokens = max_tokens
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.block_tables: list[list[int]] = []  # one per KV group (block_manager), all of one length
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_text: str | None = None
        self.logprobs: list[dict] | None = [] if self.params.logprobs is not None else None
        # the chosen tokens' summed logprob, tracked where logprobs or best_of ranking need it
        tracked = self.params.logprobs is not None or self.params.best_of is not None
        self.cumulative_logprob: float | None = 0.0 if tracked else None
        self.adjusts_logits = self.params.adjusts_logits  # a plain attribute: the sampler checks it per row
        self.scores_prompt = request.prompt_logprobs is not None and index == 0  # completion 0 scores it
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.rng_key = _rng_key(self.params, index)
        self.matcher = None  # the grammar's state for a constrained request (grammar.GrammarRuntime)
        self.pools = request.embed is not None
        self.pool_state = None  # the partial pool of the chunks computed so far (pooling.accumulate)
        self.pools_every_position = False  # mean/CLS pooling: every prompt position must be computed
        self.lora = request.lora  # a plain attribute: the runner and scheduler read it per row
        # the root of its prefix-cache hash chain (block_manager): KV computed under one adapter is never
        # shared with another or with the base model
        self.hash_root = None if self.lora is None else ("lora", self.lora.uid)
        # its rows never replay a decode graph: the graphs hold neither pooling nor LoRA ops
        self.packed_only = self.pools or self.lora is not None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def block_table(self) -> list[int]:
        """The first group's table (a model with one kind of attention has only that one); its length is
        every group's."""
        return self.block_tables[0] if self.block_tables else []

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables = [table]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Completion 0 of a prompt_logprobs request until every prompt position has its entry: its
        prefill must compute logits there, so it never takes cached prefix blocks meanwhile."""
        return self.scores_prompt and len(self.request.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def computes_whole_prompt(self) -> bool:
        """It needs outputs at prompt positions a cached prefix would skip: it takes no cached blocks."""
        return self.needs_prompt_logprobs or self.pools_every_position

    @property
    def hash_ids(self) -> list[int]:
        """The tokens prefix caching hashes: the token ids, with each image placeholder keyed by its
        image's content (multimodal.RequestImages) so a cached block over one image never serves another."""
        images = self.request.images
        if images is None:
            return self.token_ids
        return images.hash_prompt + self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def total_work(self) -> int:
        """Prompt plus output budget: what longest-first admission sorts by."""
        return self.num_prompt_tokens + self.max_tokens


def _rng_key(params: SamplingParams, index: int) -> int:
    """The sequence's counter-based stream key: from (seed, index), or fresh randomness if unseeded."""
    seed = secrets.randbits(64) if params.seed is None else params.seed
    return stream_key(seed, index)
