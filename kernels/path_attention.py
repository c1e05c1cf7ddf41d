"""Triton kernels for PaTH attention: a FlashAttention-style forward and its backward.

The math is in path_attention.py: after the per-block UT preprocessing (`ut_blocks`, PyTorch,
differentiated by autograd) the kernels see

    qh, kh: queries / keys carried to their block boundaries   (B*H, T, D)
    w, u:   the block products P_m = I - W_m^T U_m              (B*H, T, D) float32
    sd:     the scaled logits inside each block                 (B*H, T, C) float32
    G:      the cumulative log forget gate (optional)           (B*H, T)    float32

Forward, one program per (query block i, batch*head): the diagonal block from sd, then the key
blocks m = i-1 ... 0 right to left, scoring with the query state Q~ (float32, in registers) and
carrying it through P_m:  Q~ <- Q~ - (Q~ W_m^T) U_m.  Online softmax as in FlashAttention.

Backward. Let X_i^(m) be the gradient reaching the query state of block i just before it is
carried through P_m. It accumulates left to right,

    X^(m+1) = X^(m) P_m^T + dS_im K^_m,     X^(0) = 0,     dQ^_i = X^(i),

while the states Q~_i^(m) were produced right to left, and dP_m = sum_i Q~_i^(m)T X_i^(m) needs
both at once. The forward therefore stores every state Q~_i^(m) (one C x D tile per block pair,
O(T^2 D / C) memory: the price of an exact backward without inverting the H's), and:

  `_bwd_dq`  (per query block, left to right) recomputes the softmax, writes X_i^(m) per pair,
             dQ^_i, the gradient of sd, and the query side of dG;
  `_bwd_dkv` (per key block, over later query blocks) accumulates dK^_m, dV_m, dP_m and the
             key side of dG in registers: no atomics.

The autograd Function turns dP_m into dW = -U dP^T and dU = -W dP (from P = I - W^T U).
Tensors are padded to a multiple of C by the caller (zero w, beta = 0: H = I), so the kernels
have no bounds checks. Logits are kept in base 2 (times log2 e) as in the Triton tutorial.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _pair(i, m):
    """Index of block pair (query block i, key block m < i) in the packed state buffers."""
    return i * (i - 1) // 2 + m


@triton.jit
def _fwd(QH, KH, V, W, U, SD, G, O, LSE, QS, T, n_pairs, qk_scale,
         D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
         HAS_G: tl.constexpr, SAVE: tl.constexpr, PREC: tl.constexpr, PREC16: tl.constexpr):
    i, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: buffers pass 2^31
    rc, rd, rv = tl.arange(0, C), tl.arange(0, D), tl.arange(0, DV)
    row = bh * T + i * C + rc                                        # (C,) query rows
    q = tl.load(QH + row[:, None] * D + rd[None, :]).to(tl.float32)  # (C, D) query state
    if HAS_G:
        gq = tl.load(G + row) * 1.4426950408889634
    # diagonal block: logits precomputed inside the block
    s = tl.load(SD + row[:, None] * C + rc[None, :]) * 1.4426950408889634
    if HAS_G:
        s += gq[:, None] - gq[None, :]
    s = tl.where(rc[None, :] <= rc[:, None], s, float("-inf"))
    mx = tl.max(s, 1)
    p = tl.exp2(s - mx[:, None])
    lsum = tl.sum(p, 1)
    v = tl.load(V + row[:, None] * DV + rv[None, :])
    acc = tl.dot(p.to(v.dtype), v, input_precision=PREC16)                                 # (C, DV) float32
    # key blocks right to left
    for t in range(0, i):
        m = i - 1 - t
        col = bh * T + m * C + rc
        if SAVE:
            tl.store(QS + ((bh * n_pairs + _pair(i, m)) * C + rc[:, None]) * D + rd[None, :],
                     q.to(QS.dtype.element_ty))
        kh = tl.load(KH + col[:, None] * D + rd[None, :])
        s = tl.dot(q.to(kh.dtype), tl.trans(kh), input_precision=PREC16) * qk_scale
        if HAS_G:
            s += gq[:, None] - tl.load(G + col)[None, :] * 1.4426950408889634
        mnew = tl.maximum(mx, tl.max(s, 1))
        alpha = tl.exp2(mx - mnew)
        p = tl.exp2(s - mnew[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        v = tl.load(V + col[:, None] * DV + rv[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC16)
        mx = mnew
        w = tl.load(W + col[:, None] * D + rd[None, :])
        u = tl.load(U + col[:, None] * D + rd[None, :])
        q = q - tl.dot(tl.dot(q, tl.trans(w), input_precision=PREC), u, input_precision=PREC)
    tl.store(O + row[:, None] * DV + rv[None, :], (acc / lsum[:, None]).to(O.dtype.element_ty))
    tl.store(LSE + row, mx + tl.log2(lsum))


@triton.jit
def _bwd_dq(QS, KH, V, W, U, SD, G, DO, LSE, DELTA, XS, DQH, DSD, DGQ, T, n_pairs, qk_scale, scale,
            D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, HAS_G: tl.constexpr, PREC: tl.constexpr, PREC16: tl.constexpr):
    i, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: buffers pass 2^31
    rc, rd, rv = tl.arange(0, C), tl.arange(0, D), tl.arange(0, DV)
    row = bh * T + i * C + rc
    do = tl.load(DO + row[:, None] * DV + rv[None, :])
    lse = tl.load(LSE + row)
    delta = tl.load(DELTA + row)
    if HAS_G:
        gq = tl.load(G + row) * 1.4426950408889634
    # diagonal block
    s = tl.load(SD + row[:, None] * C + rc[None, :]) * 1.4426950408889634
    if HAS_G:
        s += gq[:, None] - gq[None, :]
    s = tl.where(rc[None, :] <= rc[:, None], s, float("-inf"))
    p = tl.exp2(s - lse[:, None])
    v = tl.load(V + row[:, None] * DV + rv[None, :])
    ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC16) - delta[:, None])  # dL/d(logit)
    tl.store(DSD + row[:, None] * C + rc[None, :], ds)
    dg = tl.sum(ds, 1)
    # key blocks left to right, carrying the query-state gradient X
    x = tl.zeros([C, D], dtype=tl.float32)
    for m in range(0, i):
        col = bh * T + m * C + rc
        at = ((bh * n_pairs + _pair(i, m)) * C + rc[:, None]) * D + rd[None, :]
        tl.store(XS + at, x.to(XS.dtype.element_ty))
        qs = tl.load(QS + at)
        kh = tl.load(KH + col[:, None] * D + rd[None, :])
        s = tl.dot(qs, tl.trans(kh), input_precision=PREC16) * qk_scale
        if HAS_G:
            s += gq[:, None] - tl.load(G + col)[None, :] * 1.4426950408889634
        p = tl.exp2(s - lse[:, None])
        v = tl.load(V + col[:, None] * DV + rv[None, :])
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC16) - delta[:, None])
        dg += tl.sum(ds, 1)
        w = tl.load(W + col[:, None] * D + rd[None, :])
        u = tl.load(U + col[:, None] * D + rd[None, :])
        x = x - tl.dot(tl.dot(x, tl.trans(u), input_precision=PREC), w, input_precision=PREC)
        x += scale * tl.dot(ds.to(kh.dtype), kh, input_precision=PREC16)
    tl.store(DQH + row[:, None] * D + rd[None, :], x)
    if HAS_G:
        tl.store(DGQ + row, dg)


@triton.jit
def _bwd_dkv(QS, XS, KH, V, SD, G, DO, LSE, DELTA, DKH, DV_, DP, DGK, T, n_blocks, n_pairs, qk_scale, scale,
             D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, HAS_G: tl.constexpr, PREC: tl.constexpr, PREC16: tl.constexpr):
    m, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rc, rd, rv = tl.arange(0, C), tl.arange(0, D), tl.arange(0, DV)
    col = bh * T + m * C + rc
    kh = tl.load(KH + col[:, None] * D + rd[None, :])
    v = tl.load(V + col[:, None] * DV + rv[None, :])
    if HAS_G:
        gk = tl.load(G + col) * 1.4426950408889634
    # diagonal block (query block m itself): only dV and the gate here; sd's gradient is in _bwd_dq
    do = tl.load(DO + col[:, None] * DV + rv[None, :])
    lse = tl.load(LSE + col)
    delta = tl.load(DELTA + col)
    s = tl.load(SD + col[:, None] * C + rc[None, :]) * 1.4426950408889634
    if HAS_G:
        s += gk[:, None] - gk[None, :]
    s = tl.where(rc[None, :] <= rc[:, None], s, float("-inf"))
    p = tl.exp2(s - lse[:, None])
    dv = tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC16)    # (C, DV)
    ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC16) - delta[:, None])
    dg = -tl.sum(ds, 0)
    dk = tl.zeros([C, D], dtype=tl.float32)
    dp_m = tl.zeros([D, D], dtype=tl.float32)
    for i in range(m + 1, n_blocks):
        row = bh * T + i * C + rc
        at = ((bh * n_pairs + _pair(i, m)) * C + rc[:, None]) * D + rd[None, :]
        qs = tl.load(QS + at)
        s = tl.dot(qs, tl.trans(kh), input_precision=PREC16) * qk_scale
        if HAS_G:
            s += tl.load(G + row)[:, None] * 1.4426950408889634 - gk[None, :]
        lse = tl.load(LSE + row)
        p = tl.exp2(s - lse[:, None])
        do = tl.load(DO + row[:, None] * DV + rv[None, :])
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC16)
        delta = tl.load(DELTA + row)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC16) - delta[:, None])
        dg -= tl.sum(ds, 0)
        dk += scale * tl.dot(tl.trans(ds).to(qs.dtype), qs, input_precision=PREC16)
        xs = tl.load(XS + at)
        dp_m += tl.dot(tl.trans(qs), xs, input_precision=PREC16)
    tl.store(DKH + col[:, None] * D + rd[None, :], dk)
    tl.store(DV_ + col[:, None] * DV + rv[None, :], dv)
    tl.store(DP + ((bh * n_blocks + m) * D + rd[:, None]) * D + rd[None, :], dp_m)
    if HAS_G:
        tl.store(DGK + col, dg)


def block_size(D: int) -> int:
    """Block length C: 64 keeps the fp32 accumulators of the backward in registers up to D = 64."""
    return 64 if D <= 64 else 32


class PathScan(torch.autograd.Function):
    """o = attention over the block pairs, given the UT preprocessing (see module docstring)."""

    @staticmethod
    def forward(ctx, qh, kh, v, w, u, sd, G, scale, C):
        BH, T, D = qh.shape
        DV = v.shape[-1]
        n = T // C
        n_pairs = n * (n - 1) // 2
        save = torch.is_grad_enabled() or any(ctx.needs_input_grad)
        # float32 input: exact float32 products everywhere; 16-bit input: tensor-core products of the
        # input dtype, and TF32 for the float32 transport products of the carried query state
        prec, prec16 = ("ieee", "ieee") if v.dtype == torch.float32 else ("tf32", None)
        o = torch.empty_like(v)
        lse = torch.empty(BH, T, device=v.device, dtype=torch.float32)
        qs = torch.empty(BH, max(n_pairs, 1), C, D, device=v.device, dtype=kh.dtype) if save else o
        has_g = G is not None
        _fwd[(n, BH)](qh, kh, v, w, u, sd, G if has_g else lse, o, lse, qs, T, n_pairs, scale * LOG2E,
                      D=D, DV=DV, C=C, HAS_G=has_g, SAVE=save, PREC=prec, PREC16=prec16)
        ctx.save_for_backward(qs, kh, v, w, u, sd, G, o, lse)
        ctx.scale, ctx.C, ctx.prec = scale, C, (prec, prec16)
        return o

    @staticmethod
    def backward(ctx, do):
        qs, kh, v, w, u, sd, G, o, lse = ctx.saved_tensors
        scale, C, (prec, prec16) = ctx.scale, ctx.C, ctx.prec
        BH, T, D = kh.shape
        DV = v.shape[-1]
        n = T // C
        n_pairs = n * (n - 1) // 2
        do = do.contiguous()
        delta = (do.float() * o.float()).sum(-1)             # (BH, T): rowsum(dO * O)
        has_g = G is not None
        f32 = dict(device=v.device, dtype=torch.float32)
        xs = torch.empty_like(qs)
        dqh, dsd = torch.empty(BH, T, D, **f32), torch.empty(BH, T, C, **f32)
        dkh, dv = torch.empty(BH, T, D, **f32), torch.empty(BH, T, DV, **f32)
        dp = torch.empty(BH, n, D, D, **f32)
        dgq, dgk = (torch.empty(BH, T, **f32), torch.empty(BH, T, **f32)) if has_g else (lse, lse)
        _bwd_dq[(n, BH)](qs, kh, v, w, u, sd, G if has_g else lse, do, lse, delta, xs, dqh, dsd, dgq,
                         T, n_pairs, scale * LOG2E, scale, D=D, DV=DV, C=C, HAS_G=has_g, PREC=prec, PREC16=prec16)
        _bwd_dkv[(n, BH)](qs, xs, kh, v, sd, G if has_g else lse, do, lse, delta, dkh, dv, dp, dgk,
                          T, n, n_pairs, scale * LOG2E, scale, D=D, DV=DV, C=C, HAS_G=has_g, PREC=prec, PREC16=prec16)
        wb, ub = w.view(BH, n, C, D), u.view(BH, n, C, D)
        dw = -(ub @ dp.mT).view(BH, T, D)                    # P = I - W^T U  =>  dW = -U dP^T
        du = -(wb @ dp).view(BH, T, D)                       #                    dU = -W dP
        dG = dgq + dgk if has_g else None
        return dqh, dkh.to(kh.dtype), dv.to(v.dtype), dw, du, dsd, dG, None, None


def path_attention_triton(q, k, v, w, beta, g=None, scale=None, block: int | None = None):
    """Same contract as path_attention.path_attention_naive; q, k, v in fp16/bf16/fp32."""
    from path_attention import _pad_time, ut_blocks

    B, H, T, D = q.shape
    DV = v.shape[-1]
    if D not in (16, 32, 64, 128) or DV not in (16, 32, 64, 128):
        raise ValueError(f"the PaTH Triton kernel takes head dims 16, 32, 64 or 128, got D={D}, Dv={DV}")
    scale = D ** -0.5 if scale is None else scale
    C = block or block_size(max(D, DV))
    q, k, v, w, beta, g = _pad_time(C, q, k, v, w, beta, g)
    Tp = q.shape[2]
    qh, kh, wb, u, sd = ut_blocks(q, k, w, beta, scale, C)   # float32, autograd-differentiable
    G = None if g is None else g.float().cumsum(-1).reshape(B * H, Tp).contiguous()
    f32 = torch.float32
    flat = lambda x, dt=None: x.reshape(B * H, Tp, x.shape[-1]).to(dt or x.dtype).contiguous()  # noqa: E731
    o = PathScan.apply(flat(qh, f32), flat(kh, v.dtype), flat(v), flat(wb, f32), flat(u, f32), flat(sd, f32),
                      G, scale, C)
    return o.view(B, H, Tp, DV)[:, :, :T]
