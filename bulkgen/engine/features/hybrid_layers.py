"""Hybrid models' recurrent layers (Gated DeltaNet, Mamba-2, short conv) run on the packed row with
transformers' own math, each sequence starting from its state slot (state_slots.py).

transformers gives every such layer one cache API (`get_conv_state`, `update_conv_state`,
`get_recurrent_state`, `update_recurrent_state`, `has_previous_state`, `is_recording_past`): a
multi-token input continues from the cached state (the conv state is prepended, the chunked rule
starts from the recurrent state) and a one-token input takes the recurrent update. So bulkgen wraps
each mixer module: on a packed step it splits the row by sequence, calls the original forward once per
prefill chunk with a cache view over that sequence's slot (written in place), and once for all decode
rows together with a view over their slots gathered by index (a device tensor: a decode graph replays
it with no host work) and scattered back. The mixer therefore uses whatever kernels its transformers
implementation picks (flash-linear-attention, causal-conv1d, mamba-ssm when installed; torch on CPU).
Outside the engine's forward calls the wrapper passes straight through, so `model.generate` still works.

The runner takes its state slots from `state_slots` once, when it is built (the no-op step feature for a
transformer), after `check_supported` refused layers that are neither attention nor a checked mixer.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from bulkgen.engine.attention.layer_attention import ATTENTION_LAYER_TYPES
from bulkgen.engine.features.state_slots import LayerStates, StatePool, StateShape, StateStep
from bulkgen.engine.model import upstream
from bulkgen.engine.step_features import NO_FEATURE, NO_SCOPE, StepFeature

MIXER_NAMES = ("linear_attn", "mamba", "conv")  # decoder-layer attributes holding a recurrent mixer
# the mixers checked token for token against transformers (tests/engine/test_hybrid_models.py); another
# (Bamba, LFM2-MoE, ...) may well work the same way, but is refused until it is checked
CHECKED_MIXERS = frozenset(
    {
        "Qwen3NextGatedDeltaNet",
        "Qwen3_5GatedDeltaNet",
        "Qwen3_5MoeGatedDeltaNet",
        "GraniteMoeHybridMambaLayer",
        "FalconH1Mixer",
        "Lfm2ShortConv",
    }
)
CACHE_ARGS = ("cache", "cache_params", "past_key_values")  # the mixer's cache argument, by release


def state_scope(pool: StatePool | None, step: StateStep | None):
    """The pool `holding` a decode graph's `step` for one forward (StatePool.holding); nothing for a model
    without state slots."""
    return NO_SCOPE if pool is None else pool.holding(step)


def find_mixers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer index -> the recurrent mixer module of each hybrid layer (none for a pure transformer)."""
    layers = getattr(model.get_decoder(), "layers", None) or []
    found = {}
    for idx, layer in enumerate(layers):
        for name in MIXER_NAMES:
            module = getattr(layer, name, None)
            if isinstance(module, torch.nn.Module) and _cache_arg(module) is not None:
                found[idx] = module
    return found


def attention_layers(model: torch.nn.Module) -> set[int]:
    """Indices of the decoder layers that hold an attention module (they need KV blocks)."""
    layers = getattr(model.get_decoder(), "layers", None) or []
    return {i for i, layer in enumerate(layers) if getattr(layer, "self_attn", None) is not None}


def _cache_arg(module: torch.nn.Module) -> str | None:
    forward = getattr(module, "_bulkgen_original_forward", module.forward)  # seen through wrap_mixers
    params = inspect.signature(forward).parameters
    return next((name for name in CACHE_ARGS if name in params), None)


class _Probe:
    """A cache that records the states a mixer stores for a one-token prompt: their per-sequence shapes."""

    record_past = False  # transformers 5.17 reads `cache.layers[i]`'s, as of a state view (_SlotView)

    def __init__(self) -> None:
        self.conv: dict[int, StateShape] = {}
        self.recurrent: dict[int, StateShape] = {}
        self.conv_states: dict[int, torch.Tensor] = {}  # no state before the probe's one token
        self.recurrent_states: dict[int, torch.Tensor] = {}

    @property
    def layers(self) -> _EveryLayer:
        return _EveryLayer(self)

    def get_conv_state(self, layer_idx, state_idx=0):
        return None

    get_recurrent_state = get_conv_state

    def update_conv_state(self, conv_states, layer_idx=None, state_idx=0, conv_kernel_size=None, **kwargs):
        if conv_kernel_size is None:
            raise ValueError(
                "a hybrid layer stored a conv state without its kernel size; bulkgen cannot size it"
            )
        shape = (*conv_states.shape[1:-1], conv_kernel_size)
        self.conv[state_idx] = StateShape(shape, conv_states.dtype)
        return F.pad(conv_states, (max(0, conv_kernel_size - conv_states.shape[-1]), 0))

    def update_recurrent_state(self, recurrent_states, layer_idx=None, state_idx=0, **kwargs):
        self.recurrent[state_idx] = StateShape(tuple(recurrent_states.shape[1:]), recurrent_states.dtype)
        return recurrent_states

    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        return False

    def is_recording_past(self, layer_idx) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx=None) -> int:
        return 0  # no past recorded: the engine never rolls a state back (transformers 5.25+ asks)

    def increase_count(self, layer_idx, state_idx=0) -> None:
        """transformers 5.25+ counts a decode token it writes into the conv state in place; bulkgen
        keeps positions itself."""

    def __getattr__(self, name: str):
        raise _lacks(type(self).__name__, name)


def _lacks(view: str, name: str) -> AttributeError:
    """The AttributeError a state view raises for a cache member it does not imitate, naming the release."""
    return AttributeError(
        f"bulkgen's {view} (in place of transformers' cache for a hybrid layer) has no {name!r}: "
        f"{upstream.describe('transformers')}"
    )


@torch.inference_mode()
def probe_states(mixers: dict[int, torch.nn.Module], hidden_size: int) -> dict[int, LayerStates]:
    """Each mixer's per-sequence states, found by running it once on one token: the shapes and dtypes
    are whatever its transformers implementation (and the kernels it picked) stores."""
    out = {}
    for idx, module in mixers.items():
        param = next(module.parameters())
        probe = _Probe()
        module(
            torch.zeros(1, 1, hidden_size, dtype=param.dtype, device=param.device),
            **{_cache_arg(module): probe},
        )
        conv = tuple(probe.conv[i] for i in sorted(probe.conv))
        out[idx] = LayerStates(conv, tuple(probe.recurrent[i] for i in sorted(probe.recurrent)))
        _check_views(module, out[idx], hidden_size)
    return out


def _check_views(module: torch.nn.Module, states: LayerStates, hidden_size: int) -> None:
    """Run the mixer through the three calls the engine makes (a first chunk, a continued chunk, a
    decode) on throwaway slots, so a release that asks the state views for something they lack is
    refused at load, naming it, instead of failing a batch's first step."""
    param = next(module.parameters())
    conv = [torch.zeros(1, *s.shape, dtype=s.dtype, device=param.device) for s in states.conv]
    recurrent = [torch.zeros(1, *s.shape, dtype=s.dtype, device=param.device) for s in states.recurrent]
    arg = _cache_arg(module)
    forward = getattr(module, "_bulkgen_original_forward", module.forward)
    try:
        for tokens, has_state in ((2, False), (2, True), (1, True)):
            x = torch.zeros(1, tokens, hidden_size, dtype=param.dtype, device=param.device)
            forward(x, **{arg: _SlotView(conv, recurrent, has_state)})
    except AttributeError as exc:
        raise upstream.mismatch(
            f"{type(module).__name__} cannot run on bulkgen's state slots ({exc})"
        ) from exc


class _SlotView:
    """The cache API over state tensors: rows of the slot tensors (one prefill chunk, written in place)
    or copies gathered for the step's decodes (scattered back by the wrapper).

    Earlier transformers 5 releases (5.17) read the states as `cache.layers[i].conv_states[0]`,
    `.recurrent_states[0]` and `.record_past` after `has_previous_state(i)`: the view answers those too."""

    record_past = False

    def __init__(self, conv: list[torch.Tensor], recurrent: list[torch.Tensor], has_state: bool) -> None:
        self.conv, self.recurrent, self.has_state = conv, recurrent, has_state
        self.conv_states, self.recurrent_states = conv, recurrent

    @property
    def layers(self) -> _EveryLayer:
        return _EveryLayer(self)

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.conv[state_idx] if self.has_state else None

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.recurrent[state_idx] if self.has_state else None

    def update_conv_state(self, conv_states, layer_idx=None, state_idx=0, **kwargs):
        """As transformers' LinearAttentionLayer: returns the previous state followed by the new inputs
        (zero-padded to the kernel on a first chunk shorter than it) and keeps the last kernel-size."""
        state = self.conv[state_idx]
        if self.has_state:
            full = torch.cat([state.to(conv_states.dtype), conv_states], dim=-1)
        else:
            full = F.pad(conv_states, (max(0, state.shape[-1] - conv_states.shape[-1]), 0))
        state.copy_(full[..., -state.shape[-1] :])
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx=None, state_idx=0, **kwargs):
        state = self.recurrent[state_idx]
        state.copy_(recurrent_states)
        return state

    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        return self.has_state

    def is_recording_past(self, layer_idx) -> bool:
        return False

    get_recurrent_states_to_keep = _Probe.get_recurrent_states_to_keep
    increase_count = _Probe.increase_count

    def __getattr__(self, name: str):
        raise _lacks(type(self).__name__, name)


class _EveryLayer:
    """`cache.layers[i]` of a view: the view itself, whichever layer asks (a view serves one mixer)."""

    def __init__(self, view: _SlotView) -> None:
        self.view = view

    def __getitem__(self, layer_idx: int) -> _SlotView:
        return self.view


def wrap_mixers(mixers: dict[int, torch.nn.Module], pool: StatePool) -> None:
    """Route each mixer's forward through `_packed_forward` (once: a second engine on the same model
    rewraps the original forward, so the newest pool is the one used)."""
    for idx, module in mixers.items():
        original = getattr(module, "_bulkgen_original_forward", module.forward)
        module._bulkgen_original_forward = original
        module.forward = functools.partial(_packed_forward, original, _cache_arg(module), pool, idx)


def _packed_forward(original, cache_arg: str, pool: StatePool, layer: int, hidden_states, *args, **kwargs):
    """hidden_states [1, T, H] of a packed step -> the mixer's output [1, T, H], sequence by sequence."""
    step: StateStep | None = pool.step
    if step is None:  # a call outside the engine (generate, a user's forward): the mixer as it was
        return original(hidden_states, *args, **kwargs)
    conv, recurrent = pool.conv[layer], pool.recurrent[layer]
    outs = []
    for start, n, slot, has_state in step.prefill:
        view = _SlotView(
            [c[slot : slot + 1] for c in conv], [r[slot : slot + 1] for r in recurrent], has_state
        )
        outs.append(original(hidden_states[:, start : start + n], **{cache_arg: view}))
    if step.decode_slots is not None:
        idx = step.decode_slots
        view = _SlotView(
            [c.index_select(0, idx) for c in conv], [r.index_select(0, idx) for r in recurrent], True
        )
        rows = hidden_states[0, step.decode_start :, None]  # [decodes, 1, H]: one sequence per batch row
        outs.append(original(rows, **{cache_arg: view}).transpose(0, 1))
        for pooled, gathered in zip(conv + recurrent, view.conv + view.recurrent, strict=True):
            pooled.index_copy_(0, idx, gathered)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def check_supported(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The model's recurrent mixers (hybrid_layers.find_mixers; empty for a transformer); refuse models
    with layers that are neither attention nor a mixer bulkgen has checked: they would mix the sequences
    of a packed row."""
    layer_types = getattr(model.config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    mixers = find_mixers(model)
    unchecked = sorted({type(m).__name__ for m in mixers.values()} - CHECKED_MIXERS)
    if unchecked:
        raise ValueError(
            f"{type(model).__name__} has recurrent layers {unchecked} that bulkgen has not checked against "
            f"transformers; it runs {sorted(CHECKED_MIXERS)}"
        )
    if other and not set(mixers) | attention_layers(model) >= set(range(len(layer_types))):
        raise ValueError(
            f"{type(model).__name__} has non-attention layers {other}; bulkgen packs attention only"
        )
    return mixers


def state_slots(
    model: torch.nn.Module, mixers: dict, num_slots: int, device: torch.device, group
) -> StepFeature:
    """A hybrid model's step feature: one state slot per running sequence, the `mixers` wrapped to read and
    write them, the rank `group` told of the pool (its plan carries each sequence's slot). A transformer
    without mixers gets the no-op feature."""
    if not mixers:
        return NO_FEATURE
    pool = StatePool(probe_states(mixers, model.config.hidden_size), num_slots, device)
    wrap_mixers(mixers, pool)
    group.states = pool
    return pool
