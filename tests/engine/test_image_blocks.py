"""Image tokens that attend to their whole image (Gemma 3, bulkgen.engine.features.image_blocks): the chunking
rule, a prefix cache hit that ends inside an image block, and the routing of such steps away from a
fused kernel that masks causally only. The tiny Gemma 3 model is tests/engine/test_vision.py's."""

from __future__ import annotations

import pytest

from bulkgen.engine.attention import attn_backends
from bulkgen.engine.features.image_blocks import ImageBlockRouting, chunk_end, runs
from bulkgen.lab.tiny_vision import build_tiny_vlm
from tests.engine.test_vision import Fixture, noise_image, run_outputs
from tests.support.attention import reference_varlen


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Fixture:
    return Fixture(build_tiny_vlm(tmp_path_factory.mktemp("gemma3"), "gemma3", seed=5))


def test_blocks_are_runs_and_a_chunk_never_ends_inside_one():
    assert runs([3, 4, 5, 9, 10, 12]) == [(3, 6), (9, 11), (12, 13)]
    blocks = [(4, 8), (10, 20)]
    assert chunk_end(blocks, 0, 3) == 3  # before every block
    assert chunk_end(blocks, 0, 6) == 4  # would end inside the first: stops at its start
    assert chunk_end(blocks, 4, 6) == 8  # starts at a block: takes it whole, past the budget
    assert chunk_end(blocks, 6, 7) == 8  # starts inside one (a prefix cache hit): takes its rest
    assert chunk_end(blocks, 4, 12) == 10  # ends inside the second, which starts after the chunk's start
    assert chunk_end(blocks, 10, 15) == 20
    assert chunk_end(blocks, 8, 10) == 10 and chunk_end(blocks, 0, 20) == 20


def _block(ids: list[int], image_token_id: int) -> tuple[int, int]:
    (block,) = runs([i for i, t in enumerate(ids) if t == image_token_id])
    return block


def test_a_prefix_hit_ending_inside_an_image_block_resumes_it_whole(gemma3):
    """The same image under another question, with a block size that ends the cache hit inside the
    image's block: the next chunk starts there and takes the block's rest whole (past the step's budget),
    and the tokens are transformers'. The cached rows are right because they came from a step that computed the block whole."""
    first = gemma3.prompt([noise_image(7)], "Describe it.")
    second = gemma3.prompt([noise_image(7)], "Name a colour in it.")
    image_token = gemma3.reference.config.image_token_id
    lo, hi = _block(second[0], image_token)
    assert second[1].token_counts == [hi - lo]  # the block is keyed by its own image's hash
    differ = next(i for i, (a, b) in enumerate(zip(first[0], second[0], strict=False)) if a != b)
    # the block size whose hit ends deepest inside the block (the hit is whole blocks before `differ`)
    bs = max(range(2, 17), key=lambda b: hi - differ // b * b if lo < differ // b * b < hi else -1)
    hit, budget = differ // bs * bs, 4
    assert lo < hit and hi - hit > budget
    engine = gemma3.engine(max_num_seqs=2, block_size=bs, max_num_batched_tokens=budget)
    chunks = []
    run_step = engine.runner.run

    def watch(items, pending=None):
        chunks.extend((seq.num_computed_tokens, n) for seq, n in items)
        return run_step(items, pending)

    engine.runner.run = watch
    for ids, inputs, encoded in (first, second):
        chunks.clear()
        (out,) = run_outputs(engine, [(ids, inputs, None)])
        assert out.outputs[0].token_ids == gemma3.expected(encoded)
        assert all(not (lo < start + n < hi) for start, n in chunks), "a chunk ended inside the image block"
    assert out.metrics.num_cached_tokens == hit
    assert chunks[0] == (hit, hi - hit), "the chunk after the hit did not take the block's rest whole"


def _fake_flash(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left=-1):
    return reference_varlen(q, k, v, cu_q, cu_k, scale, window_left)


def test_a_fused_backend_hands_steps_reaching_image_blocks_to_plain(gemma3, monkeypatch):
    """flash_varlen (its CUDA kernel replaced by a reference with its causal-only semantics) runs the
    text and decode steps; steps whose chunks reach an image block run on the plain backend, so the
    tokens are transformers' (run causally, they are not: checked by hand)."""
    from tests.engine.test_vision import mixed_batch

    monkeypatch.setenv("BULKGEN_ATTENTION", "flash_varlen")
    monkeypatch.setattr(attn_backends, "flash_varlen", _fake_flash)
    engine = gemma3.engine(max_num_seqs=4, block_size=4, max_num_batched_tokens=5)
    routing = engine.runner.backend
    assert isinstance(routing, ImageBlockRouting) and routing.name == "flash_varlen"
    used = {"plain": 0, "flash_varlen": 0}
    prepare = routing.prepare

    def count(plan, pack, kind):
        backend, meta = prepare(plan, pack, kind)
        used[backend.name] += 1
        return backend, meta

    routing.prepare = count
    batch = mixed_batch(gemma3)
    outs = run_outputs(engine, batch)
    assert [o.outputs[0].token_ids for o in outs] == [expected for *_, expected in batch]
    assert used["plain"] > 0 and used["flash_varlen"] > 0, used


def test_a_request_is_sized_for_its_image_block_taken_whole(gemma3):
    """A chunk that takes an image block past the step budget holds more sliding-window blocks than a
    budget-sized one: a request is checked against that at add_request (a cache sized for budget-sized
    chunks only took it, then stalled the whole engine with 'scheduler made no progress'), and runs with
    transformers' token in a cache that holds it."""
    from bulkgen.engine import SamplingParams
    from bulkgen.engine.features.multimodal import process

    content = [{"type": "text", "text": "Look"}, {"type": "image"}]  # the block ends near the prompt's end
    text = gemma3.processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [noise_image(1)]
    ids, inputs = process(gemma3.processor, text, images)
    lo, hi = _block(ids, gemma3.reference.config.image_token_id)
    params = SamplingParams(max_tokens=1, temperature=0)
    settings = dict(max_num_seqs=1, block_size=2, max_num_batched_tokens=2)
    runner = gemma3.engine(**settings, num_kv_blocks=1).runner
    budget_sized, block_sized = runner.peak_blocks(len(ids) + 1), runner.peak_blocks(len(ids) + 1, hi - lo)
    assert block_sized > budget_sized
    small = gemma3.engine(**settings, num_kv_blocks=block_sized - 1)
    with pytest.raises(
        ValueError, match=f"needs {block_sized} KV blocks but the cache has {block_sized - 1}"
    ):
        small.add_request("a", ids, params, images=inputs)
    engine = gemma3.engine(**settings, num_kv_blocks=block_sized)
    encoded = gemma3.processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    engine.add_request("a", ids, params, images=inputs)
    done = []
    while engine.has_unfinished():
        done.extend(engine.step())
    (out,) = done
    assert out.outputs[0].token_ids == gemma3.expected(encoded)[:1]
