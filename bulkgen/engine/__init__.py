"""bulkgen.engine: continuous batching, packed varlen prompts and a paged KV cache over HF models.

    engine = Engine.from_pretrained(path)  # step limits sized for the device (64 / 2,048 on CPU)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0))
    vectors = engine.embed(texts)  # pooled final hidden states (bulkgen.engine.features.pooling), same packed steps

Sampling runs on the logits' device with counter-based random numbers keyed by (seed, completion,
position). On CUDA, attention uses the fastest fused varlen kernel this torch offers that passes a
self-check against the plain path, and decode steps replay CUDA graphs; none of the CUDA path has
run on a GPU in development (its tests are marked `gpu`).

Each layer's attention is learned at load by running the model once (layer_attention): its K/V head
shapes, sliding window, chunked attention, soft-cap and sinks, which every kernel takes as parameters;
layers of one kind share KV block tables, and windowed or chunked ones give back the blocks behind what
they read (kv_layout, block_manager). Greedy output equals transformers' `generate` token for token
(fp32, CPU; tests/engine/test_architectures.py, with chunked prefill, prefix caching and preemption) for
Llama, Qwen2, Qwen3, Mistral (with and without its window), Ministral, Phi-3, Starcoder2, Gemma, Gemma 2
(soft-capping), Gemma 3, Gemma 3n, OLMo, OLMo 2, OLMo 3, Cohere, Cohere 2, EXAONE 4, gpt-oss (sinks),
Llama 4 (chunked attention), DeepSeek-V2, DeepSeek-V3, GLM-4.7-Flash and Youtu-LLM (MLA, cached as
its compressed latent: mla.py),
Qwen2-MoE, Qwen3-MoE, Mixtral, GLM-4 MoE, MiniMax-M2, SmolLM3, Granite, Phi, GPT-NeoX, GLM, Helium,
Apertus, Arcee, ERNIE 4.5, OPT, GPT-J and CodeGen. Hybrid models (linear-attention, Mamba-2 or
short-conv layers beside attention: Qwen3-Next, Qwen3.5 dense and MoE, GraniteMoeHybrid, Falcon-H1,
LFM2) are checked the same way (tests/engine/test_hybrid_models.py); their recurrent state lives in
per-sequence state slots (state_slots.py, hybrid_layers.py) and prefix caching is off for them.
Vision-language models (LLaVA, Idefics3, Qwen2.5-VL and Qwen3-VL with M-RoPE) run their language half here with image embeddings
spliced into the packed prompt (multimodal.py; tests/engine/test_vision.py); other image-text-to-text
families are refused by name.
PEFT LoRA adapters (`engine.add_lora`, `add_request(..., lora=name)`) run mixed with each other and the base
model in the same packed steps from a pool of `max_loras` device slots (lora.py, lora_slots.py; checked
against peft's merged models in tests/engine/test_lora.py).
Refused at load with one line naming the feature: models whose attention bypasses transformers'
AttentionInterface (Bloom, Falcon) or whose layers drop forward kwargs (StableLM), layers that are
neither attention nor a recurrent mixer bulkgen finds, recurrent mixers not yet checked against
transformers (Bamba, LFM2-MoE, ...: hybrid_layers.CHECKED_MIXERS), and layers with different KV head
shapes.
"""

import os

from bulkgen.engine.sampling.sampling_params import SamplingParams

# Tests set this to an Engine subclass ("module:Class") whose steps they can hold at a gate
# (tests/support/held_engine.py); workers inherit it, so a test holds a batch mid-run in any process.
ENGINE_CLASS_ENV = "BULKGEN_TEST_ENGINE"

# EngineConfig.quantize's values (quantize.py), here so settings can offer them without importing torch
QUANTIZE_MODES = ("fp8",)

_LAZY = {
    "Engine": ".engine",
    "CompletionOutput": ".outputs",
    "RequestMetrics": ".outputs",
    "RequestOutput": ".outputs",
    "EmbedParams": ".features.pooling",
    "PoolingConfig": ".features.pooling",
    "LoraError": ".features.lora",
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
    "LoraError",
    "PoolingConfig",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
