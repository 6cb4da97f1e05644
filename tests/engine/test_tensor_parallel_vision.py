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

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.model.quantize import Fp8Linear
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


def test_online_fp8_quantizes_each_ranks_text_shard_and_keeps_the_encoder_float(tmp_path, one_thread):
    """`quantize="fp8"` with tensor_parallel: each rank's decoder linears are its own FP8 shard (half of
    the single-process FP8 engine's rows), rank 0's encoder and projector stay float as in one process, and
    the image prompts' logprobs are as close to the single FP8 engine's as FP8 itself is to float: row-
    parallel shards take their own scales (test_tensor_parallel_fp8.py), so the two differ by quantization
    noise, which this tiny model's wide weights make large (measured: FP8 vs float up to 0.20, two-rank vs
    one-process FP8 up to 0.31); a follower without the image rows would be off by far more."""
    path = tiny_vision.build_tiny_vlm(tmp_path / "llava", "llava", seed=5)
    fx = Fixture(path)
    float_ = Engine.from_pretrained(str(path), device="cpu")
    single = Engine.from_pretrained(str(path), device="cpu", quantize="fp8")
    sharded = Engine.from_pretrained(str(path), device="cpu", tensor_parallel=2, quantize="fp8")
    try:
        q_tp, q_one = (e.model.model.layers[0].self_attn.q_proj for e in (sharded, single))
        assert isinstance(q_tp, Fp8Linear) and isinstance(q_one, Fp8Linear)
        assert q_tp.weight.shape[0] * 2 == q_one.weight.shape[0]
        tower = [m for n, m in sharded.vision.vlm.named_modules() if "language_model" not in n]
        assert tower and not any(isinstance(m, Fp8Linear) for m in tower), "the encoder was quantized"
        params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1)
        sharding, quantizing = 0.0, 0.0
        for ids, inputs, _ in mixed_batch(fx):
            two, one, whole = (prompt_logprobs(e, ids, inputs, params) for e in (sharded, single, float_))
            assert len(two) == len(one) == len(whole) > 0
            sharding = max(sharding, *(abs(a - b) for a, b in zip(two, one, strict=True)))
            quantizing = max(quantizing, *(abs(a - b) for a, b in zip(one, whole, strict=True)))
        assert 0 < quantizing and sharding < 2 * quantizing, (sharding, quantizing)
    finally:
        sharded.close()


def prompt_logprobs(engine: Engine, ids, inputs, params) -> list[float]:
    engine.add_request("p", ids, params, images=inputs)
    done = [out for _ in iter(engine.has_unfinished, False) for out in engine.step()]
    return [e["logprob"] for e in done[-1].prompt_logprobs if e is not None]
