"""PRISM: positions as probability distributions, tracked by a differentiable histogram filter.

Paper: "Position as Probability: ..." (PRISM), sections 4-6 and Algorithms 1-4 (appendix C).

Each cursor c keeps a histogram h_t over P position bins. Token t's gates move it (Algorithm 1),
with S = sum_i h[i] the mass:

    reset branch:     h'[1] += S p_reset p_inc          h'[0] += S p_reset (p_dec + p_keep)
    no-reset branch:  h'[i]   += h[i] (1 - p_reset) p_keep
                      h'[i+1] += h[i] (1 - p_reset) p_inc     (clamped at P - 1)
                      h'[i-1] += h[i] (1 - p_reset) p_dec     (clamped at 0)
    copy (optional):  h' *= p_nocopy ;  h'[k] += S p_copy[k]
    sharpen:          h' = (h' + eps)^gamma_c / sum (h' + eps)^gamma_c     (gamma_c learned, init 2)

(p_inc, p_dec, p_keep) is a categorical over three moves and p_reset a separate Bernoulli, both
read from a GRU over the token embeddings. Before token 0 every histogram is one-hot at bin 0 and
token t's histogram is token t-1's moved by token t's gates: with p_inc = 1 it counts tokens
(absolute position), with resets it counts from the last reset (a relative position).

A histogram becomes a vector by superposition of a sinusoidal table f over the bins,
g_t = sum_k h_t[k] f(k) (Algorithm 2); the cursors of a head are normalised together (Algorithm 3)
and give position scores sum_c |alpha_{h,c}| <g_q, g_k> / sqrt(C d) (Algorithm 4), mixed with the
content scores per head (eq. 8):  a_ts = mu_h <q_t, k_s> / sqrt(D) + (1 - mu_h) position_ts.
Queries and keys have separate cursors.

Usage:

    from prism import histogram_scan
    hist = histogram_scan(p_reset, p_inc, p_dec, p_keep, gamma, P)    # gates: (B, C, T) -> (B, C, T, P)

Shapes: B batch, T time, C cursors, P histogram bins, d sinusoid width, H heads.
"""
from __future__ import annotations

import torch

BACKEND = None  # None = the fast path; "naive" forces the reference


# =============================================================================================
# Naive reference: Algorithm 1, bin by bin
# =============================================================================================

def histogram_step_naive(h, p_reset, p_inc, p_dec, p_keep, gamma, p_copy=None, eps: float = 1e-6):
    """One update. h: (..., P); gates and gamma: (...); p_copy: (..., P + 1), last entry = no copy."""
    P = h.shape[-1]
    if P < 2:
        raise ValueError(f"a histogram needs at least 2 bins, got P={P}")
    total = h.sum(-1)
    out = [torch.zeros_like(total) for _ in range(P)]                 # h'[i], one tensor per bin
    out[1] = out[1] + total * p_reset * p_inc                           # reset branch
    out[0] = out[0] + total * p_reset * (p_dec + p_keep)
    w_inc, w_dec, w_keep = (1 - p_reset) * p_inc, (1 - p_reset) * p_dec, (1 - p_reset) * p_keep
    for i in range(P):                                                  # no-reset branch
        out[i] = out[i] + h[..., i] * w_keep
        out[min(i + 1, P - 1)] = out[min(i + 1, P - 1)] + h[..., i] * w_inc
        out[max(i - 1, 0)] = out[max(i - 1, 0)] + h[..., i] * w_dec
    if p_copy is not None:                                              # copy branch
        for k in range(P):
            out[k] = out[k] * p_copy[..., P] + total * p_copy[..., k]
    h_next = torch.stack(out, -1)
    sharp = (h_next + eps) ** gamma[..., None]                          # sharpen and renormalise
    return sharp / sharp.sum(-1, keepdim=True)


def _scan(step, p_reset, p_inc, p_dec, p_keep, gamma, P, p_copy=None, eps: float = 1e-6):
    B, C, T = p_reset.shape
    gamma = torch.as_tensor(gamma, dtype=p_reset.dtype, device=p_reset.device).expand(B, C)
    h = torch.zeros(B, C, P, dtype=p_reset.dtype, device=p_reset.device)
    h[..., 0] = 1                                                       # one-hot at 0 before token 0
    hist = []
    for t in range(T):
        h = step(h, p_reset[..., t], p_inc[..., t], p_dec[..., t], p_keep[..., t], gamma,
                 None if p_copy is None else p_copy[:, :, t], eps)
        hist.append(h)
    return torch.stack(hist, 2)                                         # (B, C, T, P)


def histogram_scan_naive(p_reset, p_inc, p_dec, p_keep, gamma, P: int, p_copy=None, eps: float = 1e-6):
    """gates: (B, C, T); gamma: broadcastable to (B, C); p_copy: (B, C, T, P + 1) -> (B, C, T, P)."""
    return _scan(histogram_step_naive, p_reset, p_inc, p_dec, p_keep, gamma, P, p_copy, eps)


# =============================================================================================
# Fast path: the same step with whole-vector shifts
# =============================================================================================

def histogram_step(h, p_reset, p_inc, p_dec, p_keep, gamma, p_copy=None, eps: float = 1e-6):
    """`histogram_step_naive` without the loop over bins: moving mass by one bin is a shift of the
    whole vector, with the mass that would leave the ends kept in the end bins (the clamp)."""
    P = h.shape[-1]
    if P < 2:
        raise ValueError(f"a histogram needs at least 2 bins, got P={P}")
    total = h.sum(-1, keepdim=True)
    w = (1 - p_reset)[..., None]
    up = torch.cat([torch.zeros_like(h[..., :1]), h[..., :-2], h[..., -2:].sum(-1, keepdim=True)], -1)
    down = torch.cat([h[..., :2].sum(-1, keepdim=True), h[..., 2:], torch.zeros_like(h[..., :1])], -1)
    h_next = w * (p_keep[..., None] * h + p_inc[..., None] * up + p_dec[..., None] * down)
    first_two = torch.stack([p_dec + p_keep, p_inc], -1) * (total * p_reset[..., None])  # (..., 2)
    h_next = h_next + torch.cat([first_two, torch.zeros_like(h[..., 2:])], -1)
    if p_copy is not None:
        h_next = h_next * p_copy[..., P:] + total * p_copy[..., :P]
    sharp = (h_next + eps) ** gamma[..., None]
    return sharp / sharp.sum(-1, keepdim=True)


def histogram_scan(p_reset, p_inc, p_dec, p_keep, gamma, P: int, p_copy=None, eps: float = 1e-6):
    """Same contract as `histogram_scan_naive`; the loop over T stays (each step needs the last)."""
    if BACKEND == "naive":
        return histogram_scan_naive(p_reset, p_inc, p_dec, p_keep, gamma, P, p_copy, eps)
    return _scan(histogram_step, p_reset, p_inc, p_dec, p_keep, gamma, P, p_copy, eps)
