"""Loading a local checkpoint onto its device: float, quantized checkpoints, or FP8 online.

A quantized checkpoint (its config.json names a `quantization_config`: compressed-tensors,
fine-grained FP8, MXFP4, AWQ, GPTQ, bitsandbytes) goes through transformers' own quantizer for that
method, which swaps in the quantized modules the engine then drives like any other. A method whose
quantizer needs a package this install lacks fails here with one line naming the bulkgen extra.

Nothing may reach the network at load: transformers can fetch compiled kernels from the Hugging Face
hub (its `kernels` integration), so hub kernels are switched off and the hub is put offline for the
process before transformers loads anything.

Before transformers reads a weight, the checkpoint is checked (checkpoint_checks.py): its safetensors
headers, and in a quantized checkpoint every quantized tensor's scale and every scale's values, so a
broken checkpoint is refused with one line naming the file and tensor instead of serving garbage.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import os
import warnings
from pathlib import Path

import torch

from bulkgen.engine.model import load_progress, upstream
from bulkgen.engine.model.checkpoint_checks import DTYPE_BYTES, check_checkpoint
from bulkgen.engine.model.quantize import quantize_layers
from bulkgen.engine.model.weight_format import checkpoint_quantization, read_config

log = logging.getLogger(__name__)

# quantization_config.quant_method -> (the Python packages its transformers quantizer needs, the extra)
METHOD_PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "compressed-tensors": (("compressed_tensors",), "fp8"),
    "fp8": (("accelerate",), "fp8"),
    "mxfp4": (("accelerate",), "mxfp4"),
    "awq": (("gptqmodel",), "awq"),
    "gptq": (("gptqmodel", "optimum"), "gptq"),
    "bitsandbytes": (("bitsandbytes", "accelerate"), "bnb"),
}

# methods whose quantized GEMMs only come from the hub: their transformers config class, to dequantize
DEQUANTIZED = {"fp8": "FineGrainedFP8Config", "mxfp4": "Mxfp4Config"}


def no_hub_kernels() -> None:
    """Keep transformers from downloading kernels: its hub integration reads USE_HUB_KERNELS (before
    5.25 once, at import, into a module flag, cleared here too if it was imported first; from 5.25 at
    each use, through a function of that name), and the `kernels` package honours HF_HUB_OFFLINE for the
    direct fetches some quantizers make."""
    os.environ["USE_HUB_KERNELS"] = "NO"
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers.integrations import hub_kernels

    switch = getattr(hub_kernels, "_kernels_enabled", None)
    if isinstance(switch, bool):
        hub_kernels._kernels_enabled = False
    elif not callable(switch):  # neither form: bulkgen could not tell whether a load fetches kernels
        raise upstream.mismatch(
            "transformers' hub_kernels has no _kernels_enabled switch to turn hub kernels off"
        )


def check_method_packages(method: str | None) -> None:
    """ImportError naming `pip install 'bulkgen[EXTRA]'` when the method's quantizer lacks a package."""
    if method is None or method not in METHOD_PACKAGES:
        return
    packages, extra = METHOD_PACKAGES[method]
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"this checkpoint is quantized with {method!r}, which needs {', '.join(missing)}: "
            f"pip install 'bulkgen[{extra}]'"
        )


def load_model(
    path: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    quantize: str | None = None,
    vision: bool = False,
) -> torch.nn.Module:
    """The checkpoint's causal LM on `device`, in eval mode; with `vision`, its whole vision-language
    model (AutoModelForImageTextToText). `quantize="fp8"` quantizes a float checkpoint's decoder layers
    as they move to the device (quantize.quantize_layers): a vision-language model's are its text
    model's, so its vision tower and projector stay in the load dtype. A quantized checkpoint keeps
    its own format."""
    no_hub_kernels()
    upstream.warn_if_untested("transformers")
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    method = checkpoint_quantization(path)
    if quantize is not None and method is not None:
        # one service setting for every model: a quantized checkpoint beside float ones keeps its own format
        log.info(
            "%s is already quantized (%s): quantize=%r applies to float checkpoints only",
            path,
            method,
            quantize,
        )
        quantize = None
    check_method_packages(method)
    check_checkpoint(path, (read_config(path) or {}).get("quantization_config"))
    options = _quantizer_options(path, method, torch.device(device), auto_class)
    with (
        warnings.catch_warnings(),
        _counting_reads(),
    ):  # the loading attributes given below are meant to override the checkpoint's
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        model = auto_class.from_pretrained(
            path, dtype=dtype, local_files_only=True, use_kernels=False, **options
        )
    if vision and hasattr(model, "ct_decompress_hook"):
        # compressed-tensors decompresses at the model's first forward (a pre-hook on it), but the engine
        # calls a vision-language model's text model directly (multimodal.text_model): decompress now
        model.hf_quantizer.compressor.decompress_model(model)
    if quantize:
        quantize_layers(model, device, quantize)
    else:
        model.to(device)
    return model.eval()


@contextlib.contextmanager
def _counting_reads():
    """Count each checkpoint tensor transformers reads into the load under way (load_progress), so the
    worker's liveness answers report tensors and bytes done; nothing changes without one, or when this
    transformers reads its tensors elsewhere (then only the phase and the size are reported)."""
    progress = load_progress.current()
    from transformers import core_model_loading

    original = getattr(core_model_loading, "_materialize_copy", None)
    if progress is None or original is None:
        yield
        return

    def materialize(tensor, *args, **kwargs):
        out = original(tensor, *args, **kwargs)
        stored = tensor.get_dtype() if hasattr(tensor, "get_dtype") else None  # a safetensors slice's
        size = DTYPE_BYTES.get(stored, 1) if stored else tensor.element_size()
        progress.tensor_read(out.numel() * size)
        return out

    core_model_loading._materialize_copy = materialize
    try:
        yield
    finally:
        core_model_loading._materialize_copy = original


def _quantizer_options(path: str | Path, method: str | None, device: torch.device, auto_class) -> dict:
    """from_pretrained's options for a quantized checkpoint. A quantizer places its modules where they
    run (a float checkpoint moves there after loading, a layer at a time when quantized online)."""
    if method is None:
        return {}
    options = {"device_map": str(device), **_kernel_options(method, device)}
    if method == "compressed-tensors":
        options["config"] = _config_ignoring_by_model_names(path, auto_class)
    return options


def _config_ignoring_by_model_names(path: str | Path, auto_class):
    """The checkpoint's config with each module of its compressed-tensors `ignore` list also named as
    the loaded model names it. Checkpoints list ignored modules in their stored layout (Qwen2.5-VL's
    `visual.blocks.0.attn.qkv`, LLaVA's `language_model.lm_head`: the hub's, and what transformers
    writes back), which transformers renames on load (`model.visual.…`, `lm_head`) while
    compressed-tensors matches `ignore` against the renamed modules: unmatched, a vision-language
    checkpoint's float vision tower and projector would be given FP8 schemes with scales that are
    not in the checkpoint (newly initialised)."""
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    quant = config.quantization_config
    with torch.device("meta"):  # only the module tree, for the renaming rules transformers loads it by
        renamings = get_model_conversion_mapping(auto_class.from_config(config))
    renamed = []
    for name in quant.get("ignore") or []:
        if name.startswith("re:"):  # a pattern: kept as the checkpoint wrote it
            continue
        key = f"{name}.weight"  # the rules rename weights, in order, each on the last one's result
        for rule in renamings:
            key = rule.rename_source_key(key)[0]
        renamed.append(key.removesuffix(".weight"))
    ignore = list(dict.fromkeys([*(quant.get("ignore") or []), *renamed]))
    config.quantization_config = {**quant, "ignore": ignore}
    return config


def _kernel_options(method: str, device: torch.device) -> dict:
    """Loading attributes (they override the checkpoint's) for what runs without hub kernels.
    compressed-tensors FP8: transformers decompresses it to the load dtype at its first forward unless
    `use_optimized_inference` keeps the weights in FP8 for its row-wise FP8 GEMM (CUDA sm89+ only).
    Fine-grained FP8 and MXFP4: their GEMMs are hub kernels (finegrained-fp8 or DeepGEMM; gpt-oss'
    triton_kernels), so they are dequantized at load, as transformers does itself when `kernels` is
    not installed."""
    import transformers

    if method == "compressed-tensors" and device.type == "cuda":
        name, option = "CompressedTensorsConfig", "use_optimized_inference"
    elif method in DEQUANTIZED:
        name, option = DEQUANTIZED[method], "dequantize"
    else:
        return {}
    config = getattr(transformers, name, None)
    if config is None or option not in inspect.signature(config).parameters:
        return {}  # an older transformers: its default route
    return {"quantization_config": config(**{option: True})}
