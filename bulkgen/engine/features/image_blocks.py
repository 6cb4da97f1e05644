"""Image tokens that attend to their whole image (Gemma 3): where the blocks are, how prefill chunks
respect them, and which attention path runs a step that holds them.

In such a model each run of consecutive image tokens (an image block, transformers'
`get_block_sequence_ids_for_mask`) attends bidirectionally: a query in the block also reads the later
tokens of the same block; every other query stays causal (text, decodes, and images reading earlier
images). A full layer's mask is OR(causal, same block); a sliding layer's is AND(window, OR(causal,
same block)), and since the window only bounds keys behind the query, both come to "causal and window,
or a later key of the same block" (attn_plain.visible, `blocks`).

Three rules follow, one per place:
- **Chunking** (`chunk_end`, called by the scheduler): a prefill chunk never computes part of a block
  without the rest of it, since the K/V of a block's first tokens depend on its last ones. A chunk that
  would end inside a block ends at the block's start instead (vLLM's `disable_chunked_mm_input`, which
  it forces for such models); a chunk that starts at (or, after a prefix cache hit, inside) a block takes
  the block's rest whole, even past the step's token budget, by at most one block (vLLM instead requires
  the budget to hold the largest image; here a small budget still runs).
- **Attention** (`step_blocks`, read by the runner into StepPlan.image_blocks): the plain backend masks
  each chunk that reaches a block with the bidirectional rows added.
- **Routing** (`ImageBlockRouting`): the fused CUDA kernels here take only causal (bottom-right) masks,
  so a step whose prefill chunks reach an image block runs on the plain backend; steps without one (every
  decode step, text prefills) keep the fused kernel.

A prefix cache hit may end inside a block: a cached KV block is only ever registered after its tokens
were computed, and under the chunking rule every token of an image block was computed in one step with
the whole rest of its block, so the cached rows are those of a full computation (the prefix hash keys
each image token by its image's content and everything before it, so the block's later tokens are the
same too). Preemption recomputes from the start, under the same rule.
"""

from __future__ import annotations

from bulkgen.engine.attention.attn_plain import PlainBackend
from bulkgen.engine.attention.layer_attention import FULL, AttnKind
from bulkgen.engine.step_plan import HostPack, StepPlan

Blocks = list[tuple[int, int]]  # [start, end) prompt positions of each image block, in order


def runs(rows: list[int]) -> Blocks:
    """The maximal runs of consecutive positions in ascending `rows` (a prompt's image tokens): its
    image blocks. Two images whose tokens touch form one block, as transformers' rule makes them."""
    blocks: Blocks = []
    for row in rows:
        if blocks and blocks[-1][1] == row:
            blocks[-1] = (blocks[-1][0], row + 1)
        else:
            blocks.append((row, row + 1))
    return blocks


def longest(images) -> int:
    """The most tokens of one image block of a request's `images` (multimodal.RequestImages or None):
    the longest chunk its prefill may compute in one step beyond the budget."""
    return max((hi - lo for lo, hi in images.blocks), default=0) if images is not None else 0


def chunk_end(blocks: Blocks, start: int, end: int) -> int:
    """Where a prefill chunk over positions [start, end) must end so that it splits no image block: `end`
    itself unless it falls strictly inside a block; then the block's start if the chunk begins before
    it, else the block's end (the chunk takes the rest of the block whole)."""
    for lo, hi in blocks:
        if lo < end < hi:
            return lo if lo > start else hi
        if lo >= end:
            break
    return end


def whole_blocks(seq, start: int, n: int) -> int:
    """The tokens a chunk of `seq` from position `start` computes, `n` adjusted by `chunk_end` when its
    images attend bidirectionally (their blocks are on the request: multimodal.RequestImages.blocks)."""
    images = seq.request.images
    if images is None or not images.blocks or n <= 0:
        return n
    return chunk_end(images.blocks, start, start + n) - start


def step_blocks(prefill: list) -> list[Blocks] | None:
    """Per prefill (sequence, tokens) pair, the image blocks its chunk reaches; None when none does
    (the step then runs as any causal step)."""
    out, any_block = [], False
    for seq, n in prefill:
        images = seq.request.images
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        reached = [
            (lo, hi) for lo, hi in (images.blocks if images is not None else []) if lo < end and hi > start
        ]
        out.append(reached)
        any_block = any_block or bool(reached)
    return out if any_block else None


class ImageBlockRouting:
    """A fused backend that hands the steps reaching an image block to the plain backend (the only one
    here that takes a mask beyond causal); everything else it runs itself. Its metadata carries the
    backend that prepared it, so bind and attend go to the same one."""

    def __init__(self, fused) -> None:
        self.fused = fused
        self.plain = PlainBackend(decode_kernel=getattr(fused, "decode_kernel", None))

    def __getattr__(self, name: str):
        return getattr(self.fused, name)  # name, supports, device_decode_tables, probe_report, ...

    def prepare(self, plan: StepPlan, pack: HostPack, kind: AttnKind = FULL):
        backend = self.plain if plan.image_blocks else self.fused
        return backend, backend.prepare(plan, pack, kind)

    def bind(self, meta, flat):
        backend, inner = meta
        return backend, backend.bind(inner, flat)

    def attend(self, q, k, v, k_cache, v_cache, meta, scale: float, softcap=None, sinks=None):
        backend, inner = meta
        return backend.attend(q, k, v, k_cache, v_cache, inner, scale, softcap, sinks)


def route(backend):
    """`backend` for a model whose image tokens attend bidirectionally: the plain backend as it is,
    a fused one wrapped so that steps reaching image blocks run plain."""
    return backend if type(backend) is PlainBackend else ImageBlockRouting(backend)
