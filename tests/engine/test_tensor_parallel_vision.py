"""Vision-language models over two gloo tensor-parallel ranks (two processes, one torch thread each):
the language model sharded, the encoder on rank 0 alone, each step's image rows broadcast to the other
rank, M-RoPE positions and image blocks in the step plan.

Per family (LLaVA: 1-D positions; Qwen2.5-VL: M-RoPE; Qwen3-VL: deepstack rows; Gemma 3: bidirectional
image blocks; the other checked families marked slow), one two-rank
engine runs test_vision's mixed batch (text only, one image, two images, the same image twice) with a
5-token step budget, so image runs split across prefill chunks (Gemma 3 takes its blocks whole), and a
KV cache too small for the batch, so sequences are preempted and recomputed: its greedy tokens equal the
single-process engine's under the same limits and transformers' `generate`. Then the same image under
another question hits the prefix cache on both ranks.
"""

from __future__ import annotations

import pytest

from bulkgen.engine import Engine
from bulkgen.lab import tiny_vision
from tests.engine.test_vision import Fixture, mixed_batch, noise_image, run, run_outputs

# one family of each kind (1-D positions, M-RoPE, deepstack, bidirectional blocks); the others, whose
# differences are all on rank 0's side of the broadcast (tiles, framing tokens, Pixtral's sizes), are slow
FAMILIES = ("llava", "qwen2_5_vl", "qwen3_vl", "gemma3") + tuple(
    pytest.param(f, marks=pytest.mark.slow) for f in ("idefics3", "smolvlm", "mistral3", "qwen2_vl")
)
LIMITS = dict(max_num_seqs=4, block_size=2, max_num_batched_tokens=5, admission="shortest_first")


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory, one_thread):
    """(Fixture, single-process engine, two-rank engine) of one family under the same limits; the cache
    holds the longest request alone, so the two shortest, admitted together, outgrow it."""
    path = tiny_vision.build_tiny_vlm(
        tmp_path_factory.mktemp("tpvision") / request.param, request.param, seed=5
    )
    fx = Fixture(path)
    peak = fx.engine(block_size=2, max_num_batched_tokens=64, num_kv_blocks=1).runner.peak_blocks
    lengths = sorted(len(ids) for ids, *_ in mixed_batch(fx))
    cache = max(peak(lengths[0]) + peak(lengths[1]) + 1, peak(lengths[-1] + 8))
    single = fx.engine(num_kv_blocks=cache, **LIMITS)
    sharded = Engine.from_pretrained(
        str(path), device="cpu", tensor_parallel=2, num_kv_blocks=cache, **LIMITS
    )
    yield fx, single, sharded
    sharded.close()


def test_encoder_on_rank_0_and_half_the_language_model(pair):
    fx, single, sharded = pair
    assert sharded.vision.tp is sharded.runner.tp and sharded.vision.tp.rank == 0
    q_proj = sharded.model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.shape[0] * 2 == single.model.model.layers[0].self_attn.q_proj.weight.shape[0]
    encoder = sum(p.numel() for p in sharded.vision.vlm.parameters()) - sum(
        p.numel() for p in sharded.model.parameters()
    )
    whole = sum(p.numel() for p in single.vision.vlm.parameters()) - sum(
        p.numel() for p in single.model.parameters()
    )
    assert encoder == whole > 0, "rank 0 does not hold the whole encoder and projector"


def test_mixed_image_batch_equals_single_engine_and_generate_under_preemption(pair):
    fx, single, sharded = pair
    batch = mixed_batch(fx)
    tokens = run(sharded, batch)
    assert tokens == [expected for *_, expected in batch]
    assert tokens == run(single, batch)
    assert sharded.stats()["preemptions"] > 0, "the small cache never preempted"
    assert sharded.block_manager.num_free_blocks == sharded.runner.num_blocks


def test_a_repeated_image_hits_the_prefix_cache_on_both_ranks(pair):
    fx, _, sharded = pair
    first, second = (fx.prompt([noise_image(7)], q) for q in ("Describe it.", "Name a colour in it."))
    cached = []
    for ids, inputs, encoded in (first, second):
        (out,) = run_outputs(sharded, [(ids, inputs, None)])
        assert out.outputs[0].token_ids == fx.expected(encoded)
        cached.append(out.metrics.num_cached_tokens)
    image_end = max(i for i, t in enumerate(second[0]) if t == sharded.vision.image_token_id) + 1
    assert cached[1] >= image_end - image_end % 2, "the repeated image was computed again"


def test_a_vision_model_refuses_quantize_under_tensor_parallel_before_loading(tmp_path):
    """tensor_parallel is taken now (above), and quantize in one process; the two together are refused
    before any rank starts."""
    path = tiny_vision.build_tiny_vlm(tmp_path / "llava", "llava", seed=5)
    with pytest.raises(ValueError, match="vision-language models run without quantize under tensor_parallel"):
        Engine.from_pretrained(str(path), device="cpu", tensor_parallel=2, quantize="fp8")
