"""Quantized copies of a local float checkpoint, written with the quantization package itself
(compressed-tensors, bitsandbytes): fixtures for the tests that load them through transformers'
quantizers, and for bench/bench_quant.py.

FP8 needs no calibration data: each weight scale is the weight's own absolute maximum over its scale's
group (the whole tensor, an output channel, or a block) mapped to e4m3's 448, and activations are
quantized dynamically at run time, as llm-compressor's FP8_DYNAMIC and FP8_BLOCK presets do.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

STRATEGIES = ("tensor", "channel", "block")
# a vision-language model's processor_config.json too: its processor loads from the quantized folder
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "processor_config.json",
    "preprocessor_config.json",
)


def write_compressed_fp8(
    src: str | Path, out: str | Path, strategy: str = "channel", block: int = 128
) -> Path:
    """Save `src` as a compressed-tensors FP8 checkpoint ("float-quantized") in `out`: every Linear but
    the lm_head in e4m3 with `strategy` weight scales (block: `block` x `block` tiles, activations
    quantized in groups of `block`; else per token). A vision-language model's vision tower and
    projector stay float too (float_model_and_ignore)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    fp8 = dict(num_bits=8, type="float", symmetric=True)
    if strategy == "block":
        weights = QuantizationArgs(**fp8, dynamic=False, strategy="block", block_structure=[block, block])
        activations = QuantizationArgs(**fp8, dynamic=True, strategy="group", group_size=block)
    else:
        weights = QuantizationArgs(**fp8, dynamic=False, strategy=strategy)
        activations = QuantizationArgs(**fp8, dynamic=True, strategy="token")
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    model, ignore = float_model_and_ignore(src)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore)
    apply_quantization_config(model, config)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            scale = _weight_scale(module.weight.detach().float(), strategy, block)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, "float-quantized")
    compressor.compress_model(model)
    out = Path(out)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    _copy_tokenizer(Path(src), out)
    return out


def float_model_and_ignore(src: str | Path) -> tuple:
    """(the bf16 model at `src`, the compressed-tensors `ignore` list of what stays float): the lm_head,
    and in a vision-language model every module beside its text model (the vision tower, the
    projector), as the FP8 vision-language checkpoints on the hub have it (llm-compressor's recipes
    ignore `re:visual.*` or `re:vision_tower.*` and `re:multi_modal_projector.*`): the encoder is a
    small share of the weights and its errors reach every image token."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = getattr(AutoConfig.from_pretrained(src, local_files_only=True), "vision_config", None)
    auto_class = AutoModelForCausalLM if vision is None else AutoModelForImageTextToText
    model = auto_class.from_pretrained(src, dtype=torch.bfloat16, local_files_only=True)
    if vision is None:
        return model, ["lm_head"]
    language = model.get_decoder()
    # named as the model names its modules (transformers 5: `model.visual`); the saved config lists each
    # ignored module by its name in the saved (hub) layout, `visual.blocks.0.attn.qkv`, as hub ones do
    beside = [
        f"re:^model\\.{name}\\." for name, child in model.model.named_children() if child is not language
    ]
    return model, ["re:.*lm_head", *beside]


def write_block_fp8(src: str | Path, out: str | Path, block: int = 128) -> Path:
    """Save `src` as a fine-grained FP8 checkpoint (transformers' `quant_method: fp8`, DeepSeek-V3's
    layout): each decoder-layer Linear's `weight` in e4m3 and `weight_scale_inv` [out/block, in/block]
    (the factor that dequantizes each block); fused MoE experts (transformers 5's 3-D `gate_up_proj`,
    `down_proj`) one Linear per expert and projection, `experts.E.gate_proj.weight` and so on, as
    DeepSeek-V3 and Qwen3-235B-A22B-FP8 store them. Written tensor by tensor: transformers only writes
    this format after quantizing on a GPU."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, local_files_only=True)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            tensors.update(_block_fp8(f"{name}.weight", module.weight.detach(), block))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors.update(_per_expert_block_fp8(name, tensors.pop(name), block))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(src) / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(Path(src), out)
    return out


def _block_fp8(name: str, weight, block: int) -> dict:
    """`name` (a 2-D weight) in e4m3 and its `weight_scale_inv`, one per `block` x `block` tile."""
    import torch

    weight = weight.float()
    scale = _weight_scale(weight, "block", block)
    rows, cols = weight.shape
    blocks = weight.reshape(rows // block, block, cols // block, block) / scale[:, None, :, None]
    fp8 = blocks.reshape(rows, cols).to(torch.float8_e4m3fn)
    return {name: fp8, f"{name}_scale_inv": scale.float()}


def _per_expert_block_fp8(name: str, fused, block: int) -> dict:
    """A fused [experts, out, in] expert weight as one block-FP8 Linear per expert (gate_up: its gate
    half, then its up half, as transformers 5 packs them)."""
    prefix, _, fused_name = name.rpartition(".")
    parts = ("gate_proj", "up_proj") if fused_name == "gate_up_proj" else ("down_proj",)
    tensors = {}
    for expert, weight in enumerate(fused):
        for part, half in zip(parts, weight.chunk(len(parts)), strict=True):
            tensors.update(_block_fp8(f"{prefix}.{expert}.{part}.weight", half, block))
    return tensors


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of the 4-bit values (bit 3: sign)


def write_mxfp4(src: str | Path, out: str | Path) -> Path:
    """Save a gpt-oss `src` as gpt-oss' own MXFP4 checkpoint: each expert weight as `*_blocks` (two e2m1
    values a byte, 32 a group along the input) and `*_scales` (one power-of-two exponent a group, biased
    by 127); attention, router, embeddings and lm_head stay bf16, as in openai/gpt-oss-20b."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, local_files_only=True)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = _mxfp4(tensor.float().transpose(1, 2))
        else:
            tensors[name] = tensor.contiguous()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(src) / "config.json").read_text())
    skip = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": skip}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(Path(src), out)
    return out


def _mxfp4(weight):
    """(blocks uint8 [..., rows, groups, 16], scales uint8 [..., rows, groups]) of [..., rows, cols]:
    each group of 32 scaled by the power of two that brings its maximum within e2m1's 6, rounded to
    the nearest e2m1 value."""
    import torch

    groups = weight.reshape(*weight.shape[:-1], weight.shape[-1] // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent)
    magnitudes = torch.tensor(FP4_E2M1)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) | ((scaled < 0).long() << 3)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), (exponent[..., 0] + 127).to(torch.uint8).contiguous()


def write_bitsandbytes(src: str | Path, out: str | Path, bits: int = 8) -> Path:
    """Save `src` quantized by bitsandbytes at load (LLM.int8() for 8 bits, NF4 for 4), as
    transformers writes a bitsandbytes checkpoint; runs on CPU with bitsandbytes >= 0.46."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if bits not in (4, 8):
        raise ValueError(f"bitsandbytes quantizes to 4 or 8 bits, not {bits}")
    config = (
        BitsAndBytesConfig(load_in_8bit=True)
        if bits == 8
        else BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        )
    )
    model = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=config, device_map="cpu", dtype=torch.float32, local_files_only=True
    )
    out = Path(out)
    model.save_pretrained(out)
    _copy_tokenizer(Path(src), out)
    return out


def _weight_scale(weight, strategy: str, block: int):
    """The absolute maximum of each scale group over e4m3's largest value (448)."""
    import torch

    if strategy == "tensor":
        amax = weight.abs().amax()
    elif strategy == "channel":
        amax = weight.abs().amax(dim=1, keepdim=True)
    else:
        rows, cols = weight.shape
        if rows % block or cols % block:
            raise ValueError(f"a {rows}x{cols} weight does not split into {block}x{block} blocks")
        amax = weight.abs().reshape(rows // block, block, cols // block, block).amax(dim=(1, 3))
    return amax.clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max


def reshard(checkpoint: str | Path, limit: int) -> int:
    """Split the checkpoint's one `model.safetensors` into files of about `limit` bytes with their index,
    as transformers writes a large model (a weight and its scales may land in different files); the
    largest file's size."""
    from safetensors.torch import load_file, save_file

    checkpoint = Path(checkpoint)
    tensors = load_file(checkpoint / "model.safetensors")
    (checkpoint / "model.safetensors").unlink()
    files, current, size = [], {}, 0
    for name, tensor in tensors.items():
        current[name], size = tensor, size + tensor.numel() * tensor.element_size()
        if size >= limit:
            files.append(current)
            current, size = {}, 0
    files.append(current)
    weight_map = {}
    for i, part in enumerate(f for f in files if f):
        name = f"model-{i:05d}.safetensors"
        save_file(part, str(checkpoint / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    return max(f.stat().st_size for f in checkpoint.glob("*.safetensors"))


def _copy_tokenizer(src: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
