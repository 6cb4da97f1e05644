"""Reference kernels for the CUDA-only attention ops, so CPU tests can check the backends around them."""

from __future__ import annotations

import torch


def reference_varlen(q, k, v, cu_q, cu_k, scale, window_left=-1):
    """float64 causal varlen attention, bottom-right aligned, each query reading at most `window_left`
    keys before its own (-1: all): the flash-attention semantics -> (out, lse [Hq, T])."""
    out = torch.empty(*q.shape[:2], v.shape[-1], dtype=torch.float64)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        qi, ki, vi = (
            q[qs].double(),
            k[ks].double().repeat_interleave(group, 1),
            v[ks].double().repeat_interleave(group, 1),
        )
        offset = ki.shape[0] - qi.shape[0]
        key, query = torch.arange(ki.shape[0])[None, :], torch.arange(qi.shape[0])[:, None] + offset
        allowed = (key <= query) & ((key >= query - window_left) | (window_left < 0))
        scores = (torch.einsum("qhd,khd->hqk", qi, ki) * scale).masked_fill(~allowed, float("-inf"))
        out[qs] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi)
        lse[:, qs] = scores.logsumexp(-1)
    return out.to(q.dtype), lse.float()
