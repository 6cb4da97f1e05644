"""bulkgen.engine: continuous batching, packed varlen prompts and a paged KV cache over HF models.

    engine = Engine.from_pretrained(path)  # step limits sized for the device (64 / 2,048 on CPU)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0))
    vectors = engine.embed(texts)  # pooled final hidden states (bulkgen.engine.pooling), same packed steps

Sampling runs on the logits' device with counter-based random numbers keyed by (seed, completion,
position). On CUDA, attention uses the fastest fused varlen kernel this torch offers that passes a
self-check against the plain path, and decode steps replay CUDA graphs; none of the CUDA path has
run on a GPU in development (its tests are marked `gpu`).

Greedy output is checked token for token against transformers' `generate` (fp32, CPU) for Llama,
Qwen2, Qwen3 and Mistral. The same check also passed, once, for tiny random Gemma, Olmo, Olmo2,
Granite, Phi, Phi3, Mixtral, Starcoder2, Cohere, Qwen2-MoE, Qwen3-MoE, Exaone4, Ministral, Apertus,
Ernie4.5, Arcee, Helium, SmolLM3, GLM, GPT-NeoX, OPT, GPT-J and CodeGen models. Hybrid models
(linear-attention, Mamba-2 or short-conv layers beside attention: Qwen3-Next, Qwen3.5 dense and MoE,
GraniteMoeHybrid, Falcon-H1, LFM2) are checked the same way; their recurrent state lives in per-sequence
state slots (state_slots.py, hybrid_layers.py) and prefix caching is off for them. Refused with a clear
error: attention soft-capping or sinks (Gemma2, gpt-oss), models whose attention bypasses
transformers' AttentionInterface (Bloom, Falcon) or drops forward kwargs (StableLM), models with
layers that are neither attention nor a recurrent mixer bulkgen finds, and recurrent mixers not yet
checked against transformers (Bamba, LFM2-MoE, ...: hybrid_layers.CHECKED_MIXERS). Sliding-window models run with
max_model_len clipped to the window.
"""

import os

from .sampling_params import SamplingParams

# Tests set this to an Engine subclass ("module:Class") whose steps they can hold at a gate
# (tests/support/held_engine.py); workers inherit it, so a test holds a batch mid-run in any process.
ENGINE_CLASS_ENV = "BULKGEN_TEST_ENGINE"

_LAZY = {
    "Engine": ".engine",
    "CompletionOutput": ".outputs",
    "RequestMetrics": ".outputs",
    "RequestOutput": ".outputs",
    "EmbedParams": ".pooling",
    "PoolingConfig": ".pooling",
}


def __getattr__(name: str):
    """Engine and its outputs import torch: loaded on first use, so the API process, which only checks
    sampling values (`sampling_params.check_sampling`), never imports it."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def engine_class() -> type:
    """The class a worker builds its engine from: Engine, unless BULKGEN_TEST_ENGINE names another."""
    import importlib

    name = os.environ.get(ENGINE_CLASS_ENV)
    if not name:
        return importlib.import_module(".engine", __name__).Engine
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = [
    "CompletionOutput",
    "EmbedParams",
    "Engine",
    "PoolingConfig",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
