"""The bf16 judge of the CUDA tests (tests/support/divergence.py), on CPU: the same workload, bf16 on both
sides, where the engine's kernels differ from transformers' in summation order as the GPU's do."""

from __future__ import annotations

import pytest

from tests.support.divergence import NEAR_TIE_STEPS, bf16_greedy_against_hf, judge_bf16_run


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cpu_bf16_greedy_follows_hf_generate(arch, model_dirs, mixed_prompts):
    prompts = mixed_prompts(seed=31, count=12, low=1, high=300)
    firsts, margins, problems, _ = bf16_greedy_against_hf(model_dirs[arch], prompts, "cpu")
    print(f"{arch} CPU bf16 first divergence per prompt: {firsts}, reference margins {margins}")
    assert not problems, (problems, firsts, margins)
    assert all(m is None or m <= NEAR_TIE_STEPS for m in margins), margins  # on CPU: every one a near-tie


class _Scripted:
    """A reference model whose last-position logits are given: to judge runs without a forward."""

    def __init__(self, logits):
        import torch

        self.logits, self.param = logits, torch.nn.Parameter(torch.zeros(1))

    def parameters(self):
        yield self.param

    def __call__(self, ids):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.logits[None, None, :].expand(1, ids.shape[1], -1))


def test_an_early_divergence_is_allowed_at_a_near_tie_only():
    import torch

    reference = [[1, 2, 3, 4]] * 4
    candidate = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 9, 3, 4]]  # parts at position 1
    near = torch.zeros(16)
    near[2], near[9] = 0.4551, 0.4531  # adjacent bf16 values: one step
    *_, problems = judge_bf16_run(_Scripted(near), [[0]] * 4, reference, candidate)
    assert not problems
    wide = torch.zeros(16)
    wide[2], wide[9] = 0.45, 0.30  # the reference was sure: a wrong mask or cache
    firsts, margins, problems = judge_bf16_run(_Scripted(wide), [[0]] * 4, reference, candidate)
    assert firsts == [4, 4, 4, 1] and margins[3] > NEAR_TIE_STEPS
    assert problems and "wide margins" in problems[0]
