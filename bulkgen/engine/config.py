"""Engine settings, validated once at construction (ValueError naming the field, never `assert`; TypeError
naming an option that is no field). Imports no torch: the service's settings build and check an EngineConfig
without loading the model's side."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from bulkgen.engine import QUANTIZE_MODES

if TYPE_CHECKING:
    import torch

ADMISSIONS = ("longest_first", "shortest_first", "fifo")
GENERATION_CONFIG_MODES = ("auto", "none")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # what K/V rows are stored in (kv_cache.kv_dtype)


@dataclass
class EngineConfig:
    """Scheduling and KV-cache limits.

    `max_num_seqs` and `max_num_batched_tokens` left as None are sized for the device by
    `resolve_limits`: 64 / 2,048 on CPU; on CUDA from the memory free after loading the weights.

    KV-cache size: `num_kv_blocks` wins if given; else `kv_cache_bytes`; else on CUDA
    `kv_cache_memory_fraction` of the memory free after loading the model, and on CPU enough blocks
    for `max_num_seqs` full-length sequences capped at 2 GiB.
    """

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.85
    admission: str = "longest_first"
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    cuda_graphs: bool | None = None  # decode steps over static buffers; None: on CUDA only
    # launch a step before reading the previous one's tokens (engine.py, "Overlapped steps"); None: on CUDA only
    async_scheduling: bool | None = None
    # hybrid models (state_slots.py): sequences that can hold recurrent state at once; None: max_num_seqs
    num_state_slots: int | None = None
    max_loras: int = 4  # LoRA adapters resident on the device at once (lora_slots.py), so per step
    max_lora_rank: int = 64  # adapters of a higher rank are refused at load
    # what K/V rows are stored in (kv_cache.py): "auto" the model's dtype, "fp8" / "fp8_e4m3" e4m3 with a
    # scale per token and head (about twice the blocks for the same bytes)
    kv_cache_dtype: str = "auto"
    # weights quantized at load (quantize.py): "fp8" for a float checkpoint; None keeps the checkpoint's own
    quantize: str | None = None
    # ranks that each hold 1/N of the weights and KV heads (tensor_parallel.py); from_pretrained starts them
    tensor_parallel: int = 1
    # seconds a rank waits in one collective before the step fails on every rank (a dead or hung rank)
    collective_timeout_s: float = 300.0
    # the model's generation_config.json sampling defaults (temperature, top_p, top_k, min_p,
    # repetition_penalty) for requests that set none (Engine.sampling_params): "auto" applies them, "none"
    # keeps OpenAI's defaults (vLLM's --generation-config)
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_loras", "max_lora_rank", "tensor_parallel"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.collective_timeout_s, (int, float)) or self.collective_timeout_s <= 0:
            raise ConfigError("collective_timeout_s", self.collective_timeout_s, "must be a positive number")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "num_kv_blocks",
            "kv_cache_bytes",
            "max_model_len",
            "num_state_slots",
        ):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        fraction = self.kv_cache_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ConfigError("kv_cache_memory_fraction", self.kv_cache_memory_fraction, "must be in (0, 1]")
        _one_of("admission", self.admission, ADMISSIONS)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.quantize is not None:
            _one_of("quantize", self.quantize, QUANTIZE_MODES, " (or None)")
        _one_of("generation_config", self.generation_config, GENERATION_CONFIG_MODES)
        for name in ("cuda_graphs", "async_scheduling"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(
                    name, getattr(self, name), "must be true, false or None (the device's default)"
                )


class ConfigError(ValueError):
    """An EngineConfig field's value fails its check: `field` names it and `message` says what it must be, so
    the service's settings (bulkgen.settings) can name the flag without checking the value a second time."""

    def __init__(self, field: str, value: object, message: str) -> None:
        super().__init__(f"{field} {message}, got {value!r}")
        self.field, self.value, self.message = field, value, message


def engine_config(config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    """The config an engine is built with: `config`, or one made of EngineConfig fields passed as keywords
    (`Engine.from_pretrained(path, max_num_seqs=8)`, the short form for library callers). An option that is
    no field is a TypeError naming it; both forms at once is a TypeError too."""
    if config is None:
        return EngineConfig(**options)
    if options:
        raise TypeError(
            f"pass the engine's settings as config or as keywords, not both: got config and {sorted(options)}"
        )
    return config


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(name, value, "must be a positive int")


def _one_of(name: str, value: object, choices: tuple[str, ...], more: str = "") -> None:
    if value not in choices:
        raise ConfigError(name, value, f"must be one of {', '.join(choices)}{more}")


CPU_DEFAULTS = (64, 2048)  # (max_num_seqs, max_num_batched_tokens)
GIB = 1 << 30


def resolve_limits(config: EngineConfig, device: torch.device) -> EngineConfig:
    """Fill unset step limits for the device. A GPU is only busy with hundreds of sequences per
    step: with >= 40 GiB free (an H100/H200 after a small model) 512 sequences and 16k tokens,
    with >= 16 GiB 256 / 8k, else 128 / 4k. Explicit values always win."""
    import torch

    seqs, tokens = CPU_DEFAULTS
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        seqs, tokens = (512, 16384) if free >= 40 * GIB else (256, 8192) if free >= 16 * GIB else (128, 4096)
    return replace(
        config,
        max_num_seqs=config.max_num_seqs or seqs,
        max_num_batched_tokens=config.max_num_batched_tokens or tokens,
    )
