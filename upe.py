"""RPE (Shaw et al. 2018) and UPE: pairwise key-side position vectors for arithmetic.

Paper: "Explicitly Encoding Structural Symmetry is Key to Length Generalization in Arithmetic Tasks"
(Sabbaghi et al., 2024; arXiv:2406.01895), sections 2-3, eq. 2.1, 3.3.

Bidirectional attention where each (query i, key j) pair adds a vector to the key:

    A_ij = softmax_j( q_i . (k_j + p_ij) / sqrt(D) )
    RPE:  p_ij = R[clip(i - j, -K, K)]                 one learned vector per clipped offset
    UPE:  p_ij = C[slot_j]   where slot_j >= 0         the same vector for every query (eq. 3.3)
          p_ij = R[clip(i - j, -K, K)]   elsewhere

Why: in '#'-padded arithmetic (tasks add_padded, mul_padded) the digits an output digit needs sit at
fixed offsets from it whatever the number of digits, so relative vectors express the rule once for
every length (translation symmetry). In multiplication every output digit needs every multiplier
digit, at offsets that grow with the position; giving multiplier digit c one vector C[c] for all
queries makes that access independent of the position too.

The fast path never builds the (T, T, D) vectors: q . p_ij is a lookup in the per-query tables
q R^T (T, 2K+1) and q C^T (T, M), gathered by offset or slot. On CPU it gathers them into the
logits with PyTorch (autograd's scatter-add accumulates the gradient where clipping maps many
offsets to one entry); on CUDA a FlashAttention-style Triton kernel gathers them per tile and
never holds a (T, T) tensor (kernels/upe_attention.py, with its own backward).

Usage:

    from upe import upe_attention, RPEAttention, UPEAttention
    o = upe_attention(q, k, v, rel, uni=None, slot=None, key_mask=None)
    # q, k, v: (B, H, T, D); rel: (H, 2K+1, D); uni: (H, M, D); slot: (B, T) int64, -1 = relative;
    # key_mask: (B, T) bool, True = attend

Options (cfg.opts, `--method-opt`): rpe_clip = K (default 64: covers the operand offsets of the
padded tasks up to width 63), upe_slots = M (default 3, the longest multiplier).

Shapes: B batch, H heads, T time, D head dim, K clip distance, M uniform slots.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from model import Method, Opt, causal_mask, note_logits, pick_backend

BACKEND = None  # None = choose (Triton on CUDA, "torch" on CPU); or force "naive" | "torch" | "triton"


def offsets(T: int, K: int, device) -> torch.Tensor:
    """(T, T) index into rel: clip(i - j, -K, K) + K for query i, key j."""
    pos = torch.arange(T, device=device)
    return (pos[:, None] - pos[None, :]).clamp(-K, K) + K


def _mask(logits, key_mask, causal):
    T = logits.shape[-1]
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask[:, None, None, :], -math.inf)
    if causal:
        logits = logits.masked_fill(~causal_mask(T, logits.device), -math.inf)
    return logits


# =============================================================================================
# Naive reference: the pairwise vectors, explicitly
# =============================================================================================

def upe_attention_naive(q, k, v, rel, uni=None, slot=None, key_mask=None, causal=False):
    """The definition: builds p_ij (B, H, T, T, D) and the logits q_i . (k_j + p_ij) / sqrt(D)."""
    B, H, T, D = q.shape
    K = (rel.shape[1] - 1) // 2
    p = rel[:, offsets(T, K, q.device)][None].expand(B, H, T, T, D)          # (B, H, T, T, D)
    if uni is not None and slot is not None:
        u = uni[:, slot.clamp(min=0)].permute(1, 0, 2, 3)[:, :, None]         # (B, H, 1, T, D) per key
        p = torch.where((slot >= 0)[:, None, None, :, None], u, p)
    logits = (q[:, :, :, None, :] * (k[:, :, None, :, :] + p)).sum(-1) / math.sqrt(D)   # (B, H, T, T)
    return _mask(logits, key_mask, causal).softmax(-1) @ v


# =============================================================================================
# Fast path: gather q . R and q . C tables
# =============================================================================================

def upe_logits(q, k, rel, uni=None, slot=None):
    """The (B, H, T, T) logits without building p_ij: q k^T + q R^T gathered by offset, or q C^T
    gathered by slot for keys with slot >= 0; scaled by 1/sqrt(D)."""
    B, H, T, D = q.shape
    K = (rel.shape[1] - 1) // 2
    qr = q @ rel.transpose(-1, -2)[None]                                      # (B, H, T, 2K+1)
    pos = qr.gather(-1, offsets(T, K, q.device).expand(B, H, T, T))          # (B, H, T, T)
    if uni is not None and slot is not None:
        qc = q @ uni.transpose(-1, -2)[None]                                  # (B, H, T, M)
        by_slot = qc.gather(-1, slot.clamp(min=0)[:, None, None, :].expand(B, H, T, T))
        pos = torch.where((slot >= 0)[:, None, None, :], by_slot, pos)
    return (q @ k.transpose(-1, -2) + pos) / math.sqrt(D)


@torch.compiler.disable
def upe_attention_torch(q, k, v, rel, uni=None, slot=None, key_mask=None, causal=False):
    """The CPU path (and CUDA's for head dims above 128): memory O(T (K + M + T)) per head (the tables
    and the logits). Never compiled (`--compile` runs it eagerly between the compiled parts): compiled, on CUDA in
    bfloat16, the UPE paper's RPE model diverged within 1k steps, with or without dropout and CUDA graphs, where
    the same model trained eagerly did not (docs/results/upe-compile)."""
    logits = _mask(upe_logits(q, k, rel, uni, slot), key_mask, causal)          # (B, H, T, T)
    note_logits(logits)
    return logits.softmax(-1) @ v


def upe_attention(q, k, v, rel, uni=None, slot=None, key_mask=None, causal=False):
    """RPE / UPE attention, same contract as `upe_attention_naive`, never building the pairwise
    vectors. Triton on CUDA (kernels/upe_attention.py: no (T, T) tensor either), PyTorch on CPU.
    A slot >= M is an error, checked here when `slot` is on the CPU. On a GPU the check would make
    the host wait for the device at every call, so the layers check the batch's largest slot, which
    `model.batch_context` reads on the CPU, and the kernel clamps slots to the table's width so that
    it never reads outside it."""
    if slot is not None and uni is not None and not slot.is_cuda and slot.max() >= uni.shape[1]:
        raise ValueError(f"slot {int(slot.max())} has no uniform vector (M = {uni.shape[1]})")
    backend = pick_backend(BACKEND, "upe_attention", q.is_cuda, q.shape[-1] <= 128,
                           f"no Triton kernel for head dims above 128, got {q.shape[-1]}")
    if backend == "triton":
        from kernels.upe_attention import upe_attention_triton as fn
    else:
        fn = upe_attention_naive if backend == "naive" else upe_attention_torch
    return fn(q, k, v, rel, uni, slot, key_mask, causal)


# =============================================================================================
# Layers
# =============================================================================================

class RPEAttention(nn.Module):
    """Multi-head attention with Shaw relative key vectors (clip K), bidirectional or causal."""

    def __init__(self, cfg, uniform: bool = False):
        super().__init__()
        C, H = cfg.d_model, cfg.n_heads
        self.H, self.D, self.causal = H, C // H, cfg.causal
        self.K = int(cfg.opts.get("rpe_clip", 64))
        if self.K < 1:
            raise ValueError(f"rpe_clip must be at least 1, got {self.K}")
        self.qkv = nn.Linear(C, 3 * C, bias=False)
        self.out = nn.Linear(C, C, bias=False)
        self.rel = nn.Parameter(0.02 * torch.randn(H, 2 * self.K + 1, self.D))
        self.uni = nn.Parameter(0.02 * torch.randn(H, int(cfg.opts.get("upe_slots", 3)), self.D)) if uniform else None

    def check_context(self, ctx):
        """A batch whose largest slot (ctx["slot_max"], an int read on the CPU) has no uniform vector
        is an error (see `upe_attention`); cli.validate also calls this on sample batches before a run."""
        if self.uni is not None and ctx.get("slot") is not None and ctx.get("slot_max", -1) >= self.uni.shape[1]:
            raise ValueError(f"slot {ctx['slot_max']} has no uniform vector (upe_slots = {self.uni.shape[1]})")

    def forward(self, x, ctx=None):
        ctx = ctx or {}
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, self.D).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        self.check_context(ctx)
        slot = ctx.get("slot") if self.uni is not None else None
        o = upe_attention(q, k, v, self.rel.to(q.dtype), None if self.uni is None else self.uni.to(q.dtype),
                          slot, ctx.get("key_mask"), self.causal)
        return self.out(o.transpose(1, 2).reshape(B, T, C))


class UPEAttention(RPEAttention):
    """RPE plus one uniform vector per slot: keys with ctx["slot"] >= 0 (e.g. the multiplier's
    digits) use C[slot] for every query instead of their relative vector. ctx["slot_max"], the
    largest slot of the batch as an int, is checked against upe_slots (see `upe_attention`)."""

    def __init__(self, cfg):
        super().__init__(cfg, uniform=True)


RPE = Method(RPEAttention, options={"rpe_clip": Opt(int, "clip distance K (default 64)", 1)})
UPE = Method(UPEAttention, options={"rpe_clip": Opt(int, "clip distance K (default 64)", 1),
                                    "upe_slots": Opt(int, "uniform vectors M, > the largest slot (default 3)", 1)})
