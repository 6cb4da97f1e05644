"""The logprob transformers gives each chosen token: what an engine's `logprobs` must match."""

from __future__ import annotations

import torch


def chosen_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | prompt + tokens[:i]) under `model`, one forward over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def assert_follows(hf: torch.nn.Module, prompts, outs, max_tokens: int, float_model=None) -> float:
    """Each engine output's greedy tokens are `hf.generate`'s for its prompt alone and their logprobs
    `hf`'s; returns the largest logprob difference from `float_model` (0 without one)."""
    off_float = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        assert out.token_ids == want[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"
        got = torch.tensor([entry["logprob"] for entry in out.outputs[0].logprobs])
        assert torch.allclose(got, chosen_logprobs(hf, prompt, out.token_ids), atol=1e-4)
        if float_model is not None:
            off = (got - chosen_logprobs(float_model, prompt, out.token_ids)).abs().max().item()
            off_float = max(off_float, off)
    return off_float
