"""Attention over the packed row and the paged cache: what each layer reads and how it scores
(layer_attention), the backends and their choice by probing (attn_backends, attn_plain, attn_select,
triton_decode), the `AttentionInterface` hook transformers calls (interface), and multi-head latent
attention over a latent cache (mla). Imports the KV cache's layout, never the scheduler or a feature."""
