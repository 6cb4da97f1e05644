"""The triton paged-decode kernel against the padded reference, run by triton's CPU interpreter.

On CUDA the kernel is compiled; here `TRITON_INTERPRET=1` runs the same kernel body on numpy. The
interpreter cannot loop to a bound held in a tensor, so it walks a fixed count of blocks per split with
the blocks past a sequence's end masked, where the compiled kernel loops over the sequence's own
blocks only; the loop's body (`_attend_tile`: one or more whole blocks) is the same code in both.
"""

from __future__ import annotations

import os

import pytest
import torch

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.attention import triton_decode as td
from bulkgen.engine.attention.attn_backends import DecodeMeta, PlainBackend, paged_decode
from bulkgen.engine.attention.layer_attention import FULL, AttnKind
from bulkgen.engine.decode_graphs import buckets_up_to


@pytest.fixture
def interpreted():
    """The kernel module, built under triton's interpreter (tests/conftest.py sets it without a GPU)."""
    assert td.available(), "triton is a test dependency: pip install -e '.[test]'"
    assert os.environ.get("TRITON_INTERPRET") == "1", "no GPU here: triton must run in its interpreter"
    return td


def _case(
    seed: int,
    lengths: list[int],
    hq: int,
    hkv: int,
    dim: int,
    block_size: int,
    dtype=torch.float32,
    dim_v=None,
):
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    width = max(-(-n // block_size) for n in lengths) + 1  # one padding column: must never be read
    blocks = batch * width + 2
    table = torch.randperm(blocks, generator=gen)[: batch * width].view(batch, width)
    k_cache = torch.randn(blocks, block_size, hkv, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block_size, hkv, dim_v or dim, generator=gen).to(dtype)
    q = torch.randn(batch, hq, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(lengths)


# the interpreter's seconds: the launch choices run in the full suite, not the edit tier
SLOW = pytest.mark.slow
# the defaults; several blocks per loop iteration (a tile of 32 rows); tiles of 64 rows over more splits
TUNINGS = [None, pytest.param({"tile_tokens": 64, "target_programs": 528, "num_warps": 8}, marks=SLOW)]


@pytest.mark.parametrize(
    "lengths,hq,hkv,dim,block_size",
    [
        ([1, 5, 16, 17, 40], 8, 2, 16, 4),  # GQA 4:1, a one-token context, exact block multiples
        ([33, 2, 64], 4, 4, 24, 16),  # no GQA, a head dim that is no power of two
        ([70], 6, 2, 16, 8),  # one sequence: its blocks split across programs
    ],
)
@pytest.mark.parametrize("tuning", TUNINGS, ids=str)
def test_kernel_matches_the_padded_reference(interpreted, lengths, hq, hkv, dim, block_size, tuning):
    q, k_cache, v_cache, table, lens = _case(len(lengths), lengths, hq, hkv, dim, block_size)
    got = interpreted.paged_decode(q, k_cache, v_cache, table, lens, dim**-0.5, tuning=tuning)
    want = paged_decode(q, k_cache, v_cache, DecodeMeta(0, len(lengths), table, lens), dim**-0.5, "padded")
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)


LAYER_CASES = {  # kind, soft-cap, sinks, V head size
    "sliding window 5": (AttnKind(window=5), None, False, None),
    "window of a block": (AttnKind(window=4), None, False, None),
    "chunked 8": (AttnKind(chunk=8), None, False, None),
    "soft-cap": (FULL, 1.5, False, None),
    "sinks": (FULL, None, True, None),
    "window, soft-cap and sinks": (AttnKind(window=6), 2.0, True, None),
    "MLA: V heads 8 of K heads 24": (FULL, None, False, 8),
}


@pytest.mark.parametrize(
    "name, tuning",
    [(name, None) for name in LAYER_CASES]
    + [
        pytest.param(name, {"tile_tokens": 32}, marks=SLOW)
        for name in ("chunked 8", "window, soft-cap and sinks", "MLA: V heads 8 of K heads 24")
    ],
    ids=str,
)
def test_kernel_takes_windows_chunks_softcap_sinks_and_narrow_v(interpreted, name, tuning):
    kind, softcap, sinks, dim_v = LAYER_CASES[name]
    lengths, hq, hkv, dim, bs = [1, 5, 9, 16, 23, 40], 8, 2, 24 if dim_v else 16, 4
    q, k_cache, v_cache, table, lens = _case(11, lengths, hq, hkv, dim, bs, dim_v=dim_v)
    sink = torch.randn(hq, generator=torch.Generator().manual_seed(5)) if sinks else None
    got = interpreted.paged_decode(
        q, k_cache, v_cache, table, lens, dim**-0.5, kind.window, kind.chunk, softcap, sink, tuning
    )
    meta = DecodeMeta(0, len(lengths), table, lens, kind=kind)
    want = paged_decode(q, k_cache, v_cache, meta, dim**-0.5, "padded", softcap, sink)
    assert got.shape == (len(lengths), hq, dim_v or dim)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if not kind.is_full:  # the reference itself: each query reads exactly its window or chunk
        dense = paged_decode(
            q, k_cache, v_cache, DecodeMeta(0, len(lengths), table, lens), dim**-0.5, "padded"
        )
        far = [i for i, n in enumerate(lengths) if kind.first_visible(n - 1) > 0]
        assert not torch.allclose(dense[far], want[far])


def test_blocks_wholly_before_the_window_are_never_read(interpreted):
    """A sliding group's table still names the blocks it gave back (other sequences may own them now):
    filled with NaN here, they must not reach the output."""
    q, k_cache, v_cache, table, lens = _case(8, [30, 17], 4, 2, 16, 4)
    want = interpreted.paged_decode(q, k_cache, v_cache, table, lens, 0.25, 6)
    behind = [int(table[i, j]) for i, n in enumerate(lens.tolist()) for j in range((n - 6) // 4)]
    assert behind
    k_cache[behind], v_cache[behind] = float("nan"), float("nan")
    torch.testing.assert_close(interpreted.paged_decode(q, k_cache, v_cache, table, lens, 0.25, 6), want)


def test_padding_and_other_sequences_blocks_are_never_read(interpreted):
    q, k_cache, v_cache, table, lens = _case(7, [9, 3], 4, 2, 16, 4)
    want = interpreted.paged_decode(q, k_cache, v_cache, table, lens, 0.25)
    used = {int(table[i, j]) for i, n in enumerate(lens.tolist()) for j in range(-(-n // 4))}
    unused = [b for b in range(k_cache.shape[0]) if b not in used]
    k_cache[unused], v_cache[unused] = float("nan"), float("nan")
    torch.testing.assert_close(interpreted.paged_decode(q, k_cache, v_cache, table, lens, 0.25), want)


def test_half_precision_keeps_float32_scores(interpreted):
    q, k_cache, v_cache, table, lens = _case(3, [12, 30], 8, 2, 32, 16, torch.float16)
    got = interpreted.paged_decode(q, k_cache, v_cache, table, lens, 32**-0.5)
    want = paged_decode(
        q.float(), k_cache.float(), v_cache.float(), DecodeMeta(0, 2, table, lens), 32**-0.5, "padded"
    )
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


def test_splits_depend_on_shapes_only_and_never_exceed_the_blocks():
    assert td.num_splits(512, 8, 96) == 1
    assert td.num_splits(1, 8, 96) == 16 and td.num_splits(1, 8, 3) == 3
    assert all(
        1 <= td.num_splits(b, h, w) <= min(w, 16) for b in (1, 7, 64) for h in (1, 8) for w in (1, 5, 200)
    )


def test_every_split_gets_blocks_of_a_short_context_in_a_wide_table(interpreted):
    """The decode graphs pass a table as wide as the longest allowed context (8,192 columns at the anchor):
    a 10-block context must still spread over the splits (dealt in turn), not all land in split 0."""
    q, k_cache, v_cache, _, lens = _case(5, [10 * 16, 3 * 16 + 5], 8, 2, 16, 16)
    table = torch.zeros(2, 512, dtype=torch.long)  # wide: only the first columns are real
    table[0, :10], table[1, :4] = torch.arange(10), torch.arange(10, 14)
    splits = td.num_splits(2, 2, table.shape[1])
    assert splits == 16
    acc, stats = td._launch(q, k_cache, v_cache, table, lens, 0.25, splits)
    holding = (stats[1] > 0).sum(dim=-1)  # splits whose running sum saw a block, per (sequence, head)
    assert holding[0].tolist() == [10] * 8 and holding[1].tolist() == [4] * 8
    want = paged_decode(q, k_cache, v_cache, DecodeMeta(0, 2, table, lens), 0.25, "padded")
    got = td._merge(acc, stats[0], stats[1]).to(q.dtype)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    # tiles of two blocks are dealt the same way: 5 tiles of the 10 blocks, 2 of the 4
    acc, stats = td._launch(q, k_cache, v_cache, table, lens, 0.25, splits, tile=2)
    holding = (stats[1] > 0).sum(dim=-1)
    assert holding[0].tolist() == [5] * 8 and holding[1].tolist() == [2] * 8
    torch.testing.assert_close(td._merge(acc, stats[0], stats[1]).to(q.dtype), want, atol=2e-6, rtol=2e-5)


@pytest.mark.slow  # whole engine runs through the interpreted kernel: 9 s of CPU
def test_engine_decodes_through_the_kernel_to_the_reference_tokens(
    interpreted, monkeypatch, model_dirs, reference, mixed_prompts
):
    """Forced on CPU (BULKGEN_DECODE_KERNEL=triton), eagerly and through the static decode buckets."""
    monkeypatch.setenv("BULKGEN_DECODE_KERNEL", "triton")
    calls = []
    kernel = interpreted.paged_decode
    monkeypatch.setattr(interpreted, "paged_decode", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    prompts = mixed_prompts(seed=71, count=3, low=2, high=30)
    for graphs in (False, True):
        engine = Engine.from_pretrained(
            str(model_dirs["llama"]), cuda_graphs=graphs, block_size=4, num_kv_blocks=64
        )
        decode_backend = engine.runner.graphs.plain if graphs else engine.runner.backend
        assert isinstance(decode_backend, PlainBackend)
        # 3 tokens: two decode steps through the interpreted kernel (each costs seconds), eager and graphed
        outs = engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert [o.token_ids for o in outs] == [reference.greedy("llama", p, 3) for p in prompts]
        assert calls and max(calls) == len(prompts)  # every decode row went through the kernel
        calls.clear()
    graphs = engine.runner.graphs  # the paged kernel reads real blocks only: buckets by batch size alone
    assert graphs.paged and {w for _, w in graphs.buckets} == {graphs.max_width}
    assert graphs.capture(40) == len(buckets_up_to(engine.config.max_num_seqs)) == len(graphs.buckets)


@pytest.mark.slow  # whole engine runs through the interpreted kernel: 3 s of CPU each
@pytest.mark.parametrize("arch", ["gpt_oss", "gemma2"])
def test_engine_decodes_windowed_sink_and_softcapped_layers_through_the_kernel(
    interpreted, monkeypatch, tmp_path, arch
):
    """gpt-oss (sinks, a window on every other layer) and Gemma 2 (soft-capping, the same windows): the
    decode rows of contexts longer than the window go through the kernel and give transformers' tokens."""
    from transformers import AutoModelForCausalLM

    from bulkgen.lab.tiny import WINDOW, build_tiny_model

    monkeypatch.setenv("BULKGEN_DECODE_KERNEL", "triton")
    path = build_tiny_model(tmp_path / arch, arch, seed=2)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (WINDOW + 9, 5)]
    engine = Engine.from_pretrained(str(path), block_size=4, num_kv_blocks=64)
    outs = engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs, strict=True):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)[0, len(prompt) :]
        assert out.token_ids == want.tolist()
