"""Triton kernels for PRISM's histogram scan (Algorithm 1, with or without the copy branch),
forward and backward.

One program per (batch, cursor) row walks the T tokens with the P-bin histogram in float32. The
one-bin shifts of the stencil read the previous histogram back from global memory at offsets
i - 1 and i + 1 (the row was just written by the same program; a barrier makes it visible), so the
output (B*N, T + 1, P), whose row 0 is the one-hot start, doubles as the scan state. With the copy
branch (HAS_COPY) each step then mixes in the copy distribution before sharpening,
v = u p_nocopy + total p_copy[:P], with p_copy (B*N, T, P + 1), its last entry p_nocopy.

Backward: a reverse-time scan. For each step it recomputes the pre-sharpening histogram u from the
stored previous histogram and the gates (cheap: one stencil), then goes back through the
normalisation, the power gamma, the copy mix and the stencil; the stencil's transpose needs du at i + 1 and
i - 1, read back from a per-row scratch row in the same way. The gradient of the previous
histogram is carried to the next (earlier) step in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Warps per program (one (batch, cursor) row); None: one per 256 bins, at most 8. With one warp a step's many
# sums over the bins are shuffles within it and its barriers sync only it; more warps split a row and meet
# through shared memory; fewer threads hold more bins each in registers.
WARPS = None


def warps(BP: int) -> int:
    """Warps a program of a BP-bin block runs with."""
    return WARPS or max(1, min(8, BP // 256))


@triton.jit
def _stencil(prev, prev_m1, prev_p1, rp, r, inc, dec, keep, P: tl.constexpr):
    """u = (1 - r)(keep h + inc up(h) + dec down(h)) + the reset mass at bins 0 and 1."""
    total = tl.sum(prev, 0)
    up = prev_m1 + tl.where(rp == P - 1, prev, 0.0)          # mass moving up, clamped at P - 1
    down = prev_p1 + tl.where(rp == 0, prev, 0.0)            # mass moving down, clamped at 0
    moved = keep * prev + inc * up + dec * down
    u = (1 - r) * moved + tl.where(rp == 0, total * r * (dec + keep), 0.0) + tl.where(rp == 1, total * r * inc, 0.0)
    return u, up, down, moved, total


@triton.jit
def _fwd(R, INC, DEC, KEEP, GAMMA, PC, HIST, T, eps, P: tl.constexpr, BP: tl.constexpr, HAS_COPY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rp = tl.arange(0, BP)
    valid = rp < P
    gamma = tl.load(GAMMA + row)
    base = HIST + row * (T + 1) * P
    tl.store(base + rp, tl.where(rp == 0, 1.0, 0.0), mask=valid)                      # one-hot start
    for t in range(0, T):
        tl.debug_barrier()
        prev = tl.load(base + t * P + rp, mask=valid, other=0.0)
        prev_m1 = tl.load(base + t * P + rp - 1, mask=valid & (rp >= 1), other=0.0)
        prev_p1 = tl.load(base + t * P + rp + 1, mask=(rp + 1) < P, other=0.0)
        g = row * T + t
        u, _, _, _, total = _stencil(prev, prev_m1, prev_p1, rp, tl.load(R + g), tl.load(INC + g),
                                     tl.load(DEC + g), tl.load(KEEP + g), P)
        if HAS_COPY:                                                                   # the copy mix
            pc = tl.load(PC + g * (P + 1) + rp, mask=valid, other=0.0)
            u = u * tl.load(PC + g * (P + 1) + P) + total * pc
        s = tl.where(valid, tl.exp2(gamma * tl.log2(u + eps)), 0.0)                    # (u + eps)^gamma
        tl.store(base + (t + 1) * P + rp, s / tl.sum(s, 0), mask=valid)


@triton.jit
def _bwd(R, INC, DEC, KEEP, GAMMA, PC, HIST, DHIST, SCRATCH, DR, DINC, DDEC, DKEEP, DGAMMA, DPC, T, eps,
         P: tl.constexpr, BP: tl.constexpr, HAS_COPY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rp = tl.arange(0, BP)
    valid = rp < P
    gamma = tl.load(GAMMA + row)
    base = HIST + row * (T + 1) * P
    scratch = SCRATCH + row * BP
    carry = tl.zeros([BP], tl.float32)                      # dL/dh_t coming from step t + 1
    dgamma = 0.0
    for i in range(0, T):
        t = T - 1 - i
        g_idx = row * T + t
        r, inc, dec, keep = tl.load(R + g_idx), tl.load(INC + g_idx), tl.load(DEC + g_idx), tl.load(KEEP + g_idx)
        prev = tl.load(base + t * P + rp, mask=valid, other=0.0)
        prev_m1 = tl.load(base + t * P + rp - 1, mask=valid & (rp >= 1), other=0.0)
        prev_p1 = tl.load(base + t * P + rp + 1, mask=(rp + 1) < P, other=0.0)
        u, up, down, moved, total = _stencil(prev, prev_m1, prev_p1, rp, r, inc, dec, keep, P)
        if HAS_COPY:
            pc = tl.load(PC + g_idx * (P + 1) + rp, mask=valid, other=0.0)
            nocopy = tl.load(PC + g_idx * (P + 1) + P)
            a = u * nocopy + total * pc + eps
        else:
            a = u + eps
        s = tl.where(valid, tl.exp2(gamma * tl.log2(a)), 0.0)
        z = tl.sum(s, 0)
        h = s / z
        g = tl.load(DHIST + (row * T + t) * P + rp, mask=valid, other=0.0) + carry
        ds = (g - tl.sum(g * h, 0)) / z                                                 # through s / sum(s)
        dgamma += tl.sum(tl.where(valid, ds * s * tl.log(a), 0.0), 0)
        du = tl.where(valid, ds * gamma * s / a, 0.0)                                   # through a^gamma
        dtotal = 0.0                        # through the copy mix's total (= sum of the previous h)
        if HAS_COPY:
            tl.store(DPC + g_idx * (P + 1) + rp, du * total, mask=valid)
            tl.store(DPC + g_idx * (P + 1) + P, tl.sum(du * u, 0))
            dtotal = tl.sum(du * pc, 0)
            du = du * nocopy
        du0 = tl.sum(tl.where(rp == 0, du, 0.0), 0)
        du1 = tl.sum(tl.where(rp == 1, du, 0.0), 0)
        tl.store(DKEEP + g_idx, (1 - r) * tl.sum(du * prev, 0) + du0 * total * r)
        tl.store(DINC + g_idx, (1 - r) * tl.sum(du * up, 0) + du1 * total * r)
        tl.store(DDEC + g_idx, (1 - r) * tl.sum(du * down, 0) + du0 * total * r)
        tl.store(DR + g_idx, -tl.sum(du * moved, 0) + du0 * total * (dec + keep) + du1 * total * inc)
        # the stencil's transpose: h[j] went to j (keep), j + 1 (inc) and j - 1 (dec), clamped
        tl.debug_barrier()
        tl.store(scratch + rp, du, mask=valid)
        tl.debug_barrier()
        du_p1 = tl.load(scratch + rp + 1, mask=(rp + 1) < P, other=0.0)                 # du[j + 1]
        du_m1 = tl.load(scratch + rp - 1, mask=valid & (rp >= 1), other=0.0)           # du[j - 1]
        d_up = du_p1 + tl.where(rp == P - 1, du, 0.0)
        d_down = du_m1 + tl.where(rp == 0, du, 0.0)
        carry = (1 - r) * (keep * du + inc * d_up + dec * d_down) + du0 * r * (dec + keep) + du1 * r * inc + dtotal
        carry = tl.where(valid, carry, 0.0)
    tl.store(DGAMMA + row, dgamma)


class HistogramScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, inc, dec, keep, gamma, p_copy, P, eps):
        BC, T = r.shape
        hist = torch.empty(BC, T + 1, P, device=r.device, dtype=torch.float32)
        BP = triton.next_power_of_2(P)
        has_copy = p_copy is not None
        pc = p_copy if has_copy else r                      # any tensor: unread without the copy branch
        _fwd[(BC,)](r, inc, dec, keep, gamma, pc, hist, T, eps, P=P, BP=BP, HAS_COPY=has_copy, num_warps=warps(BP))
        ctx.save_for_backward(r, inc, dec, keep, gamma, pc, hist)
        ctx.P, ctx.eps, ctx.has_copy = P, eps, has_copy
        return hist[:, 1:]

    @staticmethod
    def backward(ctx, dhist):
        r, inc, dec, keep, gamma, pc, hist = ctx.saved_tensors
        BC, T = r.shape
        P, BP = ctx.P, triton.next_power_of_2(ctx.P)
        grads = [torch.empty_like(r) for _ in range(4)]
        dgamma = torch.empty_like(gamma)
        dpc = torch.empty_like(pc) if ctx.has_copy else None
        scratch = torch.empty(BC, BP, device=r.device, dtype=torch.float32)
        _bwd[(BC,)](r, inc, dec, keep, gamma, pc, hist, dhist.contiguous().float(), scratch, *grads, dgamma,
                    dpc if ctx.has_copy else r, T, ctx.eps, P=P, BP=BP, HAS_COPY=ctx.has_copy, num_warps=warps(BP))
        return (*grads, dgamma, dpc, None, None)


@torch.compiler.disable   # --compile: inductor would pass the kernels' float arguments as fp64
def histogram_scan_triton(p_reset, p_inc, p_dec, p_keep, gamma, P: int, p_copy=None, eps: float = 1e-6):
    """prism.histogram_scan: gates (B, N, T), gamma broadcastable to (B, N), p_copy None or
    (B, N, T, P + 1) -> (B, N, T, P) float32."""
    B, N, T = p_reset.shape
    if P < 2:
        raise ValueError(f"a histogram needs at least 2 bins, got P={P}")
    flat = lambda x: x.float().reshape(B * N, T).contiguous()  # noqa: E731
    gamma = torch.as_tensor(gamma, device=p_reset.device).float().expand(B, N).reshape(B * N).contiguous()
    pc = None if p_copy is None else p_copy.float().reshape(B * N, T, P + 1).contiguous()   # (B*N, T, P + 1)
    hist = HistogramScan.apply(flat(p_reset), flat(p_inc), flat(p_dec), flat(p_keep), gamma, pc, P, eps)
    return hist.view(B, N, T, P)
