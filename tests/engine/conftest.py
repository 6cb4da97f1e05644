"""Tiny fixed-seed models (built locally, never downloaded) and HF `generate` references for them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bulkgen.engine import Engine
from bulkgen.lab.tiny import build_tokenizer

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tiny_model):
    return {arch: tiny_model(arch, seed=1) for arch in ARCHS}


class Reference:
    """transformers' greedy `generate` on each prompt alone (fp32, CPU), memoised per test session."""

    def __init__(self, model_dirs):
        self.model_dirs = model_dirs
        self.models: dict[str, torch.nn.Module] = {}
        self.cache: dict[tuple, list[int]] = {}

    def greedy(self, arch: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (arch, tuple(prompt_ids), max_new_tokens)
        if key not in self.cache:
            if arch not in self.models:
                self.models[arch] = AutoModelForCausalLM.from_pretrained(self.model_dirs[arch]).eval()
            ids = torch.tensor([prompt_ids])
            with torch.no_grad():
                out = self.models[arch].generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            self.cache[key] = out[0, len(prompt_ids) :].tolist()
        return self.cache[key]

    def logits(self, arch: str, ids: list[int]) -> torch.Tensor:
        self.greedy(arch, ids[:1], 1)  # make sure the model is loaded
        with torch.no_grad():
            return self.models[arch](torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="session")
def reference(model_dirs):
    return Reference(model_dirs)


@pytest.fixture
def make_engine(model_dirs):
    """Fresh engine per call (its own model copy: the engine takes over the model's attention)."""

    def make(arch: str = "llama", **kwargs) -> Engine:
        return Engine.from_pretrained(str(model_dirs[arch]), device="cpu", **kwargs)

    return make


@pytest.fixture(scope="session")
def mixed_prompts():
    """Random byte-token prompts of varied length (ids < 256: plain bytes, no special tokens)."""

    def make(seed: int, count: int, low: int, high: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
        return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]

    return make


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread in this process for a module's tests: a tensor-parallel rank 0, like the follower
    ranks it starts, so two ranks share this machine's cores evenly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def rank_pool():
    """Follower ranks kept for the session (tests/support/rank_pool.py): `launcher=rank_pool` on a
    tensor-parallel engine reuses them instead of starting fresh interpreters for every model."""
    from tests.support.rank_pool import RankPool

    pool = RankPool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def tp_prompts():
    """Tensor-parallel runs' prompts: 7 to 300 tokens, and two that share the longest one's first 96
    (prefix caching)."""
    gen = torch.Generator().manual_seed(39)
    own = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 32, 100, 300)]
    shared = own[3][:96]
    return own + [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 21)]
