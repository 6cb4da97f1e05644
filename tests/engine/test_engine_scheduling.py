"""Policies, slot accounting, the incremental interface, abort, and KV block bookkeeping."""

from __future__ import annotations

import time

import pytest

from bulkgen.engine import SamplingParams
from bulkgen.engine.kv.block_manager import BlockManager
from bulkgen.engine.sequence import Request, Sequence
from bulkgen.lab.grouped import scheduler_for


def _params(lengths):
    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]


def test_continuous_refills_slots_and_static_wastes_them(make_engine, mixed_prompts):
    prompts = mixed_prompts(seed=20, count=8, low=4, high=20)
    lengths = [2, 12, 3, 12, 2, 12, 3, 12]
    results = {}
    for policy in ("continuous", "static"):
        engine = make_engine("llama", max_num_seqs=4, scheduler=scheduler_for(policy), admission="fifo")
        outs = engine.generate(prompts, _params(lengths))
        results[policy] = ([o.token_ids for o in outs], engine.stats(), engine.pop_step_records())
    cont_ids, cont, cont_steps = results["continuous"]
    static_ids, static, static_steps = results["static"]
    assert cont_ids == static_ids  # same greedy output, different schedule
    assert cont["padding_slot_steps"] == 0 and cont["prefill_padding_tokens"] == 0
    assert cont["slot_efficiency"] == 1.0
    assert static["padding_slot_steps"] > 0 and static["prefill_padding_tokens"] > 0
    assert static["slot_efficiency"] < 1.0
    assert cont["steps"] < static["steps"]
    assert sum(r["padding_slots"] for r in static_steps) == static["padding_slot_steps"]
    assert max(r["num_seqs"] for r in cont_steps) == 4
    assert sum(int(k) * v for k, v in cont["batch_size_histogram"].items()) == cont["slot_steps"]
    assert cont["output_tokens"] == sum(lengths) == cont["decode_tokens"] + len(prompts)


def test_static_admits_a_new_group_only_when_the_last_is_done(make_engine, mixed_prompts):
    engine = make_engine("llama", max_num_seqs=2, scheduler=scheduler_for("static"))
    engine.generate(mixed_prompts(seed=21, count=4, low=3, high=8), _params([1, 6, 6, 1]))
    held = [r["num_seqs"] for r in engine.pop_step_records()]
    assert set(held) == {2}  # a finished member keeps its slot until the group ends


def test_dynamic_waits_for_queue_delay_or_a_full_group(make_engine, mixed_prompts):
    prompts = mixed_prompts(seed=22, count=3, low=3, high=8)
    engine = make_engine("llama", max_num_seqs=4, scheduler=scheduler_for("dynamic", max_queue_delay=0.3))
    engine.add_request("a", prompts[0], _params([2])[0])
    started = time.time()
    assert engine.step() == [] and engine.stats()["steps"] == 0  # too early, group not full
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert time.time() - started >= 0.25
    assert done[0].metrics.queue_wait_s >= 0.25
    full = make_engine("llama", max_num_seqs=3, scheduler=scheduler_for("dynamic", max_queue_delay=30.0))
    for i, p in enumerate(prompts):
        full.add_request(str(i), p, _params([2])[0])
    full.step()
    assert full.stats()["steps"] == 1  # three waiting = max_num_seqs: start at once


def test_incremental_interface_metrics_and_abort(make_engine, mixed_prompts):
    engine = make_engine("llama", max_num_seqs=2, block_size=4)
    prompts = mixed_prompts(seed=23, count=3, low=5, high=9)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, _params([4])[0])
    with pytest.raises(ValueError, match="already"):
        engine.add_request("r0", prompts[0], _params([4])[0])
    assert engine.num_unfinished() == 3
    engine.step()
    engine.abort(["r0", "missing"])
    assert engine.num_unfinished() == 2
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert sorted(o.request_id for o in finished) == ["r1", "r2"]
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    m = finished[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.num_output_tokens == 4 and m.tpot_s is not None and m.ttft_s >= m.queue_wait_s >= 0
    assert set(m.as_dict()) >= {"ttft_s", "tpot_s", "queue_wait_s", "num_cached_tokens", "num_preemptions"}
    records = engine.pop_step_records()
    assert records and engine.pop_step_records() == []
    assert set(records[0]) == {
        "t",
        "duration_s",
        "num_seqs",
        "active_seqs",
        "prefill_tokens",
        "decode_tokens",
        "padding_slots",
        "max_num_seqs",
        "by_tag",
    }


def test_bad_requests_and_config_raise_clear_errors(make_engine):
    engine = make_engine("llama", num_kv_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("big", list(range(10)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="vocab"):
        engine.add_request("v", [10**6], SamplingParams())
    with pytest.raises(ValueError, match="policy"):
        scheduler_for("greedy")
    with pytest.raises(ValueError, match="max_queue_delay"):
        scheduler_for("dynamic", max_queue_delay=-1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_engine("llama", max_num_seqs=0)


def _seq(tokens, seq_id):
    request = Request(str(seq_id), tokens, SamplingParams(temperature=0), order=seq_id)
    return Sequence(seq_id, request, 0, max_tokens=4)


def test_block_manager_shares_prefix_blocks_and_recycles_them():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = _seq(list(range(10)), 0)
    assert bm.admit(a, bm.match_prefix(a), 10) and len(a.block_table) == 3
    a.num_computed_tokens = 10
    bm.commit(a)
    b = _seq(list(range(8)) + [99, 98, 97], 1)
    cached = bm.match_prefix(b)
    assert cached.tables == [a.block_table[:2]]
    assert bm.admit(b, cached, 11) and b.num_computed_tokens == 8
    assert bm.blocks[cached.tables[0][0]].ref_count == 2 and bm.num_free_blocks == 2
    bm.release(a)
    bm.release(b)
    assert bm.num_free_blocks == 6
    c = _seq(list(range(8)) + [5], 2)
    assert bm.match_prefix(c).tables == cached.tables  # freed but still hashed: revived on a hit
    d = _seq([7] * 24, 3)
    assert bm.admit(d, None, 24) and not bm.match_prefix(c)  # evicted once the pool was needed
    assert not bm.grow(d, 28)


def test_one_flat_row_per_step_and_no_dense_mask(make_engine, mixed_prompts, monkeypatch):
    """Every layer sees one packed row holding all scheduled tokens, and transformers builds no mask."""
    from transformers import AttentionInterface

    from bulkgen.engine.attention import interface as attention

    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((query.shape[0], query.shape[2], attention_mask))
        return attention.paged_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, attention.ATTN_IMPLEMENTATION, spy)
    engine = make_engine("llama", max_num_batched_tokens=40)
    engine.generate(mixed_prompts(seed=24, count=4, low=5, high=30), _params([3, 3, 3, 3]))
    layers = engine.model.config.num_hidden_layers
    tokens = [r["prefill_tokens"] + r["decode_tokens"] for r in engine.pop_step_records()]
    assert [t for _, t, _ in seen[::layers]] == tokens
    assert all(batch == 1 and mask is None for batch, _, mask in seen)
