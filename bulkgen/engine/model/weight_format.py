"""What a checkpoint's weights are stored as, read from its config.json alone (no torch, no weights), so the
API can say how each served model runs (/v1/models) and the loader can pick transformers' quantizer.

`weight_dtype` is what the decoder layers' linear weights are held in on the worker: a quantized
checkpoint's own format, "float8_e4m3fn" under online FP8 (`quantize="fp8"`), or "auto" for a float
checkpoint loaded without it (the worker's dtype: bfloat16 on a GPU, float32 on CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

FP8_E4M3 = "float8_e4m3fn"


def read_config(path: str | Path) -> dict | None:
    """A local checkpoint's config.json; None for a remote one (s3://: the API host never copies models)."""
    path = str(path)
    if "://" in path and not path.startswith("file://"):
        return None
    config = Path(path.removeprefix("file://")) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else None


def checkpoint_quantization(path: str | Path) -> str | None:
    """The checkpoint's quantization method (transformers' `quant_method`); None: a float checkpoint."""
    quant = (read_config(path) or {}).get("quantization_config") or {}
    return quant.get("quant_method")


def served_weights(
    path: str | Path, quantize: str | None, kv_cache_dtype: str = "auto"
) -> dict[str, str | None]:
    """`quantization` (the checkpoint's method, "fp8-online", or None), `weight_dtype` and `kv_cache_dtype`
    of a model served from `path` by workers whose engine quantizes float checkpoints with `quantize`;
    "unknown" where only the worker, which copies a remote checkpoint, can tell."""
    config = read_config(path)
    if config is None:
        return {"quantization": "unknown", "weight_dtype": "unknown", "kv_cache_dtype": kv_cache_dtype}
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method is None and quantize is not None:  # online quantization applies to float checkpoints only
        return {
            "quantization": f"{quantize}-online",
            "weight_dtype": FP8_E4M3,
            "kv_cache_dtype": kv_cache_dtype,
        }
    dtype = _quantized_dtype(method, quant) if method else "auto"
    return {"quantization": method, "weight_dtype": dtype, "kv_cache_dtype": kv_cache_dtype}


def _quantized_dtype(method: str, quant: dict) -> str:
    if method == "compressed-tensors":
        kinds = {
            _ct_dtype(group.get("weights") or {}) for group in (quant.get("config_groups") or {}).values()
        }
        return ",".join(sorted(kinds)) or "unknown"
    if method == "fp8":
        return FP8_E4M3
    if method == "mxfp4":
        return "mxfp4"
    if method in ("awq", "gptq"):
        return f"int{quant.get('bits', 4)}"
    if method == "bitsandbytes":
        return "int8" if quant.get("load_in_8bit") else quant.get("bnb_4bit_quant_type", "nf4")
    return "unknown"


def _ct_dtype(weights: dict) -> str:
    """A compressed-tensors weight scheme's stored type: 8-bit float is e4m3; else e.g. int4, float4."""
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    return FP8_E4M3 if (kind, bits) == ("float", 8) else f"{kind}{bits}"
