"""gpt-oss on two gloo ranks (shard_gptoss.py): the single engine's tokens, with the parts a faithful
split must get right made large enough to show. The architecture matrix's tiny gpt-oss has transformers'
initialisation: zero biases (the experts' down bias is added once or world times alike) and sinks near 0.
Here every bias and sink is drawn at 0.5 and the weights at 0.1, so an experts' bias counted twice, a
rank reading another rank's sinks, or a gate/up interleave split as two halves all move the logprobs by far
more than float rounding (each was checked to fail this module's first test).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from bulkgen.engine import Engine, SamplingParams
from bulkgen.lab.tiny import build_tiny_model

ENGINE = dict(device="cpu", max_num_batched_tokens=64, block_size=8, num_kv_blocks=256)
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=0)


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens and the logprob of every prompt token after the first."""
    outs = engine.generate(prompts, PARAMS)
    logprobs = [entry["logprob"] for o in outs for entry in o.prompt_logprobs if entry is not None]
    return [o.outputs[0].token_ids for o in outs], torch.tensor(logprobs)


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory) -> str:
    """A tiny gpt-oss (sliding and full layers, sinks, 4 experts with biases) with large biases and sinks."""
    path = build_tiny_model(
        tmp_path_factory.mktemp("gpt_oss") / "m", "gpt_oss", seed=3, initializer_range=0.1
    )
    file = path / "model.safetensors"
    tensors, gen = load_file(file), torch.Generator().manual_seed(7)
    for name, tensor in tensors.items():
        if name.endswith(("bias", "sinks")):
            tensors[name] = torch.randn(tensor.shape, generator=gen) * 0.5
    save_file(tensors, file, metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(39)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 32, 100, 60)]


def test_two_ranks_give_the_single_engines_tokens_with_biases_and_sinks(gptoss, prompts, one_thread):
    single = Engine.from_pretrained(gptoss, **ENGINE)
    tokens, logprobs = _run(single, prompts)
    whole = single.model.model.layers
    sharded = Engine.from_pretrained(gptoss, tensor_parallel=2, **ENGINE)
    try:
        for mine, full in zip(sharded.model.model.layers, whole, strict=True):  # rank 0's shard
            assert torch.equal(mine.self_attn.sinks, full.self_attn.sinks[:2])
            experts, full_experts = mine.mlp.experts, full.mlp.experts
            assert torch.equal(experts.gate_up_proj, full_experts.gate_up_proj[..., :128])
            assert torch.equal(experts.down_proj, full_experts.down_proj[:, :64])
            assert torch.equal(experts.down_proj_bias, full_experts.down_proj_bias)  # rank 0 adds it
        got, got_logprobs = _run(sharded, prompts)
    finally:
        sharded.close()
    assert got == tokens
    gap = (got_logprobs - logprobs).abs().max()
    assert gap < 1e-4, gap
