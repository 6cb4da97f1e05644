"""KV memory follows each layer's attention: groups of layers by kind, and windowed groups giving back the
blocks behind their window while the sequence runs (block_manager, kv_layout)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.attention.layer_attention import FULL, AttnKind, LayerAttention
from bulkgen.engine.kv.block_manager import BlockManager
from bulkgen.engine.kv.kv_layout import KVLayout
from bulkgen.engine.sequence import Request, Sequence
from bulkgen.lab.tiny import WINDOW, build_tiny_model

SLIDING = AttnKind(window=32)


def _layers(kinds: list[AttnKind]) -> list[LayerAttention]:
    return [LayerAttention(kind, 8, 64, 64, q_heads=64) for kind in kinds]


def _seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    request = Request(str(seq_id), list(tokens), SamplingParams(temperature=0), order=seq_id)
    return Sequence(seq_id, request, 0, max_tokens=4)


def test_layers_group_by_kind_with_as_many_layers_per_group():
    """Gemma 3 27B's pattern: 5 sliding layers to 1 full, 62 layers -> one full group of 10 and six
    sliding groups (10, 10, 10, 10, 10 and 2 layers) sharing 10 slot tensors; gpt-oss-20b's alternation
    -> two groups of 12."""
    gemma = KVLayout(_layers([FULL if i % 6 == 5 else AttnKind(window=1024) for i in range(62)]))
    assert gemma.slots == 10 and [len(g.layers) for g in gemma.groups] == [10, 10, 10, 10, 10, 2, 10]
    assert [str(g.kind) for g in gemma.groups].count("full") == 1
    assert sorted(zip(gemma.layer_group, gemma.layer_slot, strict=True)) == sorted(
        (g, s) for g, group in enumerate(gemma.groups) for s in range(len(group.layers))
    )
    oss = KVLayout(_layers([AttnKind(window=128) if i % 2 == 0 else FULL for i in range(24)]))
    assert oss.slots == 12 and len(oss.groups) == 2
    assert oss.block_bytes(16, torch.bfloat16) == 12 * 16 * 8 * (64 + 64) * 2
    dense = KVLayout(_layers([FULL] * 4))
    assert dense.slots == 4 and len(dense.groups) == 1
    with pytest.raises(ValueError, match="different KV head shapes"):
        KVLayout([LayerAttention(FULL, 8, 64, 64), LayerAttention(FULL, 4, 64, 64)])


def test_a_sliding_group_gives_back_the_blocks_behind_its_window_as_the_sequence_runs():
    bm = BlockManager(200, 8, kinds=[FULL, SLIDING])
    seq = _seq(list(range(300)))
    assert bm.admit(seq, None, 64)
    full, sliding = seq.block_tables
    for end in [*range(128, 300, 64), *range(300 - 7, 301)]:  # prefill chunks of 64 tokens, then decodes
        seq.num_computed_tokens = end - 64 if end % 64 == 0 else end - 1
        bm.slide(seq)  # what the scheduler does before growing a running sequence
        assert bm.grow(seq, end)
        first = SLIDING.first_visible(seq.num_computed_tokens) // 8
        assert all(b == bm.null_block for b in sliding[:first])
        assert bm.null_block not in sliding[first:] and bm.null_block not in full
    seq.num_computed_tokens = 300
    bm.slide(seq)
    assert len(full) == len(sliding) == 300 // 8 + 1
    held = sum(b != bm.null_block for t in seq.block_tables for b in t)
    assert held == len(full) + len(sliding) - SLIDING.first_visible(300) // 8  # 38 + 5, not 76
    assert bm.num_free_blocks == 200 - held
    bm.release(seq)
    assert bm.num_free_blocks == 200


def test_admission_and_growth_count_every_group():
    bm = BlockManager(10, 8, kinds=[FULL, SLIDING, SLIDING])
    a, b = _seq(list(range(24)), 0), _seq(list(range(100, 109)), 1)
    assert bm.admit(a, None, 24) and bm.num_free_blocks == 1  # 3 blocks in each of 3 groups
    assert not bm.admit(b, None, 9) and b.block_tables == []  # needs 2 x 3
    assert not bm.grow(a, 25)


def _compute(bm: BlockManager, seq: Sequence, step: int = 64) -> None:
    """Run `seq`'s prompt through the block manager as the scheduler and engine would."""
    while seq.num_computed_tokens < len(seq):
        bm.slide(seq)
        end = min(seq.num_computed_tokens + step, len(seq))
        assert bm.grow(seq, end)
        seq.num_computed_tokens = end
        bm.commit(seq)


def test_a_prefix_hit_needs_only_what_each_group_reads_and_all_of_it():
    """A prompt sharing 100 tokens with a finished one starts after 12 cached blocks: all 12 from the
    full group, the last 4 (inside the window of position 96) from the sliding group, null before. Once
    those are evicted (blocks given back behind a window are the oldest free ones), the prefix is not
    reused, though the full group still holds it."""
    bm = BlockManager(120, 8, kinds=[FULL, SLIDING])
    first = _seq(list(range(300)), 0)
    assert bm.admit(first, None, 64)
    _compute(bm, first)
    bm.release(first)
    second = _seq(list(range(100)) + [999] * 7, 1)
    hit = bm.match_prefix(second)
    assert len(hit) == 12
    lo = SLIDING.first_visible(96) // 8
    assert hit.tables[1][:lo] == [bm.null_block] * lo and bm.null_block not in hit.tables[1][lo:]
    assert bm.null_block not in hit.tables[0]
    # the run took 76 fresh ids and gave back sliding blocks 0..27 behind the window first (the oldest
    # free ones); 44 fresh ids + the 12 oldest = 28 blocks in each of the 2 groups: sliding 0..11 go
    taker = _seq(list(range(5000, 5000 + 28 * 8)), 2)
    assert bm.admit(taker, None, len(taker))
    assert all(bm.blocks[b].hash is None for b in hit.tables[1][lo:])
    assert all(bm.blocks[b].hash is not None for b in hit.tables[0])  # the full group alone would hit
    assert bm.match_prefix(second) is None


def test_window_freeing_holds_fewer_blocks_and_gives_transformers_tokens(tmp_path):
    """gpt-oss (a 32-token window on one layer of two): both prompts run at once in 80 blocks, where keeping
    every block of both groups would take 2 x 39 + 2 x 16 = 110; the tokens stay transformers'."""
    path = build_tiny_model(tmp_path / "oss", "gpt_oss", seed=4)
    engine = Engine.from_pretrained(str(path), block_size=8, max_num_batched_tokens=64, num_kv_blocks=80)
    assert [str(k) for k in engine.runner.layout.kinds] == [f"sliding window {WINDOW}", "full"]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (300, 120)]
    held = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.token_ids
        held.append(engine.block_manager.num_blocks - engine.block_manager.num_free_blocks)
    assert engine.stats()["preemptions"] == 0 and held[-1] == 0
    assert max(r["num_seqs"] for r in engine.pop_step_records()) == 2  # side by side, not one after the other
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model.generation_config.eos_token_id = None
    for i, prompt in enumerate(prompts):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
        assert done[str(i)] == want.tolist()


def test_kv_memory_bench_counts_what_the_block_manager_holds():
    """bench/bench_kv_memory.py's figures: an 8k-token gpt-oss-20b sequence holds 512 full blocks and the
    last 8 of its 128-token window (two groups of 12 layers), half of what 24 full layers held."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "bench_kv_memory.py"
    spec = importlib.util.spec_from_file_location("bench_kv_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    oss = bench.windows_row("gpt-oss-20b", bench.gpt_oss_20b(), 8192, 64 << 30)
    assert (oss["before_blocks"], oss["after_blocks"]) == (512, 512 + 8)
    assert (
        oss["before_bytes"] == 512 * 24 * 16 * 8 * 128 * 2
        and oss["after_bytes"] == 520 * 12 * 16 * 8 * 128 * 2
    )
    gemma = bench.windows_row("Gemma-3-27B", bench.gemma_3_27b(), 8192, 64 << 30)
    assert gemma["after_blocks"] == 512 + 6 * 64 and gemma["seqs_after"] > 3 * gemma["seqs_before"]
    mla = bench.mla_row(8192, 64 << 30)  # the latent: 61 layers x (512 + 64) against 128 heads x (192 + 128)
    assert (mla["bytes_per_token_latent"], mla["bytes_per_token_expanded"]) == (
        61 * 576 * 2,
        61 * 128 * 320 * 2,
    )
    assert mla["seqs_latent"] == (64 << 30) // (512 * 16 * 61 * 576 * 2) == 119
    # an FP8 cache: one byte an element plus a 4-byte scale per token and KV head, for K and for V
    llama = bench.dtype_row("Llama-3-8B", bench.llama_3_8b(), 8192)
    assert llama["bf16_bytes_per_token"] == 32 * 8 * 2 * 128 * 2 and llama["bf16_seqs_per_gib"] == 1.0
    assert llama["fp8_bytes_per_token"] == 32 * 8 * 2 * (128 + 4) and llama["ratio"] == round(256 / 132, 3)
    oss_fp8 = bench.dtype_row("gpt-oss-20b", bench.gpt_oss_20b(), 8192)
    assert oss_fp8["fp8_seqs_per_gib"] == round((1 << 30) / (520 * 12 * 16 * 8 * 2 * (64 + 4)), 2)
