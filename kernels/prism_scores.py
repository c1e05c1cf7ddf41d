"""Triton kernels for PRISM's cursor scores before their normalisation (prism.cursor_scores), forward and
backward, without forming h G in memory.

For each pair of a query cursor and its key cursor (one batch row, head and cursor), with h_q, h_k their
histograms (T, P) and G = F F^T (P, P) the sinusoid table's Gram matrix (symmetric):

    dots = (h_q G) h_k^T                                   (T, T)   the cursor's <g_q, g_k>, g = h F
    sq_q = rowsum((h_q G) * h_q),  sq_k = rowsum((h_k G) * h_k)     (T)  each |g|^2

and back, from ddots (T, T) and dsq_q, dsq_k (T), as d(h G h'^T)/dh = h' G and d(h G h^T)/dh = 2 h G:

    dh_q = (ddots h_k + 2 dsq_q h_q) G          dh_k = (ddots^T h_q + 2 dsq_k h_k) G

The PyTorch path forms h G for every cursor, (2, B, H O, T, P) float32, writes it and reads it back forward
and backward, and its gradient as well; here it lives in registers, one block of BT tokens at a time. One
program per (pair, block of tokens): forward, its query rows of dots (looping over the key blocks) and the
squared norms of its tokens on both sides; backward, dh_q or dh_k of its tokens (a program per side, looping
over the other side's blocks). The whole P-bin histogram is one tile, so P <= MAX_BINS (prism.cursor_scores
takes the PyTorch path above). On a GPU the products are TF32 (as PyTorch's under --tf32; float32 products
of 128 x 128 tiles would spill registers); through the interpreter they are float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BINS = 128


@triton.jit
def _fwd(HIST, G, DOTS, SQ, T, P, NP, BT: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr):
    pair, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    q_base = HIST + pair * T * P                                # hist (2, B, H O, T, P): NP = B H O pairs a side
    k_base = HIST + (NP + pair) * T * P
    rt = blk * BT + tl.arange(0, BT)
    rp = tl.arange(0, BP)
    g = tl.load(G + rp[:, None] * P + rp[None, :], mask=(rp[:, None] < P) & (rp[None, :] < P), other=0.0)
    tile = (rt[:, None] < T) & (rp[None, :] < P)
    h_k = tl.load(k_base + rt[:, None] * P + rp[None, :], mask=tile, other=0.0)      # (BT, BP)
    tl.store(SQ + (NP + pair) * T + rt, tl.sum(tl.dot(h_k, g, input_precision=PREC) * h_k, 1), mask=rt < T)
    h_q = tl.load(q_base + rt[:, None] * P + rp[None, :], mask=tile, other=0.0)
    hg_q = tl.dot(h_q, g, input_precision=PREC)
    tl.store(SQ + pair * T + rt, tl.sum(hg_q * h_q, 1), mask=rt < T)
    for start in range(0, T, BT):                                # the key blocks
        rs = start + tl.arange(0, BT)
        other = tl.load(k_base + rs[:, None] * P + rp[None, :], mask=(rs[:, None] < T) & (rp[None, :] < P),
                        other=0.0)
        dots = tl.dot(hg_q, tl.trans(other), input_precision=PREC)                  # (BT, BT)
        tl.store(DOTS + pair * T * T + rt[:, None] * T + rs[None, :], dots, mask=(rt[:, None] < T) & (rs[None, :] < T))


@triton.jit
def _bwd(HIST, G, DDOTS, DSQ, DHIST, T, P, NP, BT: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr):
    pair, blk, side = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)   # side 0: dh_q, 1: dh_k
    own = pair + side * NP                                      # the cursor whose gradient this program writes
    far = pair + (1 - side) * NP                                # the other side of its pair
    st, ss = (T - side * (T - 1)), (1 + side * (T - 1))         # ddots[t, s] (side 0) or ddots[s, t] (side 1)
    rt = blk * BT + tl.arange(0, BT)
    rp = tl.arange(0, BP)
    tile = (rt[:, None] < T) & (rp[None, :] < P)
    h = tl.load(HIST + own * T * P + rt[:, None] * P + rp[None, :], mask=tile, other=0.0)        # (BT, BP)
    dsq = tl.load(DSQ + own * T + rt, mask=rt < T, other=0.0)
    acc = 2.0 * dsq[:, None] * h
    for start in range(0, T, BT):                                # the other side's blocks
        rs = start + tl.arange(0, BT)
        h_far = tl.load(HIST + far * T * P + rs[:, None] * P + rp[None, :], mask=(rs[:, None] < T) & (rp[None, :] < P),
                        other=0.0)
        d = tl.load(DDOTS + pair * T * T + rt[:, None] * st + rs[None, :] * ss,
                    mask=(rt[:, None] < T) & (rs[None, :] < T), other=0.0)                 # (BT, BT)
        acc += tl.dot(d, h_far, input_precision=PREC)
    g = tl.load(G + rp[:, None] * P + rp[None, :], mask=(rp[:, None] < P) & (rp[None, :] < P), other=0.0)
    tl.store(DHIST + own * T * P + rt[:, None] * P + rp[None, :], tl.dot(acc, g, input_precision=PREC), mask=tile)


def _blocks(T: int, P: int) -> tuple[int, int]:
    return min(64, max(16, triton.next_power_of_2(T))), max(16, triton.next_power_of_2(P))


WARPS, STAGES = 8, 1   # where both kernels compile for sm_90 without spilled registers (docs/perf/prism.md)


def _precision(x) -> str:
    return "tf32" if x.is_cuda else "ieee"


class CursorDots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hist, gram):
        _, B, HO, T, P = hist.shape
        BT, BP = _blocks(T, P)
        dots = torch.empty(B * HO, T, T, device=hist.device, dtype=torch.float32)
        sq = torch.empty(2, B, HO, T, device=hist.device, dtype=torch.float32)
        _fwd[(B * HO, triton.cdiv(T, BT))](hist, gram, dots, sq, T, P, B * HO, BT=BT, BP=BP, PREC=_precision(hist),
                                           num_warps=WARPS, num_stages=STAGES)
        ctx.save_for_backward(hist, gram)
        return dots, sq

    @staticmethod
    def backward(ctx, ddots, dsq):
        hist, gram = ctx.saved_tensors
        _, B, HO, T, P = hist.shape
        BT, BP = _blocks(T, P)
        ddots = torch.zeros(B * HO, T, T, device=hist.device) if ddots is None else ddots.float().contiguous()
        dsq = torch.zeros_like(hist[..., 0]) if dsq is None else dsq.float().contiguous()
        dhist = torch.empty_like(hist)
        _bwd[(B * HO, triton.cdiv(T, BT), 2)](hist, gram, ddots, dsq, dhist, T, P, B * HO, BT=BT, BP=BP,
                                              PREC=_precision(hist), num_warps=WARPS, num_stages=STAGES)
        return dhist, None


@torch.compiler.disable   # --compile: one call of the kernels, as the histogram scan's
def cursor_dots_triton(hist, gram, H: int):
    """hist (2, B, H O, T, P) float32, the query cursors (side 0) and the key cursors (side 1); gram (P, P)
    symmetric, P <= MAX_BINS -> dots (B, H, O, T, T) = each cursor pair's (h_q G) h_k^T, and sq (2, B, H O, T) =
    each cursor's h G h^T. No gradient flows to gram (a fixed table)."""
    _, B, HO, T, P = hist.shape
    if P > MAX_BINS:
        raise ValueError(f"the Triton cursor scores take at most {MAX_BINS} bins, got {P}")
    dots, sq = CursorDots.apply(hist.float().contiguous(), gram.float().contiguous())
    return dots.view(B, H, HO // H, T, T), sq
