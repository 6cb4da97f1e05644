"""Checks that a checkpoint's or an adapter's safetensors files are whole before anything loads from them.

What transformers' quantizers and safetensors do not refuse serves garbage or escapes as an engine error:
an FP8 weight whose scale is missing gets a newly initialised scale, a NaN or inf scale turns its layer's
outputs non-finite (every greedy token the same, every sampled one empty), and a corrupt file raises
whatever its parser raises. So every load runs these first, as vLLM refuses a checkpoint with missing
tensors, and a refusal is one line naming the file (by its name in its folder, never a server path) and
the tensor:

- every safetensors file's header is read and checked (its length against the file, its JSON, each
  tensor's dtype, shape and byte range): no tensor data is read for this;
- in a quantized checkpoint every quantized tensor has the tensor that dequantizes it, per method:
  block FP8 (`quant_method: fp8`) a `weight_scale_inv` beside each FP8 tensor, compressed-tensors a
  `weight_scale` beside each FP8 (and packed int) weight, MXFP4 a `*_scales` beside each `*_blocks`; a
  weight may be in another file of a sharded checkpoint than its scale;
- every float scale tensor of a quantized checkpoint (`*_scale`, `*_scale_inv`) is finite: scales are
  small (one per block, channel or tensor), so they are read whole.

The tensor-parallel FP8 load (shard_quantized.py) and the single engine's (loading.py) run the same check;
LoRA adapters (lora.py) check their file with `read_header` and their tensors with `check_finite`.
"""

from __future__ import annotations

import json
from pathlib import Path

# the suffix of the tensor that dequantizes a quantized one, by quantization method
SCALE_SUFFIX = {"fp8": "_scale_inv", "compressed-tensors": "_scale"}
# safetensors' own bound on a header (its parser refuses larger ones)
MAX_HEADER_BYTES = 100_000_000
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FLOAT_SCALES = {"F16", "BF16", "F32", "F64"}


class CheckpointError(ValueError):
    """A checkpoint or adapter refused at load; its message is one line naming the file and the tensor."""


def read_header(file: str | Path, label: str = "") -> dict[str, dict]:
    """The tensors of safetensors `file` ({name: {"dtype", "shape", "data_offsets"}}), its header checked
    as safetensors checks it; CheckpointError naming `label` (whose file: a model, an adapter), the file's
    name and what is wrong. Reads the header only."""
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            _refuse(label, file, f"not a safetensors file (only {size} bytes)")
        length = int.from_bytes(prefix, "little")
        if length > min(size - 8, MAX_HEADER_BYTES):
            _refuse(
                label,
                file,
                f"not a safetensors file: its header of {length} bytes is larger than the file "
                f"({size} bytes) or safetensors' limit",
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError:
        _refuse(label, file, "not a safetensors file: its header is not JSON")
    if not isinstance(header, dict):
        _refuse(label, file, "not a safetensors file: its header is not a JSON object")
    data = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(entry, data)
        if problem:
            _refuse(label, file, f"tensor {name}: {problem}")
        tensors[name] = entry
    return tensors


def _entry_problem(entry, data: int) -> str | None:
    """What is wrong with one tensor's header entry, or None."""
    if not isinstance(entry, dict):
        return "its header entry is not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        return f"unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        return f"malformed shape {shape!r}"
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(n, int) for n in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        return f"malformed data offsets {offsets!r}"
    if offsets[1] > data:
        return f"its bytes {offsets[0]}:{offsets[1]} run past the file's {data} data bytes (truncated?)"
    count = 1
    for n in shape:
        count *= n
    if offsets[1] - offsets[0] != count * DTYPE_BYTES[dtype]:
        return f"{offsets[1] - offsets[0]} bytes for shape {shape} of {dtype}"
    return None


def check_finite(tensor, label: str, file: str | Path, name: str) -> None:
    """CheckpointError naming the tensor when `tensor` holds a NaN or an infinity."""
    import torch

    values = tensor if tensor.dtype in (torch.float16, torch.bfloat16, torch.float32) else tensor.float()
    if not bool(torch.isfinite(values).all()):
        kinds = [
            kind
            for kind, bad in (("nan", torch.isnan(values)), ("inf", torch.isinf(values)))
            if bool(bad.any())
        ]
        bad = int((~torch.isfinite(values)).sum())
        _refuse(
            label,
            Path(file),
            f"{name} has non-finite values ({' and '.join(kinds)}, {bad} of {values.numel()})",
        )


def checkpoint_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: its index's, else every one in the folder (none for a .bin one)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{_where(path.name)}{index.name}: not a safetensors index") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = next((f for f in files if not f.is_file()), None)
        if missing is not None:
            raise CheckpointError(f"{_where(path.name)}{missing.name}: named by {index.name} but missing")
        return files
    return sorted(path.glob("*.safetensors"))


def check_checkpoint(path: str | Path, quant: dict | None) -> None:
    """Refuse a checkpoint (CheckpointError) whose safetensors headers are broken or, when it is quantized
    (`quant`: its quantization_config), a quantized tensor lacks its scale or a scale is not finite."""
    label = f"checkpoint {Path(path).name!r}"
    headers = {file: read_header(file, label) for file in checkpoint_files(path)}
    method = (quant or {}).get("quant_method")
    if method not in (*SCALE_SUFFIX, "mxfp4"):
        return
    file_of = {name: file for file, tensors in headers.items() for name in tensors}
    for file, tensors in headers.items():
        for name, entry in tensors.items():
            scale = _required_scale(method, quant, name, entry["dtype"])
            if scale is not None and scale not in file_of:
                _refuse(
                    label,
                    file,
                    f"{name} is {entry['dtype']} but its scale {scale} is missing "
                    f"({method} needs it to dequantize the tensor)",
                )
    scales = [
        (file, name)
        for file, tensors in headers.items()
        for name, entry in tensors.items()
        if name.endswith(("_scale", "_scale_inv")) and entry["dtype"] in FLOAT_SCALES
    ]
    if scales:
        _check_scales_finite(label, scales)


def _required_scale(method: str, quant: dict, name: str, dtype: str) -> str | None:
    """The name of the tensor that dequantizes tensor `name`, when it is a quantized one, else None."""
    if method == "mxfp4":
        return f"{name.removesuffix('_blocks')}_scales" if name.endswith("_blocks") else None
    if dtype.startswith("F8_") and not name.endswith(("_scale", "_scale_inv")):
        return f"{name}{SCALE_SUFFIX[method]}"
    if method == "compressed-tensors" and name.endswith(".weight_packed"):
        if quant.get("format") == "pack-quantized":
            return f"{name.removesuffix('_packed')}_scale"
    return None


def _check_scales_finite(label: str, scales: list[tuple[Path, str]]) -> None:
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for file, name in scales:
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in names:
                check_finite(handle.get_tensor(name), label, file, name)


def _where(label: str) -> str:
    return f"{label}: " if label else ""


def _refuse(label: str, file: Path, problem: str):
    raise CheckpointError(f"{_where(label)}{file.name}: {problem}")
