"""The logprob transformers gives each chosen token: what an engine's `logprobs` must match."""

from __future__ import annotations

import torch


def chosen_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | prompt + tokens[:i]) under `model`, one forward over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
