"""Service settings: plain data, validated once, read by every floor (batch, runtime, api, cli).

Each setting is stated once, as a field: its default, its check, and the command-line flag a user sets it
with (`Flag` in the field's metadata: name, help, env var, unit). `bulkgen.cli.settings_options` makes the
click options from those fields and `from_flags` turns what the user typed back into Settings, so a new
setting is one new field (bulkgen.settings_flags walks them). Nothing here does work; the batch service (`bulkgen.batch.service`) and the
runtime take these values.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from bulkgen.engine import QUANTIZE_MODES
from bulkgen.engine.config import GENERATION_CONFIG_MODES, KV_CACHE_DTYPES, ConfigError, EngineConfig
from bulkgen.models.loras import LoraSpec, parse_lora_specs
from bulkgen.models.registry import (
    EVERY_MODEL,
    parse_model_specs,
    parse_reasoning_parsers,
    parse_template_options,
    parse_tensor_parallel,
    parse_thinking_budgets,
    parse_tool_parsers,
)
from bulkgen.tenants import DEFAULT_TENANT, check_tenant, check_weight

DEFAULT_STORAGE = os.path.join(".bulkgen", "storage")
SCHEDULING = ("fifo", "deadline")
BODY_TIMEOUT_S = 60.0  # seconds a request body may stall before the API refuses it (`serve --body-timeout`)
MIB = 1024 * 1024


class SettingError(ValueError):
    """A field's value fails its check; `field` names it, so the command line can name its flag instead."""

    def __init__(self, field: str, value: Any, message: str) -> None:
        super().__init__(f"{field} {value!r}: {message}")
        self.field, self.value, self.message = field, value, message


@dataclass(frozen=True)
class Flag:
    """How a user sets one field from the command line."""

    name: str  # the option, e.g. "--max-file-mb"
    help: str | None = None
    envvar: str | None = None
    metavar: str | None = None
    type: type | None = None  # None: the type of the field's default
    choices: tuple[str, ...] | None = None
    scale: int = 1  # field = flag value * scale (--max-file-mb MiB -> max_file_bytes)
    parse: Callable[[tuple[str, ...]], Any] | None = (
        None  # a repeatable flag: its values -> the field's value
    )
    shared: bool = True  # False: only the command that uses it declares it (serve)


def setting(
    default: Any = MISSING,
    *,
    factory: Any = MISSING,
    flag: Flag | None = None,
    check: Callable[[Any], None] | None = None,
    keys: Mapping[str, Flag] | None = None,
) -> Any:
    """A settings field. `flag=None` says on purpose that users do not set it from the command line;
    `check` raises ValueError (what is wrong, without the value); `keys`: flags of a dict field's keys."""
    return field(
        default=default, default_factory=factory, metadata={"flag": flag, "check": check, "keys": keys}
    )


def _positive_int(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("must be a positive int")


def _optional(check: Callable[[Any], None]) -> Callable[[Any], None]:
    return lambda value: None if value is None else check(value)


def _at_least(low: float, what: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if not value >= low:
            raise ValueError(f"must be at least {what}")

    return check


def _over(low: float, what: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if not value > low:
            raise ValueError(f"must be over {what}")

    return check


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")

    return check


def _some_model(models: dict[str, str]) -> None:
    if not models:
        raise ValueError("at least one model must be served")


def _check_weights(weights: dict[str, float]) -> None:
    for name, weight in weights.items():
        check_weight(str(weight), f"tenant {check_tenant(name)!r}")


def parse_tenant_weights(specs: tuple[str, ...] | list[str]) -> dict[str, float]:
    """`TENANT=W` flags (`--tenant-weight`) to tenant -> weight; ValueError naming the flag and the bad one."""
    weights = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        try:
            if not sep:
                raise ValueError("expected TENANT=W, e.g. analytics=3")
            weights[check_tenant(name.strip())] = check_weight(value.strip(), f"tenant {name.strip()!r}")
        except ValueError as exc:
            raise ValueError(f"--tenant-weight {spec[:80]!r}: {exc}") from None
    return weights


# EngineConfig fields the command line sets through WorkerSettings.engine_kwargs; absent: sized for the device.
ENGINE_FLAGS = {
    "max_num_seqs": Flag(
        "--max-num-seqs",
        type=int,
        help="Sequences per engine step; default sized for the device (CPU 64, GPU 128-512 by free memory).",
    ),
    "max_num_batched_tokens": Flag(
        "--max-num-batched-tokens",
        type=int,
        help="Token budget per engine step "
        "(chunked prefill above it); default by device (CPU 2048, GPU 4k-16k).",
    ),
    "async_scheduling": Flag(
        "--async-scheduling",
        type=bool,
        envvar="BULKGEN_ASYNC_SCHEDULING",
        metavar="on|off",
        help="Launch each engine step before reading the previous one's tokens, so the host's work runs while "
        "the GPU computes (a stop is seen one step late); default on with a GPU, off on CPU.",
    ),
    "max_loras": Flag(
        "--max-loras",
        type=int,
        help="LoRA adapters one engine step may mix (device slots; more are kept on the host); default 4.",
    ),
    "kv_cache_dtype": Flag(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="What the KV cache stores: auto (the model's dtype) or fp8 (e4m3 with a scale per token and "
        "head: about twice the sequences in the same memory; fp8_e4m3 is the same).",
    ),
    "quantize": Flag(
        "--quantize",
        type=str,
        choices=QUANTIZE_MODES,
        help="Quantize a float checkpoint's decoder-layer weights at load: fp8 (e4m3, per-channel weight and "
        "per-token activation scales, torch._scaled_mm); default none (a quantized checkpoint keeps its own).",
    ),
    "generation_config": Flag(
        "--generation-config",
        choices=GENERATION_CONFIG_MODES,
        help="auto: the model's generation_config.json sampling defaults (temperature, top_p, top_k, min_p, "
        "repetition_penalty) apply to lines that set none; none: OpenAI's defaults (vLLM's flag).",
    ),
}


def _per_model(usage: str, parse: Callable, help: str, check: Callable | None = None) -> Any:
    """A setting per served model (`usage`: "--flag VALUE|NAME=VALUE"): model name (EVERY_MODEL for the
    bare value) -> value; `Settings` checks that every NAME is served."""
    name, metavar = usage.split(" ")
    return setting(factory=dict, check=check, flag=Flag(name, metavar=metavar, parse=parse, help=help))


def _check_engine(engine_kwargs: dict[str, Any]) -> None:
    """Refuse an option that is no engine setting here, not when a worker builds its engine; EngineConfig checks
    each value (once, for the library and the service alike) and its error names the field, so the command
    line names the flag."""
    unknown = sorted(engine_kwargs.keys() - EngineConfig.__dataclass_fields__.keys())
    if unknown:
        key = unknown[0]
        raise SettingError(
            key, engine_kwargs[key], "is not an engine setting (bulkgen.engine.config.EngineConfig)"
        )
    if "tensor_parallel" in engine_kwargs:  # the pool sets it per class of workers from the field
        raise SettingError(
            "tensor_parallel", engine_kwargs["tensor_parallel"], "set WorkerSettings.tensor_parallel instead"
        )
    try:
        EngineConfig(**engine_kwargs)
    except ConfigError as exc:  # EngineConfig checks each value once; this names its field (and so its flag)
        raise SettingError(exc.field, exc.value, exc.message) from None


def _check_fields(settings: Any) -> None:
    for item in fields(settings):
        check, value = item.metadata.get("check"), getattr(settings, item.name)
        try:
            if check is not None:
                check(value)
        except SettingError:
            raise
        except ValueError as exc:
            raise SettingError(item.name, value, str(exc)) from None


def parse_hosts(specs: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`--image-url-hosts` values (repeatable, each may list several, comma-separated) -> lowercase host
    names; `*.example.com` allows every subdomain of example.com."""
    hosts = []
    for spec in specs:
        for host in filter(None, (h.strip().lower() for h in spec.split(","))):
            if not re.fullmatch(r"(\*\.)?[a-z0-9.-]+|\[[0-9a-f:.]+\]", host):
                raise ValueError(
                    f"--image-url-hosts {host[:80]!r}: not a host name (e.g. images.example.com)"
                )
            hosts.append(host.strip("[]"))  # an IPv6 literal as a URL's hostname reads it
    return tuple(hosts)


def _check_ranks(ranks: dict[str, int]) -> None:
    for name, count in ranks.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"model name {name!r} is not a name")
        _positive_int(count)


@dataclass
class ImageSettings:
    """Where image parts may point and how much of an image a worker holds: the limits that bound the memory
    of decoding (max pixels per image, images per line, decoding threads, the worker's image memory budget)
    and the reach of a fetch."""

    image_url_hosts: tuple[str, ...] = setting(
        (),
        flag=Flag(
            "--image-url-hosts",
            metavar="HOST[,HOST]",
            parse=parse_hosts,
            help="Hosts whose http(s) image URLs workers may fetch (repeatable; *.example.com for subdomains); "
            "default none: data: URLs, file ids and s3:// under --storage only. Never private addresses.",
        ),
    )
    max_image_bytes: int = setting(
        20 * MIB,
        check=_positive_int,
        flag=Flag(
            "--max-image-mb", scale=MIB, help="Largest image (encoded) a line may carry or point to, in MiB."
        ),
    )
    max_image_pixels: int = setting(
        50_000_000,
        check=_positive_int,
        flag=Flag(
            "--max-image-pixels", help="Most pixels (width x height) of one image; larger ones are refused."
        ),
    )
    max_images_per_line: int = setting(
        32, check=_positive_int, flag=Flag("--max-images-per-line", help="Most image parts in one request.")
    )
    image_fetch_timeout_s: float = setting(
        10.0,
        check=_over(0, "0 seconds"),
        flag=Flag(
            "--image-fetch-timeout", help="Seconds one http(s) image fetch may take, redirects included."
        ),
    )
    image_decode_threads: int = setting(
        4,
        check=_positive_int,
        flag=Flag("--image-decode-threads", help="Threads per worker that read and decode images."),
    )
    image_memory_bytes: int = setting(
        2048 * MIB,
        check=_positive_int,
        flag=Flag(
            "--image-memory-mb",
            scale=MIB,
            help="Memory per worker for images being decoded and processed and the processor's pixel tensors "
            "not yet freed, in MiB (an image is costed from its header before any pixel is decoded); a line whose "
            "images cost more is refused, others wait for their share.",
        ),
    )

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass
class WorkerSettings:
    """The engine worker actors: where Ray is, how many actors, and the engine's own settings."""

    ray_address: str | None = setting(
        None,
        flag=Flag(
            "--ray-address",
            envvar="RAY_ADDRESS",
            help="Join this Ray cluster (host:port, ray://…, or 'auto': this "
            "machine's `ray start` cluster; env RAY_ADDRESS); default: a private local Ray, whatever else runs here.",
        ),
    )
    num_workers: int | None = setting(
        None,
        check=_optional(_positive_int),
        flag=Flag("--workers", type=int, help="Engine workers; default one per GPU, else --cpu-workers."),
    )
    cpu_workers: int = setting(
        1, check=_positive_int, flag=Flag("--cpu-workers", help="CPU workers when there is no GPU.")
    )
    # torch threads per CPU worker (Ray sets 1 otherwise); sized by whoever builds a pool, not by users
    cpu_threads: int | None = setting(None, check=_optional(_positive_int))
    engine_kwargs: dict[str, Any] = setting(factory=dict, check=_check_engine, keys=ENGINE_FLAGS)
    # model name (EVERY_MODEL: all not named) -> ranks per worker; the pool starts one class of workers
    # per rank count in use, and a model's ranges go only to workers of its count (runtime/pool.py)
    tensor_parallel: dict[str, int] = _per_model(
        "--tensor-parallel N|NAME=N",
        parse_tensor_parallel,
        "Ranks per worker, each holding 1/N of the model's weights and KV heads (one GPU each, on one "
        "node, one Ray actor each, gloo ranks on CPU): serve a model larger than one GPU. N sets every model, NAME=N the model "
        "served as NAME (repeatable; wins over N); default 1. Each rank count gets its own workers.",
        check=_check_ranks,
    )
    # model name -> how its output's reasoning is read (bulkgen.batch.reasoning)
    reasoning_parsers: dict[str, str] = _per_model(
        "--reasoning-parser PARSER|NAME=PARSER",
        parse_reasoning_parsers,
        "How a reasoning model's output is read into message.reasoning and content: auto (what its "
        "chat template teaches: think for <think>…</think>, harmony for gpt-oss's channels), think, harmony "
        "or none (the raw text as content). PARSER sets every model, NAME=PARSER the model served as NAME "
        "(repeatable; wins over PARSER); default auto (docs/reasoning.md).",
    )
    # model name -> how its output's tool calls are read (bulkgen.batch.tools)
    tool_parsers: dict[str, str] = _per_model(
        "--tool-parser FORMAT|NAME=FORMAT",
        parse_tool_parsers,
        "How a model's tool calls are read out of its answers (and forced calls written): auto (the format "
        "its chat template teaches), a format of docs/structured-outputs.md's table (hermes, llama3, "
        "mistral, qwen3_coder, glm45, minimax_m2, kimi_k2, deepseek_v3, deepseek_v31, pythonic, harmony) "
        "or none (calls stay content). FORMAT sets every model, NAME=FORMAT the model served as NAME "
        "(repeatable; wins over FORMAT); default auto.",
    )
    # model name -> chat template options its chat lines get where they set none
    template_options: dict[str, dict] = _per_model(
        "--chat-template-kwargs JSON|NAME=JSON",
        parse_template_options,
        "Chat template options of a model's chat lines, as a JSON object, e.g. "
        "'qwen={\"enable_thinking\": false}': each option a line's own chat_template_kwargs does not set. "
        "JSON sets every model, NAME=JSON the model served as NAME (repeatable; wins over JSON).",
    )
    # model name -> the thinking_token_budget its chat and responses lines get where they set none
    thinking_budgets: dict[str, int] = _per_model(
        "--thinking-token-budget N|NAME=N",
        parse_thinking_budgets,
        "Reasoning tokens a reasoning model's chat and responses lines may spend before the engine forces the "
        "end of their reasoning, where a line sets no thinking_token_budget of its own. N sets every model, "
        "NAME=N the model served as NAME (repeatable; wins over N); default: no budget (docs/reasoning.md).",
    )
    images: ImageSettings = setting(factory=ImageSettings)  # validation reads them too (BatchService)
    # a worker that leaves a poll (answered within 0.5 s) unanswered this long is presumed lost (node dead or
    # cut off): its ranges go elsewhere
    poll_deadline_s: float = setting(
        30.0,
        check=_over(0.5, "0.5 s (a healthy poll's wait)"),
        flag=Flag(
            "--worker-poll-deadline",
            help="Seconds a worker may leave a poll (answered within 0.5 s when healthy) "
            "unanswered before it counts as lost and its work goes elsewhere; Ray's own RAY_health_check_* settings "
            "decide when Ray marks its node dead.",
        ),
    )

    # a load has its own deadline (the poll deadline applies once a worker's first load finished): a worker
    # still loading answers liveness with its progress, and is failed only when its load outlasts this
    load_deadline_s: float = setting(
        600.0,
        check=_over(0, "0 s"),
        flag=Flag(
            "--model-load-deadline",
            help="Seconds a model load may take, plus --model-load-seconds-per-gb per GB of the checkpoint, "
            "before the load counts as hung (its batch fails, naming this deadline). Until a worker's first "
            "load finishes, this deadline, not --worker-poll-deadline, decides whether it is lost.",
        ),
    )
    load_s_per_gb: float = setting(
        60.0,
        check=_at_least(0, "0"),
        flag=Flag(
            "--model-load-seconds-per-gb",
            help="Seconds each GB of a checkpoint adds to --model-load-deadline (an s3:// model's copy "
            "included): 60 allows ~17 MB/s.",
        ),
    )

    def __post_init__(self) -> None:
        _check_fields(self)

    def load_deadline_for(self, checkpoint_bytes: int | None) -> float:
        """The seconds a load of a checkpoint of `checkpoint_bytes` (None: not known yet) may take."""
        return self.load_deadline_s + self.load_s_per_gb * (checkpoint_bytes or 0) / 1e9

    def reasoning_parser_of(self, model: str) -> str | None:
        """The reasoning parser `--reasoning-parser` sets for `model`; None: what its chat template teaches."""
        parser = self.reasoning_parsers.get(model, self.reasoning_parsers.get(EVERY_MODEL, "auto"))
        return None if parser == "auto" else parser

    def tool_parser_of(self, model: str) -> str | None:
        """The tool-call format `--tool-parser` sets for `model`; None: what its chat template teaches."""
        parser = self.tool_parsers.get(model, self.tool_parsers.get(EVERY_MODEL, "auto"))
        return None if parser == "auto" else parser

    def template_options_of(self, model: str) -> dict:
        """The chat template options `--chat-template-kwargs` sets for `model`."""
        return self.template_options.get(model, self.template_options.get(EVERY_MODEL, {}))

    def thinking_budget_of(self, model: str) -> int | None:
        """The thinking budget `--thinking-token-budget` sets for `model`; None: none."""
        return self.thinking_budgets.get(model, self.thinking_budgets.get(EVERY_MODEL))

    def ranks_of(self, model: str) -> int:
        """Ranks per worker of the workers that run `model` (`--tensor-parallel`)."""
        return self.tensor_parallel.get(model, self.tensor_parallel.get(EVERY_MODEL, 1))

    def engine_config(self, ranks: int = 1) -> EngineConfig:
        """The config of a worker's engine of `ranks` ranks (the pool's classes of workers): engine_kwargs typed,
        built in this one place."""
        return EngineConfig(**self.engine_kwargs, tensor_parallel=ranks)


@dataclass
class Settings:
    """What `serve`, `run`, `watch` and the Ray job run with; fields in the order `--help` lists their flags."""

    storage: str = setting(
        DEFAULT_STORAGE,
        flag=Flag(
            "--storage",
            envvar="BULKGEN_STORAGE",
            help="Where everything lives: a folder, file:///…, or s3://bucket/prefix (env BULKGEN_STORAGE).",
        ),
    )
    endpoint_url: str | None = setting(
        None,
        flag=Flag(  # else AWS_ENDPOINT_URL, read by the S3 store
            "--endpoint-url", envvar="AWS_ENDPOINT_URL", help="S3-compatible endpoint (env AWS_ENDPOINT_URL)."
        ),
    )
    models: dict[str, str] = setting(
        factory=lambda: parse_model_specs([]),
        check=_some_model,
        flag=Flag(
            "--model",
            metavar="NAME=PATH",
            parse=parse_model_specs,
            help="Served model (local folder or s3://…), repeatable; default: the bundled sample model.",
        ),
    )
    loras: dict[str, LoraSpec] = setting(
        factory=dict,
        flag=Flag(
            "--lora",
            metavar="NAME=PATH[@BASE]",
            parse=parse_lora_specs,
            help="Serve a PEFT LoRA adapter (folder or s3://…) as model NAME on served model BASE (default: the "
            "one its adapter_config.json names, else the only one), repeatable; ' tenants=T1,T2' after it serves "
            "it to those tenants alone (docs/lora.md).",
        ),
    )
    lora_file: str | None = setting(
        None,
        flag=Flag(
            "--lora-file",
            envvar="BULKGEN_LORA_FILE",
            metavar="PATH",
            help="More adapters, NAME=PATH[@BASE] [tenants=T1,T2] per line, read again when it changes "
            "(env BULKGEN_LORA_FILE).",
        ),
    )
    workers: WorkerSettings = setting(factory=WorkerSettings)
    range_size: int = setting(
        32,
        check=_positive_int,
        flag=Flag(  # the unit workers pull and parts hold
            "--range-size",
            help="Requests per line range: the unit workers pull and results are checkpointed in.",
        ),
    )
    max_requests_per_batch: int = setting(50_000, check=_positive_int, flag=Flag("--max-requests-per-batch"))
    max_embedding_inputs_per_batch: int = setting(
        50_000,
        check=_positive_int,
        flag=Flag(
            "--max-embedding-inputs-per-batch",
            help="Embedding inputs one batch may hold, summed over its lines' body.input (OpenAI's limit: 50,000).",
        ),
    )
    max_file_bytes: int = setting(
        200 * MIB,
        check=_positive_int,
        flag=Flag(
            "--max-file-mb",
            scale=MIB,
            help="Largest input file accepted, in MiB (uploads are refused while they stream past it).",
        ),
    )
    scheduling: str = setting(
        "fifo",
        check=_one_of(SCHEDULING),
        flag=Flag(  # fifo: by created_at
            "--scheduling",
            choices=SCHEDULING,
            help="Which batch goes first: fifo (oldest) or deadline (earliest expires_at).",
        ),
    )
    fair_share_after_s: float = setting(
        30.0,
        check=_at_least(0, "0"),
        flag=Flag(
            "--fair-share-after",
            help="Seconds a batch may get no work before it is served next (no batch starves).",
        ),
    )
    tenant_weights: dict[str, float] = setting(
        factory=dict,
        check=_check_weights,
        flag=Flag(  # others weigh 1
            "--tenant-weight",
            metavar="TENANT=W",
            parse=parse_tenant_weights,
            help="Give TENANT W times the default share of the workers while tenants compete (repeatable; default 1 "
            "each); a keys file's `TENANT weight=W` line wins over it.",
        ),
    )
    lease_ttl_s: float = setting(
        30.0,
        check=_at_least(1, "1 second"),
        flag=Flag(  # since the last renewal
            "--lease-ttl",
            help="Seconds after which another replica takes over a batch whose runner stopped renewing.",
        ),
    )
    tenant: str = setting(
        DEFAULT_TENANT,
        check=check_tenant,
        flag=Flag(  # also the tenant of a keyless service
            "--tenant",
            envvar="BULKGEN_TENANT",
            help="Whose files and batches these are (env BULKGEN_TENANT); with API keys, each key's tenant.",
        ),
    )
    storage_outage_timeout_s: float = setting(
        300.0,
        check=_over(0, "0 seconds"),
        flag=Flag(
            "--storage-outage-timeout",
            help="Seconds a running batch waits for storage that stopped answering; then "
            "its runner stops, the batch stays active and resumes once storage answers.",
        ),
    )
    # a manager lists the active batches this often at first, twice as long after each listing that found
    # nothing new, up to once a minute (runtime/pacing.py's Backoff)
    scan_every_s: float = setting(
        2.0,
        check=_over(0, "0 seconds"),
        flag=Flag(
            "--scan-interval",
            help="Seconds between a replica's first looks for active batches it does not run yet (another "
            "replica's, or left by one that died); doubled after each look that finds nothing new, up to a "
            "minute. A batch created or cancelled through this replica is seen at once; a shorter interval "
            "finds the others' sooner at more listings (S3 bills each).",
        ),
    )
    # create answers 400 for a batch its window cannot hold (bulkgen.plan); only `serve` creates from a client
    refuse_infeasible: bool = setting(
        False,
        flag=Flag(
            "--refuse-infeasible",
            shared=False,
            help="Validate at create and answer 400 for a batch whose estimated time, alone on the workers, exceeds "
            "its completion window (needs a stored `bulkgen profile`); default: accept and warn in the batch's errors.",
        ),
    )

    def __post_init__(self) -> None:
        _check_fields(self)
        for name in (
            "tensor_parallel",
            "reasoning_parsers",
            "tool_parsers",
            "template_options",
            "thinking_budgets",
        ):
            per_model = getattr(self.workers, name)
            unknown = sorted(set(per_model) - set(self.models) - {EVERY_MODEL})
            if unknown:
                raise SettingError(
                    name,
                    per_model,
                    f"no served model is named {unknown[0]!r} (--model NAME=PATH names them: "
                    f"{', '.join(sorted(self.models))})",
                )

    def rank_counts(self) -> list[int]:
        """The rank counts of the served models' workers, smallest first: one class of workers each."""
        return sorted({self.workers.ranks_of(name) for name in self.models})
