"""The CUDA-graph decode path, driven on CPU with fake torch.cuda graph objects.

A fake graph's capture asserts autograd is off (a captured forward that records autograd keeps its
whole graph alive: ~290 GB at the GPU bench's shapes), and its replay re-runs the forward from the
bucket's static buffers into the captured output tensor, so stale metadata or a reused output shows
up as different tokens from the eager engine. A capture that raises must leave the engine working.
"""

from __future__ import annotations

import contextlib
import logging
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from bulkgen.engine import Engine, SamplingParams
from bulkgen.lab.tiny_hybrid import build_tiny_hybrid

PROMPTS = [[1, 2, 3, 4, 5], [7] * 13, [9, 8, 7], [5] * 30]
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 3, 14, 6)]
ENGINE_KW = dict(max_num_seqs=6, block_size=4, max_num_batched_tokens=48, num_kv_blocks=256)


class FakeStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


class FakeGraph:
    """Replay = run the bucket's forward again from its static buffers into the captured output."""

    owner = None
    fail_capture = False  # the forward raises while being captured (an OOM, a sync op)
    capturing = False

    def pool(self) -> str:
        return "pool"

    def replay(self) -> None:
        graphs = FakeGraph.owner
        bucket = next(b for b in graphs.buckets.values() if b.graph is self)
        bucket.out.copy_(graphs._forward(bucket))


@contextlib.contextmanager
def fake_capture(graph, pool=None):
    assert not torch.is_grad_enabled(), "CUDA graph captured with autograd recording"
    FakeGraph.capturing = True
    try:
        yield
    except RuntimeError:  # what capture_end raises over the real error, hiding it
        raise RuntimeError("operation failed due to a previous error during capture") from None
    finally:
        FakeGraph.capturing = False


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(FakeGraph, "fail_capture", False)


def _model(model_dirs):
    """A model whose parameters require grad, as a freshly built one does (the GPU bench's)."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
    assert all(p.requires_grad for p in model.parameters())
    return model


def _graph_engine(model, tokenizer) -> Engine:
    engine = Engine(model, tokenizer, cuda_graphs=True, **ENGINE_KW)
    graphs = engine.runner.graphs
    graphs.use_graphs = True
    FakeGraph.owner = graphs
    forward = graphs._forward

    def failing_forward(bucket):
        if FakeGraph.capturing and FakeGraph.fail_capture:
            raise RuntimeError("CUDA out of memory while capturing (injected)")
        return forward(bucket)

    graphs._forward = failing_forward
    return engine


def _eager_tokens(model, tokenizer) -> list[list[int]]:
    eager = Engine(model, tokenizer, cuda_graphs=False, **ENGINE_KW)
    return [o.outputs[0].token_ids for o in eager.generate(PROMPTS, PARAMS)]


def test_capture_called_outside_inference_mode_records_no_autograd(fake_cuda, model_dirs, tokenizer):
    engine = _graph_engine(_model(model_dirs), tokenizer)
    assert torch.is_grad_enabled()
    count = engine.runner.graphs.capture(max_context=40)  # as bench/gpu.py calls it: no inference_mode
    buckets = engine.runner.graphs.buckets.values()
    assert count == len(buckets) > 1 and all(b.graph is not None for b in buckets)
    assert all(not b.out.requires_grad and b.out.grad_fn is None for b in buckets)
    assert not engine.runner.k_caches[0].requires_grad


def test_replayed_graphs_give_the_eager_tokens(fake_cuda, model_dirs, tokenizer):
    model = _model(model_dirs)
    engine = _graph_engine(model, tokenizer)
    got = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, PARAMS)]
    assert any(b.graph is not None for b in engine.runner.graphs.buckets.values())
    assert got == _eager_tokens(model, tokenizer)


def test_a_failed_capture_is_logged_with_its_cause_and_decoding_goes_on(
    fake_cuda, model_dirs, tokenizer, caplog
):
    model = _model(model_dirs)
    engine = _graph_engine(model, tokenizer)
    FakeGraph.fail_capture = True
    with caplog.at_level(logging.ERROR, logger="bulkgen.engine.decode_graphs"):
        got = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, PARAMS)]
    FakeGraph.fail_capture = False
    assert got == _eager_tokens(model, tokenizer)
    errors = [r.getMessage() for r in caplog.records]
    assert len(errors) == 1 and "CUDA out of memory while capturing (injected)" in errors[0], errors
    assert re.search(r"at test_decode_graphs_capture.py:\d+ failing_forward <- ", errors[0])  # where it broke
    assert not engine.runner.graphs.use_graphs
    assert all(b.graph is None for b in engine.runner.graphs.buckets.values())


@pytest.mark.parametrize("arch", ["qwen3_5", "granitemoehybrid"])
def test_replayed_graphs_carry_hybrid_state_slots(arch, fake_cuda, tmp_path, tokenizer):
    """A hybrid model's decode graphs gather and scatter the rows' state slots by device index: replays
    (five sequences in a bucket of six: a padded row on the scratch slot) give the eager tokens."""
    path = build_tiny_hybrid(tmp_path / arch, arch, seed=1)
    model = AutoModelForCausalLM.from_pretrained(path)
    engine = _graph_engine(model, tokenizer)
    prompts, params = PROMPTS + [[3] * 21], PARAMS + [PARAMS[0]]
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert any(b.graph is not None and b.batch == 6 for b in engine.runner.graphs.buckets.values())
    eager = Engine(model, tokenizer, cuda_graphs=False, **ENGINE_KW)
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert engine.runner.states.num_free == ENGINE_KW["max_num_seqs"]
