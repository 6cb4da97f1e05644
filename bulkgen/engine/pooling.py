"""Sentence embeddings from a decoder's final hidden states: the pooling rule and the pooled vector.

The rule is the model's, read once from a sentence-transformers folder (`modules.json` naming a Pooling
module, whose `config.json` holds `pooling_mode` or the legacy `pooling_mode_*` flags, and an optional
Normalize module); a folder without one pools the last token and L2-normalises (Qwen3-Embedding style).

Embedding requests are prefill-only sequences in the ordinary packed steps, so a long input arrives in
chunks. Each chunk contributes a partial pool (`chunk_pools`): the sum of its rows for mean pooling (the
mean is taken at the end over every prompt token, so chunked equals unchunked), its first row for CLS
(first chunk only), its last row for last-token pooling (last chunk only). A chunk that starts at
position 0 replaces the state instead of adding to it, so a preempted sequence recomputed from the start
never counts a chunk twice.
"""

from __future__ import annotations

import json
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
_POOLING_TYPE = "sentence_transformers.models.Pooling"
_NORMALIZE_TYPE = "sentence_transformers.models.Normalize"


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
    generation, and refuses embedding requests with the reason."""
    try:
        return load_pooling(path)
    except (ValueError, OSError) as exc:
        return PoolingConfig(refusal=str(exc))


def load_pooling(path: str | Path | None) -> PoolingConfig:
    """The pooling rule of the model folder at `path` (the default rule when it is no sentence-transformers
    folder). ValueError for a pooling bulkgen does not compute (max, weighted mean, several modes, a prompt
    excluded from pooling), so a model is never served with a rule other than its own."""
    root = Path(path or ".")
    modules_file = root / "modules.json"
    if not path or not modules_file.is_file():
        return PoolingConfig()
    modules = json.loads(modules_file.read_text())
    types = {m.get("type"): m.get("path", "") for m in modules}
    method = "last"
    if _POOLING_TYPE in types:
        method = _st_method(json.loads((root / types[_POOLING_TYPE] / "config.json").read_text()), root)
    st_config = _read_json(root / "config_sentence_transformers.json")
    truncate = st_config.get("truncate_dim")
    return PoolingConfig(
        method,
        _NORMALIZE_TYPE in types,
        truncate,
        truncate is not None or st_config.get("matryoshka") is True,
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
