"""What each attention layer of a model reads and how it scores, learned by running the model once.

The engine does not read a model's attention from its config: configs name the same thing differently,
and some carry fields the model ignores (a GPT-NeoX config may hold a `num_key_value_heads` its layers
never use, and a cache shaped by it mixes up heads). `probe_layers` runs a two-token forward through a
recording attention implementation and keeps what each layer hands transformers' attention interface:
its K and V shapes (an MLA layer: one latent head, mla.py) and the `sliding_window`, `softcap` and
`s_aux` (attention sinks) keywords transformers passes for Mistral, Gemma 2/3, gpt-oss and the rest.
Chunked attention (Llama 4) passes no keyword: it comes from the config's `layer_types`
("chunked_attention") and `attention_chunk_size`, which is where transformers' own mask takes it from.

Kernels take these as parameters (`LayerAttention`), never model names; what a model needs that no
kernel here can do is refused at load with one line naming it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from bulkgen.engine.attention.interface import ATTN_IMPLEMENTATION
from bulkgen.engine.model import upstream

log = logging.getLogger(__name__)

PROBE_IMPLEMENTATION = "bulkgen_probe"
# Every keyword transformers hands an attention implementation in the architectures bulkgen runs, and
# what bulkgen does with it. A keyword outside this table that arrives with a value is said at load
# (a release may have moved a layer's window, sinks or soft-cap to a new name), and
# tests/engine/test_upstream_interfaces.py fails on one that a modeling file of the matrix passes.
ATTENTION_KWARGS = {
    "attention_mask": "ignored: each sequence attends to its own tokens by the step plan, never a mask",
    "scaling": "the softmax scale (query width ** -0.5 where absent)",
    "dropout": "ignored: 0 at inference",
    "sliding_window": "the layer's window, learned at load (AttnKind.window)",
    "softcap": "the layer's logit soft-cap, learned at load (Gemma 2)",
    "s_aux": "the layer's attention sinks, passed to the kernel (gpt-oss)",
    "is_causal": "ignored: decoder layers are causal; vision towers run outside bulkgen's attention",
    "position_ids": "ignored: positions reach attention through the rotary embedding",
    "use_cache": "ignored: the paged cache is bulkgen's",
    "output_router_logits": "ignored: a mixture-of-experts flag passed down with the layer's kwargs",
    "bulkgen_ctx": "the step's context (attention.StepContext)",
    # the flash-attention varlen metadata of vision towers (Qwen3.5's); the text layers get bulkgen's own
    "cu_seq_lens_q": "ignored: packing is the step plan's",
    "cu_seq_lens_k": "ignored: packing is the step plan's",
    "max_length_q": "ignored: packing is the step plan's",
    "max_length_k": "ignored: packing is the step plan's",
}
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class AttnKind:
    """Which earlier tokens a query reads: all (full), the last `window` including itself (sliding
    window), or those of its own `chunk`-aligned chunk (chunked attention). It decides which KV blocks
    a sequence must keep, so layers of one kind share block tables (kv_layout)."""

    window: int | None = None
    chunk: int | None = None

    @property
    def is_full(self) -> bool:
        return self.window is None and self.chunk is None

    def first_visible(self, pos: int) -> int:
        """The first position a query at `pos` reads."""
        if self.window is not None:
            return max(0, pos - self.window + 1)
        if self.chunk is not None:
            return pos - pos % self.chunk
        return 0

    def first_visible_t(self, pos: torch.Tensor) -> torch.Tensor:
        """`first_visible` of each position in a tensor (on its device, no sync)."""
        if self.window is not None:
            return (pos - (self.window - 1)).clamp(min=0)
        if self.chunk is not None:
            return pos - pos % self.chunk
        return torch.zeros_like(pos)

    def __str__(self) -> str:
        if self.window is not None:
            return f"sliding window {self.window}"
        return f"chunked {self.chunk}" if self.chunk is not None else "full"


FULL = AttnKind()


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention as its kernels need it."""

    kind: AttnKind
    kv_heads: int
    k_dim: int  # K head size (and Q's)
    v_dim: int  # V head size: may be smaller than k_dim (MLA's latent: 512 of 576 in DeepSeek-V3)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2)
    sinks: bool = False  # a learned per-head logit in every softmax's denominator (gpt-oss `s_aux`)
    # queries scaled by log(position) (Llama 4's NoPE layers): (floor_scale, attn_scale)
    temperature: tuple[float, float] | None = None
    q_heads: int = 0
    # MLA's latent cache (mla.py): V is K's first v_dim columns (c_kv of [c_kv, k_pe]), stored once
    latent: bool = False

    @property
    def kv_shape(self) -> tuple[int, int, int, bool]:
        return self.kv_heads, self.k_dim, self.v_dim, self.latent


def probe_layers(model: torch.nn.Module, recurrent: set[int] = frozenset()) -> list[LayerAttention | None]:
    """Every layer's attention, in layer order (None for a layer of `recurrent`, a hybrid model's
    recurrent layers, that has none); ValueError naming what bulkgen cannot run."""
    check_attention_routing(model)
    config = model.config
    layer_types = getattr(config, "layer_types", None) or []
    seen: dict[int, LayerAttention] = {}
    unknown: set[str] = set()  # keywords with a value that ATTENTION_KWARGS does not know
    mark = object()  # passed as the step context is: a layer that drops forward kwargs never sees it

    def record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int):
            raise ValueError(f"{type(module).__name__} has no layer_idx; bulkgen cannot give it a KV cache")
        if kwargs.get("bulkgen_ctx") is not mark:
            raise ValueError(
                f"{type(model).__name__} drops forward kwargs before its attention (layer {idx}); bulkgen "
                "cannot pass it the step's cache"
            )
        unknown.update(k for k, v in kwargs.items() if k not in ATTENTION_KWARGS and v is not None)
        chunked = idx < len(layer_types) and layer_types[idx] == "chunked_attention"
        window = kwargs.get("sliding_window") or None
        kind = AttnKind(window=window, chunk=config.attention_chunk_size if chunked else None)
        seen[idx] = LayerAttention(
            kind,
            kv_heads=key.shape[1],
            k_dim=key.shape[-1],
            v_dim=value.shape[-1],
            softcap=kwargs.get("softcap"),
            sinks=kwargs.get("s_aux") is not None,
            temperature=_temperature(module),
            q_heads=query.shape[1],
            latent=getattr(module, "bulkgen_latent", False),
        )
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    AttentionInterface.register(PROBE_IMPLEMENTATION, record)
    previous = config._attn_implementation
    config._attn_implementation = PROBE_IMPLEMENTATION
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            ids = torch.zeros(1, 2, dtype=torch.long, device=device)
            positions = torch.arange(2, device=device)[None]
            model(input_ids=ids, position_ids=positions, use_cache=False, bulkgen_ctx=mark)
    finally:
        config._attn_implementation = previous
    if unknown:
        log.warning(
            "%s passes %s to its attention, which bulkgen does not read; if its tokens differ from "
            "transformers', this is why: %s",
            type(model).__name__,
            ", ".join(sorted(unknown)),
            upstream.describe("transformers"),
        )
    return _in_layer_order(model, seen, recurrent)


def _in_layer_order(
    model, seen: dict[int, LayerAttention], recurrent: set[int]
) -> list[LayerAttention | None]:
    count = getattr(model.config, "num_hidden_layers", None) or (max(seen) + 1 if seen else 0)
    missing = [i for i in range(count) if i not in seen and i not in recurrent]
    if not seen or missing:
        raise ValueError(
            f"{type(model).__name__}: layers {missing or 'all'} never reached transformers' attention "
            "interface; bulkgen cannot run them"
        )
    return [seen.get(i) for i in range(count)]


def _temperature(module: torch.nn.Module) -> tuple[float, float] | None:
    """Llama 4's NoPE layers scale queries by log(position), counting positions along the row they get:
    in a packed row that is not the token's position, so the attention function rescales them."""
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        return float(module.floor_scale), float(module.attn_scale)
    return None


# model classes whose attention goes through `AttentionInterface` only from a transformers release on
# (earlier ones compute it inline): refused before it, naming the release
ROUTED_FROM = {"GPTJForCausalLM": "5.24", "CodeGenForCausalLM": "5.24"}


def check_attention_routing(model: torch.nn.Module) -> None:
    """Refuse models whose attention cannot be routed to bulkgen; leave the model's setting as it was."""
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        routed = model.config._attn_implementation == ATTN_IMPLEMENTATION
    finally:
        model.config._attn_implementation = previous
    if not routed:
        since = ROUTED_FROM.get(type(model).__name__)
        release = f" before transformers {since} ({upstream.describe('transformers')})" if since else ""
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface"
            f"{release}; bulkgen cannot run it"
        )


def describe(layers: list[LayerAttention | None]) -> str:
    """One line for logs: each distinct layer kind and how many layers have it."""
    counts: dict[str, int] = {}
    for layer in layers:
        if layer is None:
            counts["recurrent"] = counts.get("recurrent", 0) + 1
            continue
        extras = [f"softcap {layer.softcap:g}"] if layer.softcap else []
        extras += ["sinks"] if layer.sinks else []
        if layer.latent:
            extras.append(f"MLA latent {layer.k_dim} ({layer.v_dim} + rope)")
        elif layer.k_dim != layer.v_dim:
            extras.append(f"K/V heads {layer.k_dim}/{layer.v_dim}")
        key = ", ".join([str(layer.kind), *extras])
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"{n} x {key}" for key, n in counts.items())
