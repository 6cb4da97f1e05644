"""FP8 checkpoints under tensor parallel: each rank reads its slice of every FP8 weight with the matching
slice of its scales, and then runs what the single-process engine runs for that checkpoint on its device.

Two formats split: fine-grained FP8 (transformers' `quant_method: fp8`, DeepSeek-V3's layout: e4m3
`weight` and `weight_scale_inv`, per tensor or per [128, 128] block) and compressed-tensors FP8 (e4m3
`weight` and `weight_scale` per tensor, per output channel or per block, activations quantized
dynamically). A scale follows its weight's slice: per-channel scales split with a column-parallel weight's
rows and stay whole for a row-parallel one, per-tensor scales stay whole, block scales are sliced by whole
blocks. A rank's share of a dimension that is not a whole number of blocks would need blocks split
between ranks, each half with the whole block's scale: it is refused, naming the tensor, as vLLM refuses
it ("not divisible by weight quantization block_n"; its answer is expert parallel or a smaller
tensor-parallel size).

What a rank then computes is the single engine's (loading.py): on CPU, and for fine-grained FP8 on every
device, the weights are dequantized to the load dtype (the slice's values times its scales, with the
same arithmetic, so each rank's weights are bit for bit the single model's slice). Compressed-tensors
also quantizes each linear's input at run time (its `input_activations`, through compressed-tensors'
own forward): a column-parallel linear sees the whole input, as on one process; a row-parallel one sees
its slice, so a per-token or per-tensor scale is taken over the ranks (an all-reduce of the maximum: the
scale is a monotone function of the absolute maximum, so the maximum of the ranks' scales is the whole
row's), and a per-group one needs no exchange when the groups do not straddle ranks (checked). On CUDA
sm89+, where the single engine keeps compressed-tensors weights in FP8, each rank quantizes its
dequantized shard per channel as `quantize="fp8"` does (sharding.py: close to the single engine, not
bit-equal, for row-parallel layers).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from bulkgen.engine.model.checkpoint_checks import SCALE_SUFFIX
from bulkgen.engine.parallel.layers import layer_of
from bulkgen.engine.parallel.shard_base import safetensors_files
from bulkgen.engine.parallel.shard_gptoss import splits_quantized

ACTIVATION_STRATEGIES = {"token", "tensor", "group"}
WEIGHT_STRATEGIES = {"tensor", "channel", "block"}


class Fp8Checkpoint:
    """An FP8 checkpoint's format, as the ranks read and run it."""

    def __init__(self, quant: dict, device: torch.device) -> None:
        self.method = quant["quant_method"]
        self.block = _block_size(quant)
        self.scale_files: dict[str, str] | None = None  # scale tensor -> its file (reader)
        # as loading._kernel_options: transformers keeps compressed-tensors FP8 on sm89+ (its row-wise GEMM)
        self.keeps_fp8 = (
            self.method == "compressed-tensors"
            and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (8, 9)
        )

    def reader(self, handle, dtype: torch.dtype, path) -> Fp8Handle:
        """`handle` (a safetensors file of the checkpoint at `path`) with its FP8 weights read as
        dequantized slices (load_shards has checked the checkpoint: every FP8 tensor has its scale)."""
        if self.scale_files is None:
            self.scale_files = _scale_files(path, SCALE_SUFFIX[self.method])
        return Fp8Handle(handle, dtype, self)

    def attach_activations(self, model: nn.Module, path, plan: dict[str, str], group) -> None:
        """Give each compressed-tensors linear its input quantization, as the single engine runs it
        (nothing to do for fine-grained FP8: transformers dequantizes it to plain linears)."""
        if self.method == "compressed-tensors" and not self.keeps_fp8:
            _attach_compressed_tensors(model, path, plan, group)


def fp8_checkpoint(config, world: int, device: torch.device | str = "cpu") -> Fp8Checkpoint | None:
    """The checkpoint's FP8 format (None: float weights); ValueError, naming what, for a quantization the
    ranks cannot split (anything but fine-grained and compressed-tensors FP8 with dynamic activations)."""
    quant = getattr(config, "quantization_config", None)
    if quant is None or splits_quantized(config):  # float, or gpt-oss' MXFP4 (shard_gptoss reads it)
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method")
    if getattr(config, "vision_config", None) is not None:
        method = f"{method}, in a vision-language model"  # its encoder and projector load elsewhere
    problem = _unsupported(quant) if method in SCALE_SUFFIX else f"its weights are quantized ({method})"
    if problem:
        raise ValueError(
            f"tensor_parallel={world}: {problem}, which tensor parallel does not split; it splits FP8 "
            "checkpoints (fine-grained `fp8`, compressed-tensors FP8 with dynamic activations). Serve it at "
            "tensor_parallel 1, or serve the float checkpoint with --quantize fp8 (each rank quantizes its shard)"
        )
    return Fp8Checkpoint(quant, torch.device(device))


def _unsupported(quant: dict) -> str | None:
    """What in an FP8 checkpoint's config the ranks cannot reproduce, or None."""
    if quant["quant_method"] == "fp8":
        scheme = quant.get("activation_scheme", "dynamic")
        return None if scheme == "dynamic" else f"its activation scales are {scheme} (fp8)"
    if quant.get("kv_cache_scheme"):
        return "it quantizes the KV cache (compressed-tensors kv_cache_scheme)"
    if quant.get("format") not in ("float-quantized", None):
        return f"its compressed-tensors format is {quant.get('format')!r}"
    for name, group in (quant.get("config_groups") or {}).items():
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            return f"its group {name} stores {weights.get('type')}{weights.get('num_bits')} weights"
        if weights.get("strategy") not in WEIGHT_STRATEGIES:
            return f"its group {name} scales weights per {weights.get('strategy')}"
        if group.get("output_activations"):
            return f"its group {name} quantizes output activations"
        if inputs and (not inputs.get("dynamic") or inputs.get("strategy") not in ACTIVATION_STRATEGIES):
            return f"its group {name} quantizes input activations statically or per {inputs.get('strategy')}"
    return None


def _block_size(quant: dict) -> tuple[int, int] | None:
    """The weight scale block (rows, columns) where weights are scaled per block."""
    if quant["quant_method"] == "fp8":
        block = quant.get("weight_block_size")
        return tuple(block) if block else None
    blocks = {
        tuple(g["weights"]["block_structure"])
        for g in (quant.get("config_groups") or {}).values()
        if g["weights"].get("strategy") == "block"
    }
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors groups with different weight blocks {sorted(blocks)}")
    return blocks.pop() if blocks else None


def _scale_files(path, suffix: str) -> dict[str, str]:
    """Every scale tensor of the checkpoint and the file that holds it: a weight's scales may be in
    another file of a sharded checkpoint than the weight."""
    from safetensors import safe_open

    files = {}
    for file in safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            files.update((name, str(file)) for name in handle.keys() if name.endswith(suffix))
    return files


class Fp8Handle:
    """A safetensors file whose FP8 weights read as slices in the load dtype, each with its scales
    (from whichever file holds them); everything else reads as stored. What load_shards uses of it."""

    def __init__(self, handle, dtype: torch.dtype, checkpoint: Fp8Checkpoint) -> None:
        self.handle, self.dtype, self.checkpoint = handle, dtype, checkpoint
        self.method, self.block = checkpoint.method, checkpoint.block
        self.opened: dict[str, object] = {}  # the other files scales were read from

    def keys(self):
        return self.handle.keys()

    def get_slice(self, name: str):
        view = self.handle.get_slice(name)
        scale = f"{name}{SCALE_SUFFIX[self.method]}"
        # an FP8 tensor without its scale was refused by check_checkpoint before any was read
        return Fp8Slice(view, scale, self) if scale in self.checkpoint.scale_files else view

    def file_of(self, scale: str):
        """The open file that holds tensor `scale`."""
        file = self.checkpoint.scale_files[scale]
        if scale in self.handle.keys():
            return self.handle
        if file not in self.opened:
            from safetensors import safe_open

            self.opened[file] = safe_open(file, framework="pt", device="cpu")
        return self.opened[file]


class Fp8Slice:
    """One FP8 weight: indexing it reads those values and their scales' matching slice, dequantized."""

    def __init__(self, weight, scale_name: str, handle: Fp8Handle) -> None:
        self.weight, self.scale_name, self.handle = weight, scale_name, handle
        self.scale = handle.file_of(scale_name).get_slice(scale_name)

    def get_shape(self) -> list[int]:
        return self.weight.get_shape()

    def __getitem__(self, key) -> torch.Tensor:
        full = tuple(self.weight.get_shape())
        key = key if isinstance(key, tuple) else (key,)
        spans = [
            _span(k, n) for k, n in zip(key + (slice(None),) * (len(full) - len(key)), full, strict=True)
        ]
        values = self.weight[tuple(slice(a, b) for a, b in spans)]
        # transformers' Fp8Dequantize multiplies in float32, then casts to the load dtype; compressed-tensors
        # in its scale's dtype, its scale parameter's: the load dtype. In place on the one float copy
        dtype = torch.float32 if self.handle.method == "fp8" else self.handle.dtype
        out = values.to(dtype)
        scale, per_block = self._scales(spans, full, tuple(self.scale.get_shape()))
        if per_block:  # one scale per whole block: broadcast over a view of the blocks
            rows, cols = out.shape[-2:]
            grid = out.view(*out.shape[:-2], scale.shape[-2], rows // scale.shape[-2], scale.shape[-1], -1)
            grid.mul_(scale.to(dtype)[..., :, None, :, None])
        else:
            out.mul_(scale.to(dtype))
        return out.to(self.handle.dtype)

    def _scales(self, spans: list[tuple[int, int]], full: tuple, shape: tuple) -> tuple[torch.Tensor, bool]:
        """The scales of the values in `spans` and whether they are one per whole block (else they
        broadcast to the values): a scale dimension of 1 (per tensor, per output channel, per expert)
        stays whole, one as long as the weight's is sliced with it, and a shorter one holds blocks."""
        if len(shape) < len(full):  # one scale for the whole tensor, stored as [1] or []
            return self.handle.file_of(self.scale_name).get_tensor(self.scale_name).reshape(-1)[0], False
        if all(s in (1, n) for s, n in zip(shape, full, strict=True)):
            index = zip(spans, shape, full, strict=True)
            return self.scale[tuple(slice(a, b) if s == n else slice(None) for (a, b), s, n in index)], False
        blocks = self.handle.block or (-(-full[-2] // shape[-2]), -(-full[-1] // shape[-1]))
        index = [slice(a, b) for a, b in spans[:-2]]
        for (start, stop), n, size in zip(spans[-2:], full[-2:], blocks, strict=True):
            if start % size or (stop % size and stop != n):
                raise ValueError(
                    f"a rank's rows or columns {start}:{stop} of {n} are not whole {size}-wide FP8 scale blocks "
                    f"(block {list(blocks)}); vLLM refuses this split too (not divisible by weight quantization "
                    "block): use a tensor_parallel that leaves each rank whole blocks"
                )
            index.append(slice(start // size, -(-stop // size)))
        scale = self.scale[tuple(index)]
        rows, cols = spans[-2][1] - spans[-2][0], spans[-1][1] - spans[-1][0]
        if rows % blocks[0] == 0 and cols % blocks[1] == 0:
            return scale, True
        for dim, size in zip((-2, -1), blocks, strict=True):  # a last, partial block: scales per value
            scale = scale.repeat_interleave(size, dim=dim)
        return scale[..., :rows, :cols], False


def _span(key, n: int) -> tuple[int, int]:
    """(start, stop) of one index of a dimension of size `n`: a slice with step 1, or an int."""
    if isinstance(key, int):
        raise TypeError("an FP8 weight is read by slices, not single rows")
    start, stop, step = key.indices(n)
    if step != 1:
        raise TypeError("an FP8 weight is read by contiguous slices")
    return start, stop


def _attach_compressed_tensors(model: nn.Module, path, plan: dict[str, str], group) -> None:
    """compressed-tensors' schemes on the rank's linears (matched by its own targets and ignore list, as
    the loaded model names them), weights marked decompressed (they are: Fp8Slice), and the input
    quantization of a row-parallel linear taken over the ranks."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM

    from bulkgen.engine.model.loading import _config_ignoring_by_model_names

    config = _config_ignoring_by_model_names(path, AutoModelForCausalLM).quantization_config
    apply_quantization_config(model, QuantizationConfig.model_validate(config), show_progress=False)
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        for param in ("weight_scale", "weight_zero_point"):  # the weights are already dequantized
            if hasattr(module, param):
                delattr(module, param)
        module.quantization_status = QuantizationStatus.DECOMPRESSED
        inputs = scheme.input_activations
        if inputs is not None and layer_of(plan, name).splits_input:
            if inputs.strategy == "group" and module.in_features % inputs.group_size:
                raise ValueError(
                    f"{name}: a rank's {module.in_features} input columns are not whole groups of "
                    f"{inputs.group_size} (its activation quantization groups would straddle ranks)"
                )
            module.forward = functools.partial(_row_parallel_forward, module, group.all_reduce)


def _row_parallel_forward(self: nn.Linear, all_reduce, input: torch.Tensor) -> torch.Tensor:
    """A row-parallel linear's forward with compressed-tensors' dynamic input quantization, its scale
    taken over the whole row: the maximum of the ranks' scales (per group: each rank's own), by the
    group's `all_reduce`, bound as the forward is swapped in (no group on the module)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = self.quantization_scheme.input_activations
    if input.numel():
        scale, zero_point = compute_dynamic_scales_and_zp(value=input, args=args, module=self)
        if args.strategy != "group":
            scale = all_reduce(scale.contiguous(), torch.distributed.ReduceOp.MAX)
        input = fake_quantize(x=input, scale=scale, zero_point=zero_point, args=args)
    return nn.Linear.forward(self, input)
