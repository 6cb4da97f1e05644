"""The sampler's top-p rejection: the same tokens as the plain data-dependent loop, with no host
synchronisation before the tokens' one copy (on CPU by the aten ops it dispatches; on CUDA by
torch's sync debug mode)."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bulkgen.engine import SamplingParams
from bulkgen.engine.sampling import sampler
from bulkgen.engine.sampling.counter_rng import MASK32, stream_key, uniforms
from bulkgen.engine.sampling.sampler import (
    DRAWS_PER_POSITION,
    REJECTION_ROUNDS,
    _in_nucleus,
    _mask_top_k,
    _sorted_nucleus,
)


def _draw(cum, key_lo, key_hi, counter):
    """The draw as the old loop made it: one uniform per call."""
    u = uniforms(key_lo, key_hi, counter)
    return torch.searchsorted(cum, u * cum[:, -1:], right=True).clamp_(max=cum.shape[1] - 1)


def reference_sample_random(logits: torch.Tensor, seqs) -> torch.Tensor:
    """sample_random before it stopped synchronising (commit 9bd310f), verbatim: redraws only the
    pending rows, found with nonzero, and stops when none is left."""
    device, vocab = logits.device, logits.shape[1]
    floats = torch.tensor([[1.0 / s.params.temperature, s.params.top_p] for s in seqs], dtype=torch.float32)
    ints = torch.tensor(
        [
            [
                s.rng_key & MASK32,
                s.rng_key >> 32,
                s.num_output_tokens * DRAWS_PER_POSITION,
                min(s.params.top_k, vocab),
            ]
            for s in seqs
        ],
        dtype=torch.int64,
    )
    floats, ints = floats.to(device, non_blocking=True), ints.to(device, non_blocking=True)
    inv_temp, top_p = floats[:, 0:1], floats[:, 1:2]
    key_lo, key_hi, counter, top_k = (ints[:, i : i + 1] for i in range(4))
    weights = torch.softmax(logits * inv_temp, dim=-1)
    max_k = max((s.params.top_k for s in seqs if s.params.top_k < vocab), default=0)
    if max_k > 0:
        weights = _mask_top_k(weights, torch.where(top_k < vocab, top_k, 0), max_k)
    cum = weights.cumsum(dim=-1)
    token = _draw(cum, key_lo, key_hi, counter)
    if all(s.params.top_p >= 1.0 for s in seqs):
        return token.squeeze(1)
    limit = top_p * cum[:, -1:]
    accepted = _in_nucleus(weights, token, limit)
    pending = (~accepted).squeeze(1).nonzero().squeeze(1)
    for round_ in range(1, REJECTION_ROUNDS):
        if not pending.numel():
            return token.squeeze(1)
        retry = _draw(cum[pending], key_lo[pending], key_hi[pending], counter[pending] + round_)
        ok = _in_nucleus(weights[pending], retry, limit[pending])
        token[pending] = torch.where(ok, retry, token[pending])
        pending = pending[~ok.squeeze(1)]
    if pending.numel():
        u = uniforms(key_lo[pending], key_hi[pending], counter[pending] + REJECTION_ROUNDS)
        token[pending, 0] = _sorted_nucleus(weights[pending], top_p[pending], u)
    return token.squeeze(1)


def reference_tokens(logits: torch.Tensor, seqs) -> list[int]:
    tokens = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        index = torch.tensor(rows)
        tokens[index] = reference_sample_random(logits[index], [seqs[i] for i in rows])
    return tokens.tolist()


SEQ_IDS = itertools.count()


def _seq(rng: random.Random, vocab: int, greedy: bool = False, logprobs: bool = False, **params):
    defaults = {
        "temperature": rng.choice([0.3, 0.7, 1.0, 1.5]),
        "top_p": rng.choice([0.1, 0.5, 0.9, 0.95, 1.0]),
        "top_k": rng.choice([0, 0, 1, 5, 40, vocab + 10]),
    }
    defaults.update(params)
    return SimpleNamespace(
        seq_id=next(SEQ_IDS),
        params=SimpleNamespace(
            greedy=greedy, logprobs=None, min_p=0.0, **defaults
        ),  # the reference has no min_p
        rng_key=stream_key(rng.randrange(-(2**63), 2**64), rng.randrange(4)),
        num_output_tokens=rng.randrange(0, 5000),
        adjusts_logits=False,
        cumulative_logprob=0.0 if logprobs else None,
    )


def _batch(rng: random.Random, rows: int, vocab: int, greedy_share: float = 0.0, **params):
    # Sharp and flat rows alike: a flat row with a low top_p misses every round (the sorted fallback).
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    logits *= torch.tensor([rng.choice([0.2, 1.0, 4.0]) for _ in range(rows)])[:, None]
    seqs = [_seq(rng, vocab, greedy=rng.random() < greedy_share, **params) for _ in range(rows)]
    return logits, seqs


def _statuses(logits: torch.Tensor, seqs) -> set[int]:
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if not random_rows:
        return set()
    draw = sampler.sample_random(logits[random_rows], [seqs[i] for i in random_rows])
    return set() if draw.status is None else set(draw.status.tolist())


@pytest.mark.parametrize(
    "redrawn,statuses",
    [
        (None, {sampler.SETTLED, sampler.EXHAUSTED}),
        (0, {sampler.SETTLED, sampler.SKIPPED}),
        (3, {sampler.SETTLED, sampler.SKIPPED, sampler.EXHAUSTED}),
    ],
)
@pytest.mark.parametrize("early_exit", [frozenset({"cpu"}), frozenset()], ids=["cpu-rounds", "gpu-rounds"])
def test_tokens_equal_the_plain_rejection_loop(monkeypatch, redrawn, statuses, early_exit):
    """Many batches (1-300 rows, mixed temperature, top-k, top-p down to 0.1, keys, positions and
    greedy rows): token for token what the old loop chose. `redrawn` shrinks the rows given rounds
    1.. on the device (None: as shipped), so SKIPPED rows (settled after the copy) occur too; the
    rounds stop once all rows settle (CPU) or all run (GPU)."""
    monkeypatch.setattr(sampler, "EARLY_EXIT", early_exit)
    if redrawn is not None:
        monkeypatch.setattr(sampler, "_redrawn_rows", lambda seqs: redrawn)
    rng = random.Random(2024 + (redrawn or 0))
    seen: set[int] = set()
    for rows in (1, 2, 3, 8, 17, 64, 130, 300):
        for _ in range(3):
            vocab = rng.choice([7, 64, 500, 3000])
            logits, seqs = _batch(rng, rows, vocab, greedy_share=rng.choice([0.0, 0.3]))
            seen |= _statuses(logits, seqs)
            tokens, _ = sampler.sample(logits.clone(), seqs)
            assert tokens == reference_tokens(logits, seqs), (rows, vocab)
    assert seen == statuses


def test_logprobs_follow_the_settled_tokens():
    """A row settled after the copy (sorted fallback) reports the logprob of the token it returned."""
    rng = random.Random(5)
    logits, seqs = _batch(rng, 40, 300, top_p=0.1, logprobs=True)
    assert sampler.EXHAUSTED in _statuses(logits, seqs)
    tokens, logprobs = sampler.sample(logits.clone(), seqs)
    logp = torch.log_softmax(logits, dim=-1)
    for row, (token, entry) in enumerate(zip(tokens, logprobs, strict=True)):
        assert entry[0] == pytest.approx(float(logp[row, token]), abs=1e-6)


class _Ops(TorchDispatchMode):
    """Records each aten op, and whether an index or index_put took a boolean mask."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(("aten.index.", "aten.index_put")) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        ):
            name = "boolean index: " + name
        self.names.append(name)
        return func(*args, **(kwargs or {}))


SYNCING = (
    "aten.nonzero",
    "aten._local_scalar_dense",
    "aten.is_nonzero",
    "aten.item",
    "aten.masked_select",
    "boolean index",
)


def _run_counting_copies(monkeypatch, fn, *args):
    copies = []
    tolist = torch.Tensor.tolist

    def counted(self):
        copies.append(tuple(self.shape))
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    with _Ops() as ops:
        result = fn(*args)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return result, copies, [n for n in ops.names if n.startswith(SYNCING)]


@pytest.mark.parametrize("greedy_share", [0.0, 0.4])
def test_a_step_copies_once_and_runs_no_data_dependent_op(monkeypatch, greedy_share):
    """64 rows at top_p 0.9 (with and without greedy rows, logprobs off): the one host copy is the
    tokens', and no op the host must wait on (nonzero, item, a boolean mask) runs. The rounds run as on
    a GPU (on CPU they stop early once every row is settled: a flag read that costs nothing there)."""
    monkeypatch.setattr(sampler, "EARLY_EXIT", frozenset())
    rng = random.Random(11)
    logits, seqs = _batch(rng, 64, 1000, greedy_share=greedy_share, top_p=0.9)
    greedy = sum(s.params.greedy for s in seqs)
    assert (greedy > 0) == (greedy_share > 0) and greedy < len(seqs)
    (tokens, _), copies, syncing = _run_counting_copies(monkeypatch, sampler.sample, logits.clone(), seqs)
    assert copies == [(2, 64)] and syncing == []
    assert tokens == reference_tokens(logits, seqs)


def test_the_op_check_catches_the_plain_loop(monkeypatch):
    """The same check fails the old loop (so the one above can fail)."""
    rng = random.Random(11)
    logits, seqs = _batch(rng, 64, 1000, top_p=0.9)
    _, _, syncing = _run_counting_copies(monkeypatch, reference_tokens, logits, seqs)
    assert "aten.nonzero.default" in syncing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_synchronises_only_for_the_token_copy(monkeypatch):
    """On CUDA with sync debug mode "error", every synchronising call but the tokens' tolist (let
    through, counted) raises; the tokens equal the plain loop's on the same device."""
    rng = random.Random(12)
    logits, seqs = _batch(rng, 64, 32000, greedy_share=0.25, top_p=0.9)
    logits = logits.cuda()
    sampler.sample(logits.clone(), seqs)  # warm-up: first-use allocations and kernels
    copies = []
    tolist = torch.Tensor.tolist

    def let_through(self):
        copies.append(tuple(self.shape))
        torch.cuda.set_sync_debug_mode(0)
        try:
            return tolist(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(torch.Tensor, "tolist", let_through)
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, _ = sampler.sample(logits.clone(), seqs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    assert copies == [(2, 64)]
    assert tokens == reference_tokens(logits, seqs)


def test_sampling_constants_are_written_once_per_sequence_and_their_rows_reused(make_engine, monkeypatch):
    """The engine keeps random rows' constants on the device: each sequence's row is written when it
    first samples (not every step), released when its request ends, and a reused row carries the new
    sequence's constants: a second batch on the same engine samples what it samples on a fresh one."""
    writes = []
    write = sampler.SamplingRows._write
    monkeypatch.setattr(
        sampler.SamplingRows, "_write", lambda self, fresh, *a: writes.extend(fresh) or write(self, fresh, *a)
    )

    def params(seed: int, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=seed, ignore_eos=True, **kw)

    first = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 11]
    second = [[20, 21], [22] * 7, [23, 24, 25, 26], [27] * 3]
    second_params = [params(100 + i, top_k=5 * i) if i else params(100, n=2) for i in range(4)]
    engine = make_engine("llama", max_num_seqs=4)
    engine.generate(first, [params(i) for i in range(3)])
    assert len(writes) == 3 and len({seq.seq_id for _, seq in writes}) == 3
    assert engine.constants.rows == {} and len(engine.constants.free) == engine.constants.floats.shape[0]
    got = [[c.token_ids for c in o.outputs] for o in engine.generate(second, second_params)]
    assert len(writes) == 3 + 5 and engine.constants.rows == {}  # n=2: two sequences, two rows
    fresh = make_engine("llama", max_num_seqs=4)
    assert got == [[c.token_ids for c in o.outputs] for o in fresh.generate(second, second_params)]


def test_a_top_p_step_dispatches_each_rounds_hash_once(monkeypatch):
    """On a GPU every small op is a launch the host pays for (~20 us each on the H200's host, where a top-p
    step of 64 rows cost 8 ms more than a greedy one): every round's uniforms come from one hash and every
    redraw from one search, so a step's ops do not grow with the rounds (558 ops when each round hashed and
    searched on its own; 200 now)."""
    monkeypatch.setattr(sampler, "EARLY_EXIT", frozenset())  # the rounds as a GPU runs them
    rng = random.Random(11)
    logits, seqs = _batch(rng, 64, 1000, greedy_share=0.0, top_p=0.9)
    with _Ops() as ops:
        tokens, _ = sampler.sample(logits.clone(), seqs)
    assert tokens == reference_tokens(logits, seqs)
    assert len(ops.names) <= 240, len(ops.names)
    assert ops.names.count("aten.__xor__.Tensor") <= 16  # the hash's xors, once (was 120: 8 per round)
    assert ops.names.count("aten.searchsorted.Tensor") <= 2  # round 0's draw and the redraws'
