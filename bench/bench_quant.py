"""Weight bytes per quantization mode: bf16, online FP8 (`--quantize fp8`) and a compressed-tensors FP8
checkpoint (per-channel scales), for a tiny model and real-shaped configs (no GPU, no download).

bf16 and online FP8 are the engine's own modules: the model is built on the meta device (no memory) and
quantize.quantize_layers converts it as the engine does, so the FP8 figure counts what Fp8Linear holds
(e4m3 weights, float32 per-channel scales). The compressed-tensors figure is the checkpoint as the
compressed-tensors package writes it (e4m3 weights, bf16 per-channel scales, lm_head kept): measured
on the tiny model's file, counted from the same shapes for the real ones. The last column is the ratio
to bf16 in the same run; "freed" is what FP8 gives back to the KV cache.

    python bench/bench_quant.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from bulkgen.engine.model.quantize import quantize_layers, weight_bytes  # noqa: E402
from bulkgen.lab.quantized import write_compressed_fp8  # noqa: E402
from bulkgen.lab.tiny import build_tiny_model  # noqa: E402

GIB = 1 << 30
# public config.json values (meta-device shapes only)
REAL = {
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "qwen3-32b": dict(
        model_type="qwen3",
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}


def meta_model(config) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def compressed_fp8_bytes(model: torch.nn.Module) -> int:
    """A compressed-tensors FP8 checkpoint of `model`'s shapes: every Linear but the lm_head in e4m3 with
    one bf16 scale per output channel; everything else in bf16."""
    head = model.get_output_embeddings()
    total = 0
    for module in model.modules():
        own = sum(p.numel() * 2 for p in module.parameters(recurse=False))
        if isinstance(module, torch.nn.Linear) and module is not head:
            own = (
                module.weight.numel()
                + module.out_features * 2
                + (module.bias is not None) * module.out_features * 2
            )
        total += own
    return total


def stored_bytes(path: Path) -> int:
    """Tensor bytes in a safetensors checkpoint (its header's offsets, not the file's size)."""
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(f.get_tensor(name).numel() * f.get_tensor(name).element_size() for name in f.keys())


def measure(name: str, config, checkpoint: Path | None = None) -> dict:
    bf16 = weight_bytes(meta_model(config))
    fp8_model = meta_model(config)
    quantize_layers(fp8_model, "meta")
    fp8 = weight_bytes(fp8_model)
    if checkpoint is not None:
        ct, how = stored_bytes(write_compressed_fp8(checkpoint, checkpoint.parent / "ct", "channel")), "file"
    else:
        ct, how = compressed_fp8_bytes(meta_model(config)), "shapes"
    return {"model": name, "bf16": bf16, "fp8_online": fp8, "ct_fp8": ct, "ct_from": how}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny", arch="llama", seed=0, num_hidden_layers=4)
        rows.append(measure("tiny-llama (4 layers)", AutoConfig.from_pretrained(tiny), tiny))
    for name, values in REAL.items():
        values = dict(values)
        rows.append(measure(name, AutoConfig.for_model(values.pop("model_type"), **values)))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{'model':24} {'bf16':>12} {'fp8 online':>12} {'ratio':>6} {'ct fp8':>12} {'ratio':>6}  freed for KV"
    )
    for row in rows:
        size = _sizer(row["bf16"])
        print(
            f"{row['model']:24} {size(row['bf16']):>12} {size(row['fp8_online']):>12} "
            f"{row['fp8_online'] / row['bf16']:6.3f} {size(row['ct_fp8']):>12} {row['ct_fp8'] / row['bf16']:6.3f}  "
            f"{size(row['bf16'] - row['fp8_online'])} (ct from {row['ct_from']})"
        )


def _sizer(largest: int):
    """Bytes as GiB for a real model, KiB for a tiny one."""
    unit, scale = ("GiB", GIB) if largest > GIB else ("KiB", 1024)
    return lambda value: f"{value / scale:,.2f} {unit}"


if __name__ == "__main__":
    main()
