"""Sentence embeddings from a decoder's final hidden states: the pooling rule and the pooled vector.

The rule is the model's, read once from a sentence-transformers folder (`modules.json` naming the
Transformer, a Pooling module, whose `config.json` holds `pooling_mode` or the legacy `pooling_mode_*`
flags, and an optional Normalize module); a folder without one pools the last token and L2-normalises
(Qwen3-Embedding style). Modules are known by their class name within sentence_transformers, so both
spellings of a type work (`sentence_transformers.models.Pooling` up to version 5,
`sentence_transformers.sentence_transformer.modules.pooling.Pooling` from 6). A module bulkgen does not
compute (Dense, Router, a Transformer that renders text through the chat template, ...) refuses
embedding for that model, with the module named: its vectors would otherwise differ from the model's own.

Embedding requests are prefill-only sequences in the ordinary packed steps, so a long input arrives in
chunks. Each chunk contributes a partial pool (`chunk_pools`): the sum of its rows for mean pooling (the
mean is taken at the end over every prompt token, so chunked equals unchunked), its first row for CLS
(first chunk only), its last row for last-token pooling (last chunk only). A chunk that starts at
position 0 replaces the state instead of adding to it, so a preempted sequence recomputed from the start
never counts a chunk twice.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

METHODS = ("last", "mean", "cls")
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_LEGACY_FLAGS = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
# the modules bulkgen computes, in the order sentence-transformers runs them (Normalize is optional)
_MODULES = ("Transformer", "Pooling", "Normalize")
_PIPELINES = (_MODULES[:2], _MODULES)
_TRANSFORMER_CONFIG = "sentence_bert_config.json"
_TEXT_MODALITY = {"method": "forward", "method_output_name": "last_hidden_state"}
log = logging.getLogger(__name__)


class EmbedError(ValueError):
    """An embedding request this model cannot serve; `field` names the request field (as SamplingError)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class PoolingConfig:
    """How this model turns hidden states into one vector.

    `truncate_dim`: the folder's default output size (sentence-transformers' own `truncate_dim` setting).
    `matryoshka`: the model was trained so a prefix of its vector is an embedding (declared by `truncate_dim`
    or by `"matryoshka": true` in config_sentence_transformers.json); only then is `dimensions` honoured."""

    method: str = "last"
    normalize: bool = True
    truncate_dim: int | None = None
    matryoshka: bool = False
    refusal: str = ""  # why this model cannot embed (its folder names a pooling bulkgen does not compute)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"pooling method must be one of {METHODS}, got {self.method!r}")


@dataclass(frozen=True)
class EmbedParams:
    """One embedding request's options. `dimensions`: keep the first N values (matryoshka models only)."""

    dimensions: int | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise EmbedError(f"dimensions must be a positive integer, got {d!r}", "dimensions")


def model_pooling(path: str | Path | None) -> PoolingConfig:
    """The engine's rule for the model at `path`: a folder whose pooling bulkgen cannot compute still serves
    generation, and refuses embedding requests with the reason (also logged once, at load)."""
    try:
        return load_pooling(path)
    except (ValueError, OSError) as exc:
        log.warning("embedding requests will be refused: %s", exc)
        return PoolingConfig(refusal=str(exc))


def load_pooling(path: str | Path | None) -> PoolingConfig:
    """The pooling rule of the model folder at `path` (the default rule when it is no sentence-transformers
    folder). ValueError for a pipeline bulkgen does not compute (a module other than Transformer, Pooling
    and Normalize; max, weighted mean or several pooling modes; a prompt excluded from pooling; text
    rendered through a chat template), so a model is never served with a rule other than its own."""
    root = Path(path or ".")
    modules_file = root / "modules.json"
    if not path or not modules_file.is_file():
        return PoolingConfig()
    folders = _pipeline(root, json.loads(modules_file.read_text()))
    _check_transformer(root, _read_json(root / folders["Transformer"] / _TRANSFORMER_CONFIG))
    method = _st_method(json.loads((root / folders["Pooling"] / "config.json").read_text()), root)
    if "Normalize" in folders:
        _check_normalize(root, _read_json(root / folders["Normalize"] / "config.json"))
    st_config = _read_json(root / "config_sentence_transformers.json")
    _check_prompt(root, st_config)
    truncate = st_config.get("truncate_dim")
    return PoolingConfig(
        method,
        "Normalize" in folders,
        truncate,
        truncate is not None or st_config.get("matryoshka") is True,
    )


def _pipeline(root: Path, modules: list) -> dict[str, str]:
    """{class name: module folder} of a pipeline bulkgen computes; ValueError naming what it does not."""
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{root}/modules.json: not a list of module objects")
    kinds, folders = [], {}
    for module in modules:
        kind = _module_class(root, module.get("type"))
        kinds.append(kind)
        folders[kind] = module.get("path") or ""
    if tuple(kinds) not in _PIPELINES:
        raise ValueError(
            f"{root}/modules.json: modules {kinds} are not a pipeline bulkgen computes "
            "(Transformer, Pooling, then optionally Normalize)"
        )
    if folders["Transformer"] not in ("", "."):
        raise ValueError(f"{root}/modules.json: the Transformer must be the model folder itself")
    return folders


def _module_class(root: Path, type_name: object) -> str:
    """A module type's class name: the same whichever sentence-transformers version spelled the type."""
    package, _, name = type_name.rpartition(".") if isinstance(type_name, str) else ("", "", "")
    if package.split(".")[0] != "sentence_transformers" or name not in _MODULES:
        raise ValueError(
            f"{root}/modules.json: module type {type_name!r} is not supported; bulkgen computes "
            "sentence-transformers' Transformer, Pooling and Normalize modules"
        )
    return name


def _check_transformer(root: Path, config: dict) -> None:
    """The Transformer module must feed the text itself to the model and take its last hidden state;
    sentence-transformers 6 renders text through the chat template instead when `modality_config` names
    "message" (what it writes for a tokenizer with a chat template)."""
    modalities = config.get("modality_config") or {}
    reasons = []
    if "message" in modalities:
        reasons.append("it renders text through the chat template ('message' modality)")
    if modalities.get("text", _TEXT_MODALITY) != _TEXT_MODALITY:
        reasons.append(f"its text modality is {modalities.get('text')}")
    if config.get("transformer_task", "feature-extraction") != "feature-extraction":
        reasons.append(f"its transformer_task is {config['transformer_task']!r}")
    if config.get("do_lower_case") is True:
        reasons.append("it lowercases the text (do_lower_case)")
    if reasons:
        raise ValueError(
            f"{root}/{_TRANSFORMER_CONFIG}: the Transformer module is not supported: {'; '.join(reasons)}"
        )


def _check_normalize(root: Path, config: dict) -> None:
    if config.get("module_input_name", "sentence_embedding") != "sentence_embedding":
        raise ValueError(f"{root}: a Normalize module of {config['module_input_name']!r} is not supported")


def _check_prompt(root: Path, st_config: dict) -> None:
    """A default prompt is text sentence-transformers adds to every input; bulkgen embeds the input as sent."""
    name = st_config.get("default_prompt_name")
    if name is not None and (st_config.get("prompts") or {}).get(name):
        raise ValueError(
            f"{root}: its default prompt {name!r} would be added to every input; bulkgen embeds inputs as sent"
        )


def _st_method(config: dict, root: Path) -> str:
    mode = config.get("pooling_mode")
    if mode is None:  # sentence-transformers < 5 wrote one boolean per mode (none set means mean)
        modes = [m for k, m in _LEGACY_FLAGS.items() if config.get(k)]
        others = [
            k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _LEGACY_FLAGS
        ]
        mode = modes[0] if len(modes) == 1 and not others else None if modes or others else "mean"
    else:
        mode = _ST_MODES.get(mode) if isinstance(mode, str) else None
    if mode is None or config.get("include_prompt", True) is not True:
        raise ValueError(
            f"{root}: sentence-transformers pooling {config} is not supported; bulkgen pools "
            f"one of {sorted(_ST_MODES)} over the whole input"
        )
    return mode


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def check_embed(config: PoolingConfig, params: EmbedParams, hidden_size: int) -> None:
    """Can this model embed, and with these `dimensions` (a matryoshka model only, at most its vector's size)?"""
    if config.refusal:
        raise EmbedError(f"this model cannot embed: {config.refusal}", "model")
    if params.dimensions is None:
        return
    if not config.matryoshka:
        raise EmbedError(
            "dimensions is not supported by this model: it was not trained for truncated "
            "(matryoshka) embeddings",
            "dimensions",
        )
    if params.dimensions > hidden_size:
        raise EmbedError(
            f"dimensions must be at most {hidden_size} for this model, got {params.dimensions}", "dimensions"
        )


def chunk_pools(
    hidden: torch.Tensor, spans: list[tuple[int, int, int, bool]], method: str
) -> list[torch.Tensor]:
    """Each chunk's partial pool (float32 [hidden]) from the step's packed hidden states [tokens, hidden].

    `spans`: (query offset, tokens, start position, reaches the end) per pooled chunk; a chunk that
    contributes nothing (a middle chunk under last-token pooling) gets an empty tensor."""
    if method == "mean":
        segments = torch.cat([torch.full((n,), i, dtype=torch.long) for i, (_, n, _, _) in enumerate(spans)])
        rows = torch.cat([torch.arange(q, q + n) for q, n, _, _ in spans]).to(hidden.device)
        sums = torch.zeros(len(spans), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, segments.to(hidden.device), hidden[rows].float())
        return list(sums)
    if method == "last":
        wanted = [(i, q + n - 1) for i, (q, n, _, end) in enumerate(spans) if end]
    else:
        wanted = [(i, q) for i, (q, _, start, _) in enumerate(spans) if start == 0]
    out = [hidden.new_empty(0, dtype=torch.float32)] * len(spans)
    if wanted:
        picked = hidden[torch.tensor([r for _, r in wanted], device=hidden.device)].float()
        for (i, _), vector in zip(wanted, picked, strict=True):
            out[i] = vector
    return out


def add_chunks(
    seqs: list, hidden: torch.Tensor, spans: list[tuple[int, int, int, bool]], method: str
) -> None:
    """Fold one step's chunks into their sequences' `pool_state` (called once the step succeeded)."""
    for seq, part, (_, _, start, _) in zip(seqs, chunk_pools(hidden, spans, method), spans, strict=True):
        seq.pool_state = accumulate(seq.pool_state, part, start)


def accumulate(state: torch.Tensor | None, part: torch.Tensor, start: int) -> torch.Tensor | None:
    """The sequence's pool after one more chunk (see the module docstring on replacing at position 0)."""
    if start == 0:
        return part if part.numel() else None
    if not part.numel():
        return state
    return part if state is None else state + part


def finish(state: torch.Tensor, num_tokens: int, config: PoolingConfig, params: EmbedParams) -> list[float]:
    """The request's vector: the mean divided out, truncated to `dimensions` (or the folder's truncate_dim),
    then L2-normalised when the model normalises (re-normalised after truncation, as the API's are)."""
    vector = state / num_tokens if config.method == "mean" else state
    size = params.dimensions or config.truncate_dim
    if size is not None:
        vector = vector[:size]
    if config.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.cpu().tolist()
