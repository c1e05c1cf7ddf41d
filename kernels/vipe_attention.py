"""Triton kernels for the elementwise work around ViPE's single SDPA call (vipe.py).

ViPE's fast path is softmax attention on rescaled queries and keys with one extra value channel that
holds the key index i (derivation in vipe.py). The attention is PyTorch's SDPA and its fused flash
kernel. What is left is elementwise: written with PyTorch ops it takes about fifteen kernels
forward and backward (scale, matmul, cat, slice and their gradients; the cats on 63- and 71-wide
rows are slow: docs/perf/vipe.md). Here it is one kernel before SDPA and one after, each way, and
each reads and writes every tensor once:

    before:  q'_n = s log(n) q_n,   k'_i = (1 + u.k_i) k_i,   vi_i = v_i (+) i (+) zeros
             (all three W wide, the one width SDPA sees; zero channels change nothing)
    after:   z_n = o_n[:Dv] (+) (W_p (n - o_n[Dv]) / s + b_p)                (o_n[Dv] = E_n[i])

and the backward of each:

    dq = s log(n) dq',   dk = (1 + u.k) dk' + (dk'.k) u,   du = sum_i (dk'.k_i) k_i,   dv = dvi[:Dv]
    do[:Dv] = dz[:Dv],   do[Dv] = -(dz_code . W_p) / s,
    dW_p = sum_n (n - E_n[i]) / s dz_code,   db_p = sum_n dz_code

Positions are 0-based here (n - E[i] is the same either way; log uses n + 1). Each program owns
R rows of one (batch, head); the parameter gradients du, dW_p, db_p are summed per program into a
float32 buffer and then by torch, so there are no atomics. Arithmetic is float32 whatever the
input dtype. Inputs may be strided (the layer's q, k, v are views of one projection) as long as the
last dim is contiguous; outputs are contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _partial_row(bh, blk, H):
    """Where program (bh, blk) writes its partial parameter gradient: rows ordered (head, batch,
    block), so the sum over programs is over one contiguous middle dim of an (H, B * blocks, .) buffer."""
    B = tl.num_programs(0) // H
    return (bh % H) * B * tl.num_programs(1) + (bh // H) * tl.num_programs(1) + blk


@triton.jit
def _prologue_fwd(Q, K, V, U, QO, KO, VO, T, H, s, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                  D: tl.constexpr, DV: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, R: tl.constexpr,
                  RESCALE: tl.constexpr):
    bh, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b, h = bh // H, bh % H
    t = blk * R + tl.arange(0, R)                                           # (R,) 0-based positions
    c = tl.arange(0, BW)                                                    # (BW,) channels
    row_ok = (t < T)[:, None]
    q = tl.load(Q + b * sq_b + h * sq_h + t[:, None] * sq_t + c[None, :], mask=row_ok & (c < D)[None, :],
                other=0.0).to(tl.float32)                                   # (R, BW), zero beyond D
    k = tl.load(K + b * sk_b + h * sk_h + t[:, None] * sk_t + c[None, :], mask=row_ok & (c < D)[None, :],
                other=0.0).to(tl.float32)
    if RESCALE:
        u = tl.load(U + h * D + c, mask=c < D, other=0.0).to(tl.float32)
        q = q * (s * tl.log(t.to(tl.float32) + 1.0))[:, None]
        k = k * (1.0 + tl.sum(k * u[None, :], 1))[:, None]
    v = tl.load(V + b * sv_b + h * sv_h + t[:, None] * sv_t + c[None, :], mask=row_ok & (c < DV)[None, :],
                other=0.0).to(tl.float32)
    vi = tl.where((c == DV)[None, :], t[:, None].to(tl.float32), v)         # v (+) i (+) zeros
    out = bh * T * W + t[:, None] * W + c[None, :]                          # (B, H, T, W) contiguous
    ok = row_ok & (c < W)[None, :]
    tl.store(QO + out, q.to(QO.dtype.element_ty), mask=ok)
    tl.store(KO + out, k.to(KO.dtype.element_ty), mask=ok)
    tl.store(VO + out, vi.to(VO.dtype.element_ty), mask=ok)


@triton.jit
def _prologue_bwd(DQO, DKO, K, U, DQ, DK, DU, T, H, s, sk_b, sk_h, sk_t,
                  D: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, R: tl.constexpr, RESCALE: tl.constexpr):
    bh, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b, h = bh // H, bh % H
    t = blk * R + tl.arange(0, R)
    c = tl.arange(0, BW)
    ok = (t < T)[:, None] & (c < D)[None, :]
    grad = bh * T * W + t[:, None] * W + c[None, :]                         # dq', dk': (B, H, T, W)
    dq = tl.load(DQO + grad, mask=ok, other=0.0).to(tl.float32)             # (R, BW)
    dk = tl.load(DKO + grad, mask=ok, other=0.0).to(tl.float32)
    if RESCALE:
        k = tl.load(K + b * sk_b + h * sk_h + t[:, None] * sk_t + c[None, :], mask=ok, other=0.0).to(tl.float32)
        u = tl.load(U + h * D + c, mask=c < D, other=0.0).to(tl.float32)
        dq = dq * (s * tl.log(t.to(tl.float32) + 1.0))[:, None]
        g = tl.sum(dk * k, 1)                                               # (R,) dk'.k
        dk = dk * (1.0 + tl.sum(k * u[None, :], 1))[:, None] + g[:, None] * u[None, :]
        tl.store(DU + _partial_row(bh, blk, H) * BW + c, tl.sum(g[:, None] * k, 0))
    out = bh * T * D + t[:, None] * D + c[None, :]                          # (B, H, T, D)
    tl.store(DQ + out, dq.to(DQ.dtype.element_ty), mask=ok)
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=ok)


@triton.jit
def _epilogue_fwd(O, WP, BP, Z, T, H, s, so_b, so_h, so_t,
                  DV: tl.constexpr, DP: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr, R: tl.constexpr):
    bh, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b, h = bh // H, bh % H
    t = blk * R + tl.arange(0, R)
    c, p = tl.arange(0, BW), tl.arange(0, BC)                               # value and code channels
    row_ok = (t < T)[:, None]
    o_row = O + b * so_b + h * so_h + t * so_t                              # (R,) row pointers
    o = tl.load(o_row[:, None] + c[None, :], mask=row_ok & (c < DV)[None, :], other=0.0)  # (R, BW)
    mean = tl.load(o_row + DV, mask=t < T, other=0.0).to(tl.float32)        # (R,) E_n[i]
    dist = (t.to(tl.float32) - mean) / s                                    # (R,) (n - E_n[i]) / s
    w = tl.load(WP + h * DP + p, mask=p < DP, other=0.0).to(tl.float32)     # (BC,)
    bias = tl.load(BP + h * DP + p, mask=p < DP, other=0.0).to(tl.float32)
    code = dist[:, None] * w[None, :] + bias[None, :]                       # (R, BC)
    z_row = Z + (bh * T + t) * (DV + DP)                                    # (B, H, T, DV + DP) contiguous
    tl.store(z_row[:, None] + c[None, :], o.to(Z.dtype.element_ty), mask=row_ok & (c < DV)[None, :])
    tl.store(z_row[:, None] + DV + p[None, :], code.to(Z.dtype.element_ty), mask=row_ok & (p < DP)[None, :])


@triton.jit
def _epilogue_bwd(DZ, O, WP, DO, DWB, T, H, s, so_b, so_h, so_t,
                  DV: tl.constexpr, DP: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
                  R: tl.constexpr):
    bh, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b, h = bh // H, bh % H
    t = blk * R + tl.arange(0, R)
    c, p = tl.arange(0, BW), tl.arange(0, BC)
    row_ok = (t < T)[:, None]
    mean = tl.load(O + b * so_b + h * so_h + t * so_t + DV, mask=t < T, other=0.0).to(tl.float32)
    dist = (t.to(tl.float32) - mean) / s                                    # (R,)
    dz_row = DZ + (bh * T + t) * (DV + DP)
    dzv = tl.load(dz_row[:, None] + c[None, :], mask=row_ok & (c < DV)[None, :], other=0.0)  # (R, BW)
    dcode = tl.load(dz_row[:, None] + DV + p[None, :], mask=row_ok & (p < DP)[None, :], other=0.0).to(tl.float32)
    w = tl.load(WP + h * DP + p, mask=p < DP, other=0.0).to(tl.float32)
    dmean = -tl.sum(dcode * w[None, :], 1) / s                              # (R,) d E_n[i]
    do = tl.where((c == DV)[None, :], dmean[:, None], dzv.to(tl.float32))   # zeros beyond DV
    tl.store(DO + (bh * T + t)[:, None] * W + c[None, :], do.to(DO.dtype.element_ty),
             mask=row_ok & (c < W)[None, :])                                # (B, H, T, W)
    part = DWB + _partial_row(bh, blk, H) * 2 * BC                          # this program's dW_p, db_p
    tl.store(part + p, tl.sum(dist[:, None] * dcode, 0))
    tl.store(part + BC + p, tl.sum(dcode, 0))


def _launch_shape(B, H, T, BW):
    R = max(16, min(128, 8192 // BW))                                       # rows per program
    return R, (B * H, triton.cdiv(T, R))


class RescaleAppendIndex(torch.autograd.Function):
    """(q, k, v, u) -> (q', k', v (+) i), each (B, H, T, W); see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, u, s, rescale, W):
        B, H, T, D = q.shape
        Dv = v.shape[-1]
        BW = triton.next_power_of_2(W)
        R, grid = _launch_shape(B, H, T, BW)
        qo, ko, vo = (q.new_empty(B, H, T, W) for _ in range(3))
        _prologue_fwd[grid](q, k, v, u, qo, ko, vo, T, H, float(s), *q.stride()[:3], *k.stride()[:3],
                            *v.stride()[:3], D=D, DV=Dv, W=W, BW=BW, R=R, RESCALE=rescale)
        ctx.save_for_backward(k, u)
        ctx.s, ctx.rescale, ctx.Dv = float(s), rescale, Dv
        return qo, ko, vo

    @staticmethod
    def backward(ctx, dqo, dko, dvo):
        k, u = ctx.saved_tensors
        B, H, T, D = k.shape
        W = dqo.shape[-1]
        BW = triton.next_power_of_2(W)
        R, grid = _launch_shape(B, H, T, BW)
        dq, dk = k.new_empty(B, H, T, D), k.new_empty(B, H, T, D)
        du = torch.zeros(H, B * grid[1], BW, device=k.device, dtype=torch.float32)  # per-program sums
        _prologue_bwd[grid](dqo.contiguous(), dko.contiguous(), k, u, dq, dk, du, T, H, ctx.s, *k.stride()[:3],
                            D=D, W=W, BW=BW, R=R, RESCALE=ctx.rescale)
        du = du.sum(1)[:, :D].to(u.dtype) if ctx.rescale else None
        return dq, dk, dvo[..., :ctx.Dv], du, None, None, None


class PositionCode(torch.autograd.Function):
    """o (B, H, T, W) holding E_n[i] in channel Dv -> z = o[:Dv] (+) (W_p (n - E_n[i]) / s + b_p)."""

    @staticmethod
    def forward(ctx, o, w_p, b_p, Dv, s):
        B, H, T, W = o.shape
        dp = w_p.shape[-1]
        BW, BC = triton.next_power_of_2(W), triton.next_power_of_2(dp)
        R, grid = _launch_shape(B, H, T, BW)
        z = o.new_empty(B, H, T, Dv + dp)
        _epilogue_fwd[grid](o, w_p, b_p, z, T, H, float(s), *o.stride()[:3], DV=Dv, DP=dp, BW=BW, BC=BC, R=R)
        ctx.save_for_backward(o, w_p)
        ctx.s, ctx.Dv = float(s), Dv
        return z

    @staticmethod
    def backward(ctx, dz):
        o, w_p = ctx.saved_tensors
        B, H, T, W = o.shape
        Dv, dp = ctx.Dv, w_p.shape[-1]
        BW, BC = triton.next_power_of_2(W), triton.next_power_of_2(dp)
        R, grid = _launch_shape(B, H, T, BW)
        do = torch.empty(B, H, T, W, device=o.device, dtype=o.dtype)
        dwb = torch.empty(H, B * grid[1], 2, BC, device=o.device, dtype=torch.float32)  # per-program sums
        _epilogue_bwd[grid](dz.contiguous(), o, w_p, do, dwb, T, H, ctx.s, *o.stride()[:3],
                            DV=Dv, DP=dp, W=W, BW=BW, BC=BC, R=R)
        dwb = dwb.sum(1)[..., :dp].to(w_p.dtype)                            # (H, 2, dp)
        return do, dwb[:, 0], dwb[:, 1], None, None
