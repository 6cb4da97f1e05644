"""`bulkgen profile` (measure this model on this hardware) and `bulkgen plan` (a file's work and time,
before any worker starts). Thin: the logic lives in bulkgen.plan."""

from __future__ import annotations

import json
from pathlib import Path

import click

from bulkgen.cli.settings_options import setting_option
from bulkgen.models.registry import parse_model_specs
from bulkgen.plan.memory import describe_memory, has_weights, plan_memory
from bulkgen.settings import DEFAULT_STORAGE

_STORE_OPTIONS = [
    click.option(
        "--storage",
        envvar="BULKGEN_STORAGE",
        default=DEFAULT_STORAGE,
        show_default=True,
        help="The service's storage: profiles live under profiles/<model>/<device>.json, and earlier "
        "batches there give the length model (env BULKGEN_STORAGE).",
    ),
    click.option(
        "--endpoint-url", envvar="AWS_ENDPOINT_URL", help="S3-compatible endpoint (env AWS_ENDPOINT_URL)."
    ),
    click.option(
        "--model",
        "model_spec",
        metavar="NAME=PATH",
        help="The model (local folder); default: the bundled sample model.",
    ),
]


def _store_options(fn):
    for option in reversed(_STORE_OPTIONS):
        fn = option(fn)
    return fn


def _memory(path: str, ranks: int | None) -> dict | None:
    if ranks is None:
        return None
    try:
        return plan_memory(path, ranks)
    except ValueError as exc:
        raise click.UsageError(f"--tensor-parallel {ranks}: {exc}") from None


def _model(spec: str | None) -> tuple[str, str]:
    from bulkgen.models.registry import resolve_model_path

    try:
        ((name, path),) = parse_model_specs([spec] if spec else []).items()
        return name, resolve_model_path(path)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None


def _adapters(specs: tuple[str, ...], name: str, path: str, endpoint_url: str | None) -> list[str]:
    """The adapters' names, each checked as `serve` checks it (its config, its base: this model)."""
    from bulkgen.models.loras import AdapterCatalog, AdapterError, parse_lora_specs

    try:
        return list(
            AdapterCatalog(parse_lora_specs(specs), {name: path}, endpoint_url=endpoint_url).adapters()
        )
    except AdapterError as exc:
        raise click.UsageError(str(exc)) from None


@click.command("profile")
@_store_options
@setting_option("kv_cache_dtype")
@click.option("--json", "as_json", is_flag=True, help="Print the stored profile.")
def profile_cmd(
    storage: str, endpoint_url: str | None, model_spec: str | None, kv_cache_dtype: str | None, as_json: bool
) -> None:
    """Measure prefill and decode speed of the model on this machine (a small grid in a fresh process,
    ~10-40 s on CPU) and the start-up of a fresh `bulkgen run` (~10-30 s), and store them for `bulkgen
    plan` and the service's estimate at batch create."""
    from bulkgen.cli.server_cmds import check_storage
    from bulkgen.plan import profile as profiles

    store = check_storage(storage, endpoint_url, create=True)
    name, path = _model(model_spec)
    measured = profiles.measure(name, path, {"kv_cache_dtype": kv_cache_dtype or "auto"})
    key = profiles.save(store, measured)
    if as_json:
        click.echo(measured.to_json().decode())
        return
    click.echo(
        f"{name} on {measured.device}: step = {measured.base_s * 1000:.2f} ms + {measured.per_seq_s * 1000:.3f} "
        f"ms/sequence + {measured.per_prefill_token_s * 1e6:.1f} us/prefill token + "
        f"{measured.per_context_token_s * 1e9:.1f} ns/context token + {measured.per_new_seq_s * 1000:.3f} "
        f"ms/admitted sequence (spread ±{measured.spread:.0%}); "
        f"model load {measured.model_load_s:.1f} s; start-up of `bulkgen run` {measured.startup_s:.1f} s"
    )
    for p in measured.points:
        click.echo(
            f"  batch {p['batch']:>3}, context {p['context']:>4}: decode step {p['decode_step_s'] * 1000:7.2f} ms, "
            f"prefill {p['prefill_tokens_per_s']:9.0f} tokens/s"
        )
    if measured.encoder_call_s is not None:
        click.echo(
            f"  vision encoder: {measured.encoder_call_s * 1000:.2f} ms/call + {measured.per_image_s * 1000:.2f} "
            f"ms/image + {measured.per_image_token_s * 1e6:.1f} us/image token"
        )
    click.echo(f"stored as {key} under {storage}")


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_store_options
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help="Engine workers.")
@click.option(
    "--gpu",
    "device",
    metavar="cpu|h200|…",
    help="Estimate for this device's stored profile; default: this machine's (profiled now if none).",
)
@click.option("--max-requests-per-batch", type=int, default=50_000, show_default=True)
@click.option(
    "--lora",
    "loras",
    multiple=True,
    metavar="NAME=PATH[@BASE]",
    help="A LoRA adapter of the model that lines may name, as `serve --lora` takes it (repeatable).",
)
@setting_option("kv_cache_dtype")
@click.option(
    "--tensor-parallel",
    type=click.IntRange(min=1),
    help="Also print each rank's memory (bf16 weights, KV cache per token) with the model split over N "
    "GPUs, from its config; a model folder with a config and tokenizer but no weights gets the memory alone.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@setting_option("image_url_hosts")
def plan(
    file: Path,
    storage: str,
    endpoint_url: str | None,
    model_spec: str | None,
    workers: int,
    device: str | None,
    max_requests_per_batch: int,
    loras: tuple[str, ...],
    kv_cache_dtype: str | None,
    tensor_parallel: int | None,
    as_json: bool,
    image_url_hosts: tuple[str, ...],
) -> None:
    """Validate FILE as a batch would, count its tokens with the model's tokenizer (and a vision model's
    images with its processor), and estimate its time."""
    from transformers import AutoTokenizer

    from bulkgen.batch.records import BatchRepo
    from bulkgen.cli.client import ClientError, detect_endpoint
    from bulkgen.cli.server_cmds import check_storage
    from bulkgen.plan import lengths, planner

    name, path = _model(model_spec)
    memory = _memory(path, tensor_parallel)
    if memory is not None and not has_weights(path):  # a model not fetched yet: its memory alone
        return click.echo(
            json.dumps({"model": name, "memory": memory}) if as_json else describe_memory(memory)
        )
    store = check_storage(storage, endpoint_url, create=True)
    adapters = _adapters(loras, name, path, endpoint_url)
    images = _image_reader(path, store, image_url_hosts)
    # a vision model's prompts are rendered by its processor's tokenizer, as the engine renders them
    tokenizer = (
        images.processor.tokenizer
        if images.processor is not None
        else AutoTokenizer.from_pretrained(path, local_files_only=True)
    )
    batches = BatchRepo(store)
    try:
        result = planner.plan_file(
            file,
            detect_endpoint(file),
            name,
            path,
            tokenizer,
            lengths.from_history(batches, name),
            workers,
            max_requests_per_batch,
            device,
            store,
            batches=batches,
            adapters=adapters,
            kv_cache_dtype=kv_cache_dtype or "auto",
            images=images,
        )
    except (ClientError, planner.NoProfile) as exc:
        raise click.ClickException(str(exc)) from None
    _report(result, storage, memory, as_json)


def _report(result: dict, storage: str, memory: dict | None, as_json: bool) -> None:
    """Print a plan (and the per-rank memory asked for); exit 1 for a file a batch would refuse."""
    from bulkgen.plan import planner

    if result["valid"]:
        result["profile"]["stored_at"] = f"{storage.rstrip('/')}/{result['profile']['stored_at']}"
    if memory is not None:
        result["memory"] = memory
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(planner.describe(result) + ("\n" + describe_memory(memory) if memory else ""))
    if not result["valid"]:
        raise SystemExit(1)


def _image_reader(path: str, store, hosts: tuple[str, ...]):
    """How the plan reads images as the service's workers would: a vision model's processor (None for a text
    model), file ids and s3:// URLs in `--storage`, http(s) on `--image-url-hosts`."""
    from bulkgen.engine.features.multimodal import is_vision_model, load_processor
    from bulkgen.plan.filework import ImageReader
    from bulkgen.settings import ImageSettings, parse_hosts

    processor = load_processor(path) if is_vision_model(path) else None
    try:
        policy = ImageSettings(image_url_hosts=parse_hosts(hosts))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return ImageReader(processor, store, policy)
