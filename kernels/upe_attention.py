"""Triton kernels for RPE / UPE attention: FlashAttention with gathered position logits.

The logit of query i and key j is (q_i . k_j + t_ij) * scale, where t_ij is looked up in per-query
tables that `upe_attention_triton` builds with PyTorch matmuls (autograd carries their gradient on):

    QR: (B*H, T, 2K+1)  column c = clip(j - i, -K, K) + K holds q_i . R[2K - c] = q_i . R[o] for the
                        clipped offset o = clip(i - j, -K, K) + K
    QC: (B*H, T, M)     q_i . C[m]  used instead when key j has slot m >= 0

so no (T, T, D) or (T, T) tensor exists. Forward: one program per (query block, batch*head), online
softmax over the key blocks. Backward: `_bwd_dq` (per query block: dQ and the table gradients
dQR / dQC, no atomics: the program owns its query rows; the entries that clipping or slots share
are summed in registers), then `_bwd_dkv` (per key block: dK, dV in registers). The caller pads T
to the largest tile with masked keys.

QR is q R^T with R in reverse order, so that along a query's row the columns of consecutive keys are
consecutive and ascending. The compiler then lays out the stores of the table gradient in the clip
band along the keys, and they coalesce. In the natural order they ran backwards and were scattered:
the dQ kernel took 10.5 ms at T = 4096 on an H100, against 6.5 ms reversed (same tiles).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


# Each program walks its step tiles in three runs (`_runs`): tiles wholly clipped at one end, the
# tiles of the clip band, tiles wholly clipped at the other end. MODE says which: 0 for keys far left,
# j - i <= -K (table column 0), 1 for the band, 2 for keys far right, j - i >= K (column 2K). In a
# clipped run every logit of a row gets the same table entry, loaded once, so only the band gathers.
@triton.jit
def _runs(p0, start, end, K: tl.constexpr, OWN: tl.constexpr, STEP: tl.constexpr):
    """Split the step tiles [start, end) of a program whose own block starts at p0 into the three
    runs: tiles before `a` lie wholly beyond K on the side of smaller step positions, tiles from `b`
    on wholly beyond K on the other side (both multiples of STEP)."""
    a = tl.maximum(p0 - K + 1, 0) // STEP * STEP
    b = (p0 + OWN - 1 + K + STEP - 1) // STEP * STEP
    a = tl.minimum(tl.maximum(a, start), end)
    b = tl.minimum(tl.maximum(b, a), end)
    return a, b


@triton.jit
def _logits(a, b, ii, jj, t_lo, t_hi, TR, TC, SLOTB, MASKB, bh, T, j0, s_lo, s_hi, qk_scale,
            NR: tl.constexpr, NC: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, MODE: tl.constexpr,
            HAS_UNI: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """Base-2 logits a b^T of one tile of KB keys from j0, masked, in either orientation: (a, b) =
    (q, k) with query positions ii = i[:, None] and key positions jj = j[None, :], or (k, q) with
    ii = i[None, :] and jj = j[:, None]. t_lo, t_hi (shaped like ii): the table entries of columns 0
    and 2K of each query, used in the clipped runs; the band gathers. Keys with a slot (those in
    [s_lo, s_hi) of this batch row may have one) take q.C[slot] instead."""
    s = tl.dot(a, tl.trans(b), input_precision=PREC)
    row = bh * T + ii                                        # the queries' table rows
    if MODE == 1:
        t = tl.load(TR + row * NR + K + tl.minimum(tl.maximum(jj - ii, -K), K)).to(tl.float32)
    elif MODE == 0:
        t = t_lo + tl.zeros_like(s)                          # (the compiler wants one shape in all three)
    else:
        t = t_hi + tl.zeros_like(s)
    if HAS_UNI:
        if (j0 < s_hi) & (j0 + KB > s_lo):                   # only tiles that may hold slot keys
            sl = tl.load(SLOTB + jj)
            t = tl.where(sl >= 0, tl.load(TC + row * NC + tl.maximum(sl, 0)).to(tl.float32), t)
    s = (s + t) * qk_scale
    if HAS_MASK:                                             # a key padding mask or padded keys
        s = tl.where(tl.load(MASKB + jj) != 0, s, float("-inf"))
    if CAUSAL:
        s = tl.where(jj <= ii, s, float("-inf"))
    return s


@triton.jit
def _fwd_tile(q, acc, mx, lsum, t_lo, t_hi, KP, V, TR, TC, SLOTB, MASKB, bh, T, i_pos, j0, s_lo, s_hi,
              qk_scale, NR: tl.constexpr, NC: tl.constexpr, K: tl.constexpr, D: tl.constexpr,
              BN: tl.constexpr, MODE: tl.constexpr, HAS_UNI: tl.constexpr, HAS_MASK: tl.constexpr,
              CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """One step of the online softmax over the keys j0 ... j0 + BN - 1."""
    rd = tl.arange(0, D)
    j_pos = j0 + tl.arange(0, BN)
    k = tl.load(KP + (bh * T + j_pos)[:, None] * D + rd[None, :])
    s = _logits(q, k, i_pos[:, None], j_pos[None, :], t_lo[:, None], t_hi[:, None], TR, TC, SLOTB, MASKB, bh,
                T, j0, s_lo, s_hi, qk_scale, NR, NC, K, BN, MODE, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    mnew = tl.maximum(mx, tl.max(s, 1))
    m_safe = tl.where(mnew == float("-inf"), 0.0, mnew)          # no key seen yet in this row
    alpha = tl.exp2(mx - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    v = tl.load(V + (bh * T + j_pos)[:, None] * D + rd[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, mnew, lsum


@triton.jit
def _fwd(Q, KP, V, TR, TE, TC, SLOT, SRANGE, MASK, O, LSE, T, H, qk_scale,
         NR: tl.constexpr, NC: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
         BN: tl.constexpr, HAS_UNI: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
         PREC: tl.constexpr):
    """One program per (block of BM queries, batch*head), stepping over keys BN at a time."""
    i, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b = bh // H
    rd = tl.arange(0, D)
    i_pos = i * BM + tl.arange(0, BM)
    row = bh * T + i_pos
    q = tl.load(Q + row[:, None] * D + rd[None, :])
    t_lo, t_hi = tl.load(TE + row * 2).to(tl.float32), tl.load(TE + row * 2 + 1).to(tl.float32)
    s_lo, s_hi = tl.load(SRANGE + 2 * b), tl.load(SRANGE + 2 * b + 1)
    SLOTB, MASKB = SLOT + b * T, MASK + b * T
    mx = tl.full([BM], float("-inf"), tl.float32)
    lsum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    n_keys = (i + 1) * BM if CAUSAL else T
    a, c = _runs(i * BM, 0, n_keys, K, BM, BN)
    for j0 in range(0, a, BN):                                   # keys far left: j - i <= -K
        acc, mx, lsum = _fwd_tile(q, acc, mx, lsum, t_lo, t_hi, KP, V, TR, TC, SLOTB, MASKB, bh, T, i_pos,
                                  j0, s_lo, s_hi, qk_scale, NR, NC, K, D, BN, 0, HAS_UNI, HAS_MASK,
                                  CAUSAL, PREC)
    for j0 in range(a, c, BN):                                   # the clip band
        acc, mx, lsum = _fwd_tile(q, acc, mx, lsum, t_lo, t_hi, KP, V, TR, TC, SLOTB, MASKB, bh, T, i_pos,
                                  j0, s_lo, s_hi, qk_scale, NR, NC, K, D, BN, 1, HAS_UNI, HAS_MASK,
                                  CAUSAL, PREC)
    for j0 in range(c, n_keys, BN):                              # keys far right: j - i >= K
        acc, mx, lsum = _fwd_tile(q, acc, mx, lsum, t_lo, t_hi, KP, V, TR, TC, SLOTB, MASKB, bh, T, i_pos,
                                  j0, s_lo, s_hi, qk_scale, NR, NC, K, D, BN, 2, HAS_UNI, HAS_MASK,
                                  CAUSAL, PREC)
    tl.store(O + row[:, None] * D + rd[None, :], (acc / lsum[:, None]).to(O.dtype.element_ty))
    tl.store(LSE + row, mx + tl.log2(lsum))


@triton.jit
def _dq_tile(q, do, lse, delta, dq, d_lo, d_hi, d_uni, t_lo, t_hi, KP, V, TR, DTR, TC, SLOTB, MASKB, bh, T,
             row, i_pos, j0, s_lo, s_hi, qk_scale, scale, NR: tl.constexpr, NC: tl.constexpr,
             NCP: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr,
             HAS_UNI: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """The keys j0 ... j0 + BN - 1 of `_bwd_dq`: their share of dQ and of the table gradients."""
    rd = tl.arange(0, D)
    j_pos = j0 + tl.arange(0, BN)
    col = bh * T + j_pos
    k = tl.load(KP + col[:, None] * D + rd[None, :])
    s = _logits(q, k, i_pos[:, None], j_pos[None, :], t_lo[:, None], t_hi[:, None], TR, TC, SLOTB, MASKB, bh,
                T, j0, s_lo, s_hi, qk_scale, NR, NC, K, BN, MODE, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    p = tl.exp2(s - lse[:, None])
    v = tl.load(V + col[:, None] * D + rd[None, :])
    ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None]) * scale  # d(raw logit)
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    if HAS_UNI:
        if (j0 < s_hi) & (j0 + BN > s_lo):               # this tile may hold slot keys
            sl = tl.load(SLOTB + j_pos)
            ru = tl.arange(0, NCP)
            for m in tl.static_range(NC):
                dm = tl.sum(tl.where(sl[None, :] == m, ds, 0.0), 1)                       # (BM,)
                d_uni += tl.where(ru[None, :] == m, dm[:, None], 0.0)
            ds = tl.where(sl[None, :] < 0, ds, 0.0)      # keys with a slot use no relative vector
    if MODE == 0:
        d_lo += tl.sum(ds, 1)
    elif MODE == 2:
        d_hi += tl.sum(ds, 1)
    else:
        dif = j_pos[None, :] - i_pos[:, None]            # (BM, BN): j - i
        d_lo += tl.sum(tl.where(dif <= -K, ds, 0.0), 1)
        d_hi += tl.sum(tl.where(dif >= K, ds, 0.0), 1)
        tl.store(DTR + row[:, None] * NR + K + dif, ds, mask=(dif > -K) & (dif < K))
    return dq, d_lo, d_hi, d_uni


@triton.jit
def _bwd_dq(Q, KP, V, TR, TE, TC, SLOT, SRANGE, MASK, O, DO, LSE, DELTA, DQ, DTR, DTC, T, H, qk_scale,
            scale, NR: tl.constexpr, NC: tl.constexpr, NCP: tl.constexpr, K: tl.constexpr,
            D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_UNI: tl.constexpr,
            HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """dQ and the table gradients of BM queries, without atomics: inside the clip band each
    (query, offset) entry of dQR comes from exactly one key, so it is stored directly; the two clipped
    entries (offsets -K and K) and the slot entries dQC are summed in registers and stored once.
    Also stores delta = rowsum(dO * O) of its rows for `_bwd_dkv`, which runs after it."""
    i, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b = bh // H
    rd = tl.arange(0, D)
    i_pos = i * BM + tl.arange(0, BM)
    row = bh * T + i_pos
    q = tl.load(Q + row[:, None] * D + rd[None, :])
    do = tl.load(DO + row[:, None] * D + rd[None, :])
    lse = tl.load(LSE + row)
    delta = tl.sum(do.to(tl.float32) * tl.load(O + row[:, None] * D + rd[None, :]).to(tl.float32), 1)
    tl.store(DELTA + row, delta)
    t_lo, t_hi = tl.load(TE + row * 2).to(tl.float32), tl.load(TE + row * 2 + 1).to(tl.float32)
    s_lo, s_hi = tl.load(SRANGE + 2 * b), tl.load(SRANGE + 2 * b + 1)
    SLOTB, MASKB = SLOT + b * T, MASK + b * T
    dq = tl.zeros([BM, D], tl.float32)
    d_lo = tl.zeros([BM], tl.float32)                    # dQR[:, 0]:  j - i <= -K
    d_hi = tl.zeros([BM], tl.float32)                    # dQR[:, 2K]: j - i >= K
    d_uni = tl.zeros([BM, NCP], tl.float32)              # dQC
    n_keys = (i + 1) * BM if CAUSAL else T
    a, c = _runs(i * BM, 0, n_keys, K, BM, BN)
    for j0 in range(0, a, BN):
        dq, d_lo, d_hi, d_uni = _dq_tile(q, do, lse, delta, dq, d_lo, d_hi, d_uni, t_lo, t_hi, KP, V, TR, DTR,
                                         TC, SLOTB, MASKB, bh, T, row, i_pos, j0, s_lo, s_hi, qk_scale, scale,
                                         NR, NC, NCP, K, D, BN, 0, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    for j0 in range(a, c, BN):
        dq, d_lo, d_hi, d_uni = _dq_tile(q, do, lse, delta, dq, d_lo, d_hi, d_uni, t_lo, t_hi, KP, V, TR, DTR,
                                         TC, SLOTB, MASKB, bh, T, row, i_pos, j0, s_lo, s_hi, qk_scale, scale,
                                         NR, NC, NCP, K, D, BN, 1, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    for j0 in range(c, n_keys, BN):
        dq, d_lo, d_hi, d_uni = _dq_tile(q, do, lse, delta, dq, d_lo, d_hi, d_uni, t_lo, t_hi, KP, V, TR, DTR,
                                         TC, SLOTB, MASKB, bh, T, row, i_pos, j0, s_lo, s_hi, qk_scale, scale,
                                         NR, NC, NCP, K, D, BN, 2, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    tl.store(DQ + row[:, None] * D + rd[None, :], dq)
    tl.store(DTR + row * NR, d_lo)
    tl.store(DTR + row * NR + 2 * K, d_hi)
    if HAS_UNI:
        ru = tl.arange(0, NCP)
        tl.store(DTC + row[:, None] * NC + ru[None, :], d_uni, mask=ru[None, :] < NC)


@triton.jit
def _dkv_tile(k, v, dk, dv, Q, DO, LSE, DELTA, TR, TE, TC, SLOTB, MASKB, bh, T, j_pos, j0, i0, s_lo, s_hi,
              qk_scale, scale, NR: tl.constexpr, NC: tl.constexpr, K: tl.constexpr, D: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr, HAS_UNI: tl.constexpr,
              HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """The queries i0 ... i0 + BN - 1 of `_bwd_dkv`: their share of dK and dV. The tile is kept
    transposed (keys x queries), so that P^T and dS^T are left operands as computed."""
    rd = tl.arange(0, D)
    i_pos = i0 + tl.arange(0, BN)
    row = bh * T + i_pos
    q = tl.load(Q + row[:, None] * D + rd[None, :])
    t_lo, t_hi = tl.load(TE + row * 2).to(tl.float32), tl.load(TE + row * 2 + 1).to(tl.float32)
    st = _logits(k, q, i_pos[None, :], j_pos[:, None], t_lo[None, :], t_hi[None, :], TR, TC, SLOTB, MASKB, bh,
                 T, j0, s_lo, s_hi, qk_scale, NR, NC, K, BM, MODE, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    pt = tl.exp2(st - tl.load(LSE + row)[None, :])
    do = tl.load(DO + row[:, None] * D + rd[None, :])
    dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
    dst = pt * (tl.dot(v, tl.trans(do), input_precision=PREC) - tl.load(DELTA + row)[None, :]) * scale
    dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
    return dk, dv


@triton.jit
def _bwd_dkv(Q, KP, V, TR, TE, TC, SLOT, SRANGE, MASK, DO, LSE, DELTA, DK, DV, T, H, qk_scale, scale,
             NR: tl.constexpr, NC: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, HAS_UNI: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
             PREC: tl.constexpr):
    """dK and dV of one block of BM keys, stepping over queries BN at a time."""
    j, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b = bh // H
    rd = tl.arange(0, D)
    j_pos = j * BM + tl.arange(0, BM)
    col = bh * T + j_pos
    k = tl.load(KP + col[:, None] * D + rd[None, :])
    v = tl.load(V + col[:, None] * D + rd[None, :])
    s_lo, s_hi = tl.load(SRANGE + 2 * b), tl.load(SRANGE + 2 * b + 1)
    SLOTB, MASKB = SLOT + b * T, MASK + b * T
    dk = tl.zeros([BM, D], tl.float32)
    dv = tl.zeros([BM, D], tl.float32)
    i_start = j * BM if CAUSAL else 0
    a, c = _runs(j * BM, i_start, T, K, BM, BN)
    for i0 in range(i_start, a, BN):                             # queries far left: j - i >= K
        dk, dv = _dkv_tile(k, v, dk, dv, Q, DO, LSE, DELTA, TR, TE, TC, SLOTB, MASKB, bh, T, j_pos, j * BM, i0,
                           s_lo, s_hi, qk_scale, scale, NR, NC, K, D, BM, BN, 2, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    for i0 in range(a, c, BN):
        dk, dv = _dkv_tile(k, v, dk, dv, Q, DO, LSE, DELTA, TR, TE, TC, SLOTB, MASKB, bh, T, j_pos, j * BM, i0,
                           s_lo, s_hi, qk_scale, scale, NR, NC, K, D, BM, BN, 1, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    for i0 in range(c, T, BN):                                   # queries far right: j - i <= -K
        dk, dv = _dkv_tile(k, v, dk, dv, Q, DO, LSE, DELTA, TR, TE, TC, SLOTB, MASKB, bh, T, j_pos, j * BM, i0,
                           s_lo, s_hi, qk_scale, scale, NR, NC, K, D, BM, BN, 0, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    tl.store(DK + col[:, None] * D + rd[None, :], dk)
    tl.store(DV + col[:, None] * D + rd[None, :], dv)


# Tiles and launch settings of each kernel: (own block, step block, warps, pipeline stages). The own
# block is the program's rows (queries in _fwd and _bwd_dq, keys in _bwd_dkv), the step block the
# tile it walks over. D <= 64: the best of a sweep on an H100 at T = 4096, dq swept again after the
# tables were reversed (docs/results/upe_tile_sweep.txt); D = 128: smaller tiles for the registers,
# not swept.
CONFIGS = {64: dict(fwd=(64, 64, 4, 3), dq=(64, 32, 4, 3), dkv=(64, 64, 4, 2)),       # D <= 64
           128: dict(fwd=(64, 32, 4, 2), dq=(64, 32, 4, 2), dkv=(64, 32, 4, 2))}


def launch_configs(D: int, T: int, block=None) -> dict:
    """The settings of the three kernels for head dim D and length T. `block` (an int C, or a pair
    (own, step)) forces the tiles of all three, as the tests do; short inputs get smaller tiles."""
    if block is not None:
        own, step = (block, block) if isinstance(block, int) else block
        return {name: (own, step, 4, 2) for name in ("fwd", "dq", "dkv")}
    fit = max(16, triton.next_power_of_2(T))
    return {name: (min(own, fit), min(step, fit), warps, stages)
            for name, (own, step, warps, stages) in CONFIGS[64 if D <= 64 else 128].items()}


class UPEFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tr, tc, slot, srange, mask, has_mask, H, K, scale, causal, cfg):
        BH, T, D = q.shape
        has_uni = tc is not None
        prec = "ieee" if q.dtype == torch.float32 else None
        o = torch.empty_like(q)
        lse = torch.empty(BH, T, device=q.device, dtype=torch.float32)
        te = torch.stack((tr[..., 0], tr[..., 2 * K]), -1)      # (BH, T, 2): the two clipped entries
        tc_ = tc if has_uni else tr
        meta = dict(NR=tr.shape[-1], NC=tc_.shape[-1], K=K, D=D, HAS_UNI=has_uni, HAS_MASK=has_mask,
                    CAUSAL=causal, PREC=prec)
        own, step, warps, stages = cfg["fwd"]
        _fwd[(T // own, BH)](q, k, v, tr, te, tc_, slot, srange, mask, o, lse, T, H, scale * 1.4426950408889634,
                             **meta, BM=own, BN=step, num_warps=warps, num_stages=stages)
        ctx.save_for_backward(q, k, v, tr, te, tc_, slot, srange, mask, o, lse)
        ctx.meta, ctx.H, ctx.scale, ctx.has_uni, ctx.cfg = meta, H, scale, has_uni, cfg
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, tr, te, tc, slot, srange, mask, o, lse = ctx.saved_tensors
        meta, H, scale, cfg = ctx.meta, ctx.H, ctx.scale, ctx.cfg
        BH, T, D = q.shape
        do = do.contiguous()
        delta = torch.empty(BH, T, device=q.device, dtype=torch.float32)   # written by _bwd_dq
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))   # the kernels accumulate in float32
        dtr, dtc = torch.zeros_like(tr), torch.zeros_like(tc)
        args = (T, H, scale * 1.4426950408889634, scale)
        ncp = triton.next_power_of_2(meta["NC"]) if ctx.has_uni else 1
        own, step, warps, stages = cfg["dq"]
        _bwd_dq[(T // own, BH)](q, k, v, tr, te, tc, slot, srange, mask, o, do, lse, delta, dq, dtr, dtc, *args,
                                NCP=ncp, **meta, BM=own, BN=step, num_warps=warps, num_stages=stages)
        own, step, warps, stages = cfg["dkv"]
        _bwd_dkv[(T // own, BH)](q, k, v, tr, te, tc, slot, srange, mask, do, lse, delta, dk, dv, *args, **meta,
                                 BM=own, BN=step, num_warps=warps, num_stages=stages)
        return (dq, dk, dv, dtr, dtc if ctx.has_uni else None,
                None, None, None, None, None, None, None, None, None)


def upe_attention_triton(q, k, v, rel, uni=None, slot=None, key_mask=None, causal=False, block=None):
    """Same contract as upe.upe_attention_naive. The tables q R^T and q C^T are built here
    (autograd carries their gradient to q, R and C). `block`: see `launch_configs`."""
    B, H, T, D = q.shape
    if D not in (16, 32, 64, 128):
        raise ValueError(f"the UPE Triton kernel takes head dims 16, 32, 64 or 128, got {D}")
    cfg = launch_configs(D, T, block)
    for own, step, _, _ in cfg.values():
        if own % step:
            raise ValueError(f"the own block must be a multiple of the step block, got {own} and {step}")
    pad = -T % max(own for own, _, _, _ in cfg.values())
    Tp = T + pad
    K = (rel.shape[1] - 1) // 2
    mask = torch.ones(B, T, dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    mask = F.pad(mask, (0, pad)).to(torch.int8).contiguous()                  # padded keys: masked
    slot_ = torch.full((B, T), -1, dtype=torch.long, device=q.device) if slot is None else slot
    slot_ = F.pad(slot_, (0, pad), value=-1).to(torch.int32).contiguous()
    pos = torch.arange(Tp, device=q.device, dtype=torch.int32)
    srange = torch.stack((torch.where(slot_ >= 0, pos, Tp).amin(1),          # (B, 2): where slot keys
                          torch.where(slot_ >= 0, pos + 1, 0).amax(1)), 1).to(torch.int32).contiguous()
    qp, kp, vp = (F.pad(x, (0, 0, 0, pad)) if pad else x for x in (q, k, v))
    # bf16 inputs get bf16 tables (their rounding is that of the bf16 q.k products; half the traffic),
    # everything else float32. Zero rows pad the tables to a multiple of 8 columns: aligned rows let
    # the matmuls use their fast kernels; the padding columns are never read.
    tdt = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32

    def table(vecs):                                        # (H, N, D) -> (B, H, Tp, N + pad)
        return qp.to(tdt) @ F.pad(vecs.to(tdt), (0, 0, 0, -vecs.shape[1] % 8)).transpose(-1, -2)[None]

    tr = table(rel.flip(1)).reshape(B * H, Tp, -1)          # (B*H, Tp, 2K+1 + pad), R reversed
    tc = None
    if uni is not None and slot is not None:
        tc = table(uni).reshape(B * H, Tp, -1)              # (B*H, Tp, M + pad)
    flat = lambda x: x.reshape(B * H, Tp, D).contiguous()  # noqa: E731
    has_mask = key_mask is not None or pad > 0
    o = UPEFlash.apply(flat(qp), flat(kp), flat(vp), tr, tc, slot_, srange, mask, has_mask, H, K, D ** -0.5,
                       causal, cfg)
    return o.view(B, H, Tp, D)[:, :, :T]
