"""Greedy runs in bf16 judged against transformers by where they part, and by how close a call that was.

Two correct bf16 implementations part at near-ties: positions where the reference's top two logits are
within a few bf16 steps, so a last-bit difference in a kernel's summation order picks the other token
(on CPU, tiny Llama parts from transformers at position 1 of a 269-token prompt, on logits 0.4551 and
0.4531: adjacent bf16 values). A wrong mask or cache layout parts early on most prompts, and at wide
margins. So: most prompts identical, a late median, and every early divergence a near-tie.
"""

from __future__ import annotations

import statistics

import torch

NEAR_TIE_STEPS = 4  # a divergence this close (in bf16 steps at the top logit's size) is a coin toss
EARLY = 2  # divergences before this position must be near-ties


def first_divergence(reference: list[int], candidate: list[int]) -> int:
    """The first position where the two differ; the length when they never do."""
    return next(
        (i for i, (a, b) in enumerate(zip(reference, candidate, strict=True)) if a != b), len(reference)
    )


@torch.no_grad()
def margin_in_bf16_steps(
    model, prompt: list[int], reference: list[int], candidate: list[int], at: int
) -> float:
    """How much the reference model preferred its own token over the candidate's at position `at` (both
    runs share every token before it), in units of the bf16 spacing at the top logit's magnitude."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([prompt + reference[:at]], device=device)).logits[0, -1].float()
    gap = float(logits[reference[at]] - logits[candidate[at]])
    step = 2.0 ** (torch.floor(torch.log2(logits.abs().max())).item() - 7)  # bf16: 8 significant bits
    return gap / step


def judge_bf16_run(model, prompts, references, candidates) -> tuple[list[int], list[float | None], list[str]]:
    """(first divergence per prompt, the reference's margin there or None, what is wrong: empty if the run
    follows the reference as a correct bf16 implementation does)."""
    firsts = [first_divergence(r, c) for r, c in zip(references, candidates, strict=True)]
    margins = [
        None if f == len(r) else margin_in_bf16_steps(model, p, r, c, f)
        for p, r, c, f in zip(prompts, references, candidates, firsts, strict=True)
    ]
    length = len(references[0])
    problems = []
    if sum(f == len(r) for f, r in zip(firsts, references, strict=True)) < len(firsts) / 2:
        problems.append("fewer than half the prompts identical")
    if statistics.median(firsts) < length / 2:
        problems.append(f"median first divergence below {length / 2}")
    wide = [
        (i, f, m)
        for i, (f, m) in enumerate(zip(firsts, margins, strict=True))
        if f < EARLY and m > NEAR_TIE_STEPS
    ]
    if wide:
        problems.append(f"early divergences at wide margins (prompt, position, bf16 steps): {wide}")
    return firsts, margins, problems


def bf16_greedy_against_hf(model_dir, prompts: list[list[int]], device: str, new_tokens: int = 16):
    """The engine's bf16 greedy tokens against transformers' own bf16 `generate` on `device`, judged as
    above; also returns the engine's attention backend name (printed by the tests)."""
    from transformers import AutoModelForCausalLM

    from bulkgen.engine import Engine, SamplingParams

    engine = Engine.from_pretrained(
        str(model_dir),
        device=device,
        dtype=torch.bfloat16,
        max_num_batched_tokens=256,
        block_size=16,
        num_kv_blocks=4096,
    )
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    with torch.no_grad():
        want = [
            model.generate(
                torch.tensor([p], device=device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    return (*judge_bf16_run(model, prompts, want, got), engine.runner.backend.name)
