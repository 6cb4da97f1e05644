"""FP8 checkpoints on two gloo ranks (shard_quantized.py): the single-process engine's greedy tokens and
prompt logprobs on the same checkpoint, or a refusal at load naming what does not split.

On CPU the single engine dequantizes an FP8 checkpoint to the load dtype, and compressed-tensors also
quantizes each linear's input per token (or per group) at run time. Each rank dequantizes its slice with
its scales' slice, so its weights are the single model's slice bit for bit, and a row-parallel linear
takes its input scale over the ranks: the two runs agree to float rounding (measured at most 1e-6 in
prompt logprob). Without the all-reduce of that scale, compressed-tensors per-channel Llama's logprobs
moved by 8e-3 with the same greedy tokens: hence the 1e-4 bound on them as well as equal tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from bulkgen.engine import Engine, SamplingParams
from bulkgen.lab.quantized import reshard, write_block_fp8, write_compressed_fp8
from bulkgen.lab.tiny import build_tiny_model

ENGINE = dict(device="cpu", max_num_batched_tokens=64, block_size=8, admission="shortest_first")
# (architecture, its overrides, how the checkpoint is written): per-channel, per-tensor and block
# compressed-tensors (the block one with group-quantized activations, on one KV head replicated over the
# ranks), and DeepSeek-V3's fine-grained block FP8 on an MoE model (its experts FP8 one Linear per expert,
# every tensor in a file of its own)
CHECKPOINTS = {
    "llama-ct-channel": ("llama", {}, lambda src, out: write_compressed_fp8(src, out, "channel")),
    "qwen3-ct-tensor": ("qwen3", {}, lambda src, out: write_compressed_fp8(src, out, "tensor")),
    "qwen3-ct-block": (
        "qwen3",
        {"num_key_value_heads": 1},
        lambda src, out: write_compressed_fp8(src, out, "block", block=16),
    ),
    "qwen3_moe-fp8-block": (
        "qwen3_moe",
        {},
        lambda src, out: _one_tensor_a_file(write_block_fp8(src, out, 16)),
    ),
    # DeepSeek-V3's own format on its own architecture: latent attention (kv_b_proj split by heads,
    # the latent projections whole on every rank) and FP8 experts
    "deepseek_v3-fp8-block": ("deepseek_v3", {}, lambda src, out: write_block_fp8(src, out, 8)),
}


def _one_tensor_a_file(checkpoint):
    """Each tensor in a file of its own: a weight's scales are never in its file."""
    reshard(checkpoint, 1)
    return checkpoint


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens and every prompt token's logprob after the first."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = engine.generate(prompts, params)
    logprobs = [entry["logprob"] for o in outs for entry in o.prompt_logprobs if entry is not None]
    return [o.outputs[0].token_ids for o in outs], torch.tensor(logprobs)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Chunked prefill (a 64-token step budget) and a shared 40-token prefix (the prefix cache)."""
    gen = torch.Generator().manual_seed(39)
    shared = torch.randint(0, 256, (40,), generator=gen).tolist()
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 100, 33)] + [
        shared + [5, 6],
        shared + [7, 8, 9],
    ]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_two_ranks_give_the_single_engines_tokens_on_an_fp8_checkpoint(
    name, prompts, tmp_path, one_thread, rank_pool
):
    arch, overrides, write = CHECKPOINTS[name]
    checkpoint = str(write(build_tiny_model(tmp_path / "float", arch, seed=3, **overrides), tmp_path / "fp8"))
    single = Engine.from_pretrained(checkpoint, **ENGINE)
    tokens, logprobs = _run(single, prompts)
    sharded = Engine.from_pretrained(checkpoint, tensor_parallel=2, launcher=rank_pool, **ENGINE)
    try:
        sharded_tokens, sharded_logprobs = _run(sharded, prompts)
        scales = [n for n, _ in sharded.model.named_parameters() if "scale" in n]
    finally:
        sharded.close()
    assert sharded_tokens == tokens
    assert (sharded_logprobs - logprobs).abs().max() < 1e-4
    assert scales == []  # dequantized on CPU, as the single engine runs it
    for whole, mine in zip(single.model.model.layers, sharded.model.model.layers, strict=True):
        # rank 0's slices, bit for bit: q_proj's first rows (column-parallel), o_proj's first columns
        query = (
            "q_proj" if getattr(whole.self_attn, "q_proj", None) is not None else "q_b_proj"
        )  # MLA: q LoRA
        q, o = getattr(mine.self_attn, query).weight, mine.self_attn.o_proj.weight
        assert torch.equal(q, getattr(whole.self_attn, query).weight[: q.shape[0]])
        assert torch.equal(o, whole.self_attn.o_proj.weight[:, : o.shape[1]])


def test_a_rank_share_of_partial_scale_blocks_is_refused_naming_the_tensor(tmp_path, one_thread, rank_pool):
    """Blocks of 32 rows: a rank's 16 rows of k_proj (two KV heads of 16) would split every block."""
    src = build_tiny_model(tmp_path / "float", "llama", seed=3)
    checkpoint = write_block_fp8(src, tmp_path / "fp8", block=32)
    with pytest.raises(
        ValueError, match=r"self_attn\.k_proj\.weight: .*0:16 of 32 .*32-wide FP8 scale blocks"
    ):
        Engine.from_pretrained(str(checkpoint), tensor_parallel=2, launcher=rank_pool, **ENGINE)


def test_an_fp8_weight_without_its_scales_is_refused_naming_it(tmp_path, one_thread, rank_pool):
    """Read as plain numbers, an e4m3 weight would run as garbage: refused by the single engine's checker
    (checkpoint_checks.py) before any rank reads a weight."""
    from safetensors.torch import load_file, save_file

    checkpoint = write_block_fp8(build_tiny_model(tmp_path / "float", "llama", seed=3), tmp_path / "fp8", 16)
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: model\.layers\.1\.mlp\.up_proj\.weight is F8_E4M3 but its scale "
        r"model\.layers\.1\.mlp\.up_proj\.weight_scale_inv is missing",
    ):
        Engine.from_pretrained(str(checkpoint), tensor_parallel=2, launcher=rank_pool, **ENGINE)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"quant_method": "awq", "bits": 4}, r"quantized \(awq\)"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, r"activation scales are static"),
        ("static-inputs", r"group_0 quantizes input activations statically"),
    ],
)
def test_other_quantizations_are_refused_before_any_rank_starts(change, named, tmp_path):
    """AWQ, GPTQ, bitsandbytes, MXFP4 and static activation scales: the ranks would drop what they do not
    read (a row-parallel layer's static input scale), so they are refused, naming it."""
    src = build_tiny_model(tmp_path / "float", "llama", seed=3)
    checkpoint = write_compressed_fp8(src, tmp_path / "fp8")
    config_file = checkpoint / "config.json"
    config = json.loads(config_file.read_text())
    if change == "static-inputs":
        config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    else:
        config["quantization_config"] = change
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{named}.*tensor_parallel 1"):
        Engine.from_pretrained(str(checkpoint), tensor_parallel=2, **ENGINE)


def test_a_quantized_vision_language_model_is_refused_before_any_rank_starts(tmp_path):
    """Its encoder loads whole on rank 0 (vision_shards.py), beside the FP8 language model, through no
    path that reads FP8 scales or runs compressed-tensors' input quantization."""
    from bulkgen.lab.tiny_vision import build_tiny_vlm

    checkpoint = write_compressed_fp8(build_tiny_vlm(tmp_path / "float", "llava", seed=5), tmp_path / "fp8")
    with pytest.raises(
        ValueError, match=r"compressed-tensors, in a vision-language model.*tensor_parallel 1"
    ):
        Engine.from_pretrained(str(checkpoint), tensor_parallel=2, **ENGINE)
