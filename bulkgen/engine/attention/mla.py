"""Multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2, GLM-4.7-Flash, Youtu-LLM) over a latent KV cache.

An MLA layer projects each token to a compressed latent c_kv (`kv_lora_rank` values, after
`kv_a_layernorm`) and one rope'd key k_pe shared by all heads (`qk_rope_head_dim`); transformers then
up-projects the latents with `kv_b_proj` to per-head K (nope + rope) and V and attends over those.
Cached that way a token costs heads x (K + V) values per layer: DeepSeek-V3, 128 x (192 + 128) = 40,960,
71x its 576-value latent. So the engine replaces each MLA module's forward (as hybrid_layers wraps
recurrent mixers) by one that hands bulkgen's attention the latent itself, in the absorbed form
(vLLM's `MLACommonImpl`, FlashMLA):

    scores_h = (q_nope_h W_UK_h) . c_kv + q_pe_h . k_pe          (W_UK_h, W_UV_h: head h's rows of kv_b_proj)
    out_h    = (probs_h . c_kv) W_UV_h

which equals the expanded form (the products associate), read as multi-query attention: one KV head of
width kv_lora_rank + rope dim, K = [c_kv, k_pe], V = c_kv (K's leading columns: the cache stores the
row once, `LayerAttention.latent`), queries [q_nope W_UK, q_pe], the softmax scale of the original
qk_head_dim with DeepSeek's yarn mscale (`module.scaling`, as transformers computes it).

Prefill takes the absorbed form too, not the expanded one vLLM uses for long prefills: one path for
prefill, continuation chunks and decode, through every backend's existing prefill and decode code
(block tables, chunked prefill, prefix caching, preemption and the FP8 cache unchanged), and a
continuation chunk reads its context as latents without materialising heads x context K and V. The
price is prefill arithmetic: each score and weighted sum runs over 576 and 512 values instead of 192
and 128 per head (about 3.4x the attention FLOPs; projections are unchanged). Flash kernels take no
head wider than 256, so MLA models run the plain backend's prefill on CUDA (attn_backends: refused
as a feature, so the choice is logged, never silent) with the triton or padded decode.

Outside the engine's forward calls (no `bulkgen_ctx`) the module runs its own forward, so `generate`
is untouched.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# the MLA modules checked token for token against transformers (tests/engine/test_architectures.py);
# another MLA family keeps the expanded K/V cache (its own forward) until it is checked
LATENT_MODULES = frozenset(
    {"DeepseekV2Attention", "DeepseekV3Attention", "Glm4MoeLiteAttention", "YoutuAttention"}
)


def latent_width(config) -> int | None:
    """Values one token's latent takes per layer (kv_lora_rank + qk_rope_head_dim), or None for a
    config without MLA. What the KV cache stores per token and layer, whatever the number of heads."""
    rank, rope = getattr(config, "kv_lora_rank", None), getattr(config, "qk_rope_head_dim", None)
    return rank + rope if rank and rope else None


def find_mla(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer index -> the MLA attention module of each decoder layer that bulkgen caches as latents."""
    layers = getattr(model.get_decoder(), "layers", None) or []
    found = {}
    for idx, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and type(attn).__name__ in LATENT_MODULES:
            found[idx] = attn
    return found


def wrap_mla(modules: dict[int, torch.nn.Module]) -> None:
    """Route each module's forward through `_latent_forward` (once: a second engine rewraps the original)."""
    for module in modules.values():
        original = getattr(module, "_bulkgen_original_forward", module.forward)
        module._bulkgen_original_forward = original
        module.bulkgen_latent = True  # read by layer_attention.probe_layers
        signature = inspect.signature(original)  # read once: binding per call costs microseconds only
        module.forward = functools.partial(_latent_forward, original, signature, module)


def lora_refusal(owner: torch.nn.Module, child: str) -> str | None:
    """Why a LoRA adapter cannot target `owner`'s `child` layer: kv_b_proj of a latent MLA layer is
    absorbed into the queries and outputs (`absorbed_weights`), so an adapter's delta there would be
    silently dropped."""
    if child == "kv_b_proj" and getattr(owner, "bulkgen_latent", False):
        return (
            f"{type(owner).__name__} layer {owner.layer_idx}: kv_b_proj is absorbed into the latent "
            "attention (MLA's latent KV cache), so a LoRA adapter cannot target it"
        )
    return None


def _latent_forward(original, signature: inspect.Signature, module, *args, **kwargs):
    """The module's forward on a packed engine step ([1, T, hidden]) with the latent as its one KV head."""
    if kwargs.get("bulkgen_ctx") is None:
        return original(*args, **kwargs)
    bound = signature.bind(*args, **kwargs)
    hidden = bound.arguments["hidden_states"]
    rest = bound.arguments.get("kwargs", {})
    query, key = _latent_qk(module, hidden, bound.arguments["position_embeddings"])
    w_uk, w_uv = absorbed_weights(module, query.dtype)
    # q_nope W_UK per head: [1, H, T, nope] x [H, nope, L] -> [1, H, T, L]
    q_latent = torch.einsum("bhtn,hnl->bhtl", query[..., : module.qk_nope_head_dim], w_uk)
    query = torch.cat([q_latent, query[..., module.qk_nope_head_dim :]], dim=-1)
    attend = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]
    out, _ = attend(
        module, query, key, key[..., : module.kv_lora_rank], None, scaling=module.scaling, **rest
    )  # [1, T, H, L]
    out = torch.einsum("bthl,hvl->bthv", out, w_uv)
    return module.o_proj(out.reshape(*out.shape[:2], -1)), None


def _latent_qk(module, hidden: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [1, T, hidden] -> (queries [1, H, T, nope + rope] with rope applied, latent keys
    [1, 1, T, kv_lora_rank + rope]: c_kv after its layernorm, then the rope'd k_pe)."""
    batch, length = hidden.shape[:2]
    if module.q_lora_rank is None:
        q = module.q_proj(hidden)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden)))
    q = q.view(batch, length, -1, module.qk_head_dim).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    c_kv, k_pe = torch.split(
        module.kv_a_proj_with_mqa(hidden), [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1
    )
    c_kv = module.kv_a_layernorm(c_kv).view(batch, 1, length, module.kv_lora_rank)
    k_pe = k_pe.view(batch, 1, length, module.qk_rope_head_dim)
    q_pe, k_pe = _rope(module, q_pe, k_pe, position_embeddings)
    return torch.cat([q_nope, q_pe], dim=-1), torch.cat([c_kv, k_pe.to(c_kv.dtype)], dim=-1)


def _rope(module, q_pe, k_pe, position_embeddings):
    """The family's own rotary function from its modeling module: DeepSeek-V2 rotates by complex
    frequencies, V3 by (cos, sin), interleaved when the config says so."""
    family = sys.modules[type(module).__module__]
    if type(module).__name__ == "DeepseekV2Attention":
        return family.apply_rotary_emb(q_pe, k_pe, position_embeddings.to(q_pe.device))
    cos, sin = position_embeddings
    if getattr(module.config, "rope_interleave", False):
        return family.apply_rotary_pos_emb_interleave(q_pe, k_pe, cos, sin)
    return family.apply_rotary_pos_emb(q_pe, k_pe, cos, sin)


def absorbed_weights(module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [H * (nope + v), L] as per-head W_UK [H, nope, L] and W_UV [H, v, L], in
    `dtype` (the activations'). The head count comes from the weight, so a tensor-parallel shard's
    local heads work."""
    rows = _dense_rows(module.kv_b_proj, module.kv_lora_rank, dtype)
    per_head = module.qk_nope_head_dim + module.v_head_dim
    rows = rows.view(rows.shape[0] // per_head, per_head, module.kv_lora_rank)
    return rows[:, : module.qk_nope_head_dim], rows[:, module.qk_nope_head_dim :]


def _dense_rows(proj: torch.nn.Module, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A float linear layer's own weight (a view: no copy). A quantized one (quantize.Fp8Linear, a
    compressed checkpoint's layer) is read once through its forward on the identity, W^T, and kept in
    `dtype` beside it: the absorbed form multiplies queries by W_UK's transpose, which no forward of
    the layer computes (DeepSeek-V3: 32 MiB a layer in bf16)."""
    weight = getattr(proj, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dtype == dtype and weight.dim() == 2:
        return weight
    dense = getattr(proj, "_bulkgen_dense_rows", None)
    if dense is None or dense.dtype != dtype:
        eye = torch.eye(rank, dtype=dtype, device=next(proj.parameters()).device)
        with torch.inference_mode():
            dense = proj(eye).transpose(0, 1).contiguous()  # bias-free (DeepSeek's kv_b_proj)
        proj._bulkgen_dense_rows = dense
    return dense
