"""Triton kernels for RPE / UPE attention: FlashAttention with gathered position logits.

The logit of query i and key j is (q_i . k_j + t_ij) * scale, where t_ij is looked up in per-query
tables built by PyTorch (upe.py differentiates them with autograd):

    QR: (B*H, T, 2K+1)  q_i . R[o]  for the clipped offset o = clip(i - j, -K, K) + K
    QC: (B*H, T, M)     q_i . C[m]  used instead when key j has slot m >= 0

so no (T, T, D) or (T, T) tensor exists. Forward: one program per (query block, batch*head), online
softmax over the key blocks. Backward: `_bwd_dq` (per query block: dQ and the table gradients
dQR / dQC, no atomics: the program owns its query rows; the entries that clipping or slots share
are summed in registers), then `_bwd_dkv` (per key block: dK, dV in registers). The caller pads T
to the block with masked keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _offset(i_pos, j_pos, K: tl.constexpr):
    """The table column of each (query, key) pair: clip(i - j, -K, K) + K."""
    return tl.minimum(tl.maximum(i_pos[:, None] - j_pos[None, :], -K), K) + K


@triton.jit
def _logits(q, k, TR, TC, SLOTB, MASKB, row, i_pos, j_pos, d0, qk_scale,
            NR: tl.constexpr, NC: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
            HAS_UNI: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """Base-2 logits of one (query block, key block) tile, masked, and the key slots. The tile
    spans i - j in d0 -+ (C - 1), d0 = (first query) - (first key)."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if d0 - (C - 1) >= K:                                    # whole tile clipped: one entry per row
        t = tl.broadcast_to(tl.load(TR + row * NR + 2 * K).to(tl.float32)[:, None], (C, C))
    elif d0 + (C - 1) <= -K:
        t = tl.broadcast_to(tl.load(TR + row * NR).to(tl.float32)[:, None], (C, C))
    else:                                                    # inside the clip band: gather
        t = tl.load(TR + row[:, None] * NR + _offset(i_pos, j_pos, K)).to(tl.float32)
    sl = tl.load(SLOTB + j_pos)                                                         # (C,) key slots
    if HAS_UNI:
        if tl.max(sl, 0) >= 0:                               # only tiles holding slot keys read QC
            tc = tl.load(TC + row[:, None] * NC + tl.maximum(sl, 0)[None, :]).to(tl.float32)
            t = tl.where(sl[None, :] >= 0, tc, t)
    s = (s + t) * qk_scale
    if HAS_MASK:                                             # a key padding mask or padded keys
        s = tl.where((tl.load(MASKB + j_pos) != 0)[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(j_pos[None, :] <= i_pos[:, None], s, float("-inf"))
    return s, sl


@triton.jit
def _fwd(Q, KP, V, TR, TC, SLOT, MASK, O, LSE, T, H, qk_scale,
         NR: tl.constexpr, NC: tl.constexpr, K: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
         HAS_UNI: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    i, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b = bh // H
    rc, rd = tl.arange(0, C), tl.arange(0, D)
    i_pos = i * C + rc
    row = bh * T + i_pos
    q = tl.load(Q + row[:, None] * D + rd[None, :])
    mx = tl.full([C], float("-inf"), tl.float32)
    lsum = tl.zeros([C], tl.float32)
    acc = tl.zeros([C, D], tl.float32)
    n_keys = (i + 1) * C if CAUSAL else T
    for j0 in range(0, n_keys, C):
        j_pos = j0 + rc
        k = tl.load(KP + (bh * T + j_pos)[:, None] * D + rd[None, :])
        s, _ = _logits(q, k, TR, TC, SLOT + b * T, MASK + b * T, row, i_pos, j_pos, i * C - j0,
                       qk_scale, NR, NC, K, C, HAS_UNI, HAS_MASK, CAUSAL, PREC)
        mnew = tl.maximum(mx, tl.max(s, 1))
        m_safe = tl.where(mnew == float("-inf"), 0.0, mnew)          # no key seen yet in this row
        alpha = tl.exp2(mx - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        v = tl.load(V + (bh * T + j_pos)[:, None] * D + rd[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        mx = mnew
    tl.store(O + row[:, None] * D + rd[None, :], (acc / lsum[:, None]).to(O.dtype.element_ty))
    tl.store(LSE + row, mx + tl.log2(lsum))


@triton.jit
def _bwd_dq(Q, KP, V, TR, TC, SLOT, MASK, O, DO, LSE, DELTA, DQ, DTR, DTC, T, H, qk_scale, scale,
            NR: tl.constexpr, NC: tl.constexpr, NCP: tl.constexpr, K: tl.constexpr, D: tl.constexpr,
            C: tl.constexpr, HAS_UNI: tl.constexpr, HAS_MASK: tl.constexpr,
            CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """dQ and the table gradients of one query block, without atomics: inside the clip band each
    (query, offset) entry of dQR comes from exactly one key, so it is stored directly; the two clipped
    entries (offsets -K and K) and the slot entries dQC are summed in registers and stored once.
    Also stores delta = rowsum(dO * O) of its rows for `_bwd_dkv`, which runs after it."""
    i, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b = bh // H
    rc, rd = tl.arange(0, C), tl.arange(0, D)
    i_pos = i * C + rc
    row = bh * T + i_pos
    q = tl.load(Q + row[:, None] * D + rd[None, :])
    do = tl.load(DO + row[:, None] * D + rd[None, :])
    lse = tl.load(LSE + row)
    delta = tl.sum(do.to(tl.float32) * tl.load(O + row[:, None] * D + rd[None, :]).to(tl.float32), 1)
    tl.store(DELTA + row, delta)
    dq = tl.zeros([C, D], tl.float32)
    d_lo = tl.zeros([C], tl.float32)                     # dQR[:, 0]:  i - j <= -K
    d_hi = tl.zeros([C], tl.float32)                     # dQR[:, 2K]: i - j >= K
    rm = tl.arange(0, NCP)
    d_uni = tl.zeros([C, NCP], tl.float32)               # dQC
    n_keys = (i + 1) * C if CAUSAL else T
    for j0 in range(0, n_keys, C):
        j_pos = j0 + rc
        col = bh * T + j_pos
        k = tl.load(KP + col[:, None] * D + rd[None, :])
        s, sl = _logits(q, k, TR, TC, SLOT + b * T, MASK + b * T, row, i_pos, j_pos, i * C - j0,
                        qk_scale, NR, NC, K, C, HAS_UNI, HAS_MASK, CAUSAL, PREC)
        p = tl.exp2(s - lse[:, None])
        v = tl.load(V + col[:, None] * D + rd[None, :])
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None]) * scale  # d(raw logit)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        if HAS_UNI:
            if tl.max(sl, 0) >= 0:                       # this tile holds slot keys
                for m in tl.static_range(NC):
                    dm = tl.sum(tl.where(sl[None, :] == m, ds, 0.0), 1)                   # (C,)
                    d_uni += tl.where(rm[None, :] == m, dm[:, None], 0.0)
                ds = tl.where(sl[None, :] < 0, ds, 0.0)  # keys with a slot use no relative vector
        d0 = i * C - j0
        if d0 - (C - 1) >= K:                            # whole tile clipped at +K
            d_hi += tl.sum(ds, 1)
        elif d0 + (C - 1) <= -K:                         # whole tile clipped at -K
            d_lo += tl.sum(ds, 1)
        else:
            off = _offset(i_pos, j_pos, K)               # (C, C)
            d_lo += tl.sum(tl.where(off == 0, ds, 0.0), 1)
            d_hi += tl.sum(tl.where(off == 2 * K, ds, 0.0), 1)
            tl.store(DTR + row[:, None] * NR + off, ds, mask=(off > 0) & (off < 2 * K))
    tl.store(DQ + row[:, None] * D + rd[None, :], dq)
    tl.store(DTR + row * NR, d_lo)
    tl.store(DTR + row * NR + 2 * K, d_hi)
    if HAS_UNI:
        tl.store(DTC + row[:, None] * NC + rm[None, :], d_uni, mask=rm[None, :] < NC)


@triton.jit
def _bwd_dkv(Q, KP, V, TR, TC, SLOT, MASK, DO, LSE, DELTA, DK, DV, T, H, qk_scale, scale,
             NR: tl.constexpr, NC: tl.constexpr, K: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
             HAS_UNI: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    j, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b = bh // H
    rc, rd = tl.arange(0, C), tl.arange(0, D)
    j_pos = j * C + rc
    col = bh * T + j_pos
    k = tl.load(KP + col[:, None] * D + rd[None, :])
    v = tl.load(V + col[:, None] * D + rd[None, :])
    dk = tl.zeros([C, D], tl.float32)
    dv = tl.zeros([C, D], tl.float32)
    i_start = j * C if CAUSAL else 0
    for i0 in range(i_start, T, C):
        i_pos = i0 + rc
        row = bh * T + i_pos
        q = tl.load(Q + row[:, None] * D + rd[None, :])
        s, _ = _logits(q, k, TR, TC, SLOT + b * T, MASK + b * T, row, i_pos, j_pos, i0 - j * C,
                       qk_scale, NR, NC, K, C, HAS_UNI, HAS_MASK, CAUSAL, PREC)
        p = tl.exp2(s - tl.load(LSE + row)[:, None])
        do = tl.load(DO + row[:, None] * D + rd[None, :])
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - tl.load(DELTA + row)[:, None]) * scale
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC)
    tl.store(DK + col[:, None] * D + rd[None, :], dk)
    tl.store(DV + col[:, None] * D + rd[None, :], dv)


class UPEFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tr, tc, slot, mask, has_mask, H, K, scale, causal, C):
        BH, T, D = q.shape
        has_uni = tc is not None
        prec = "ieee" if q.dtype == torch.float32 else None
        o = torch.empty_like(q)
        lse = torch.empty(BH, T, device=q.device, dtype=torch.float32)
        tc_ = tc if has_uni else tr
        meta = dict(NR=tr.shape[-1], NC=tc_.shape[-1], K=K, D=D, C=C, HAS_UNI=has_uni, HAS_MASK=has_mask,
                    CAUSAL=causal, PREC=prec)
        _fwd[(T // C, BH)](q, k, v, tr, tc_, slot, mask, o, lse, T, H, scale * 1.4426950408889634, **meta,
                           num_stages=2)  # two pipeline stages measured faster than the default three (H100)
        ctx.save_for_backward(q, k, v, tr, tc_, slot, mask, o, lse)
        ctx.meta, ctx.H, ctx.scale, ctx.has_uni = meta, H, scale, has_uni
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, tr, tc, slot, mask, o, lse = ctx.saved_tensors
        meta, H, scale = ctx.meta, ctx.H, ctx.scale
        BH, T, D = q.shape
        do = do.contiguous()
        delta = torch.empty(BH, T, device=q.device, dtype=torch.float32)   # written by _bwd_dq
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))   # the kernels accumulate in float32
        dtr, dtc = torch.zeros_like(tr), torch.zeros_like(tc)
        args = (T, H, scale * 1.4426950408889634, scale)
        ncp = triton.next_power_of_2(meta["NC"]) if ctx.has_uni else 1
        _bwd_dq[(T // meta["C"], BH)](q, k, v, tr, tc, slot, mask, o, do, lse, delta, dq, dtr, dtc, *args,
                                      NCP=ncp, **meta)
        _bwd_dkv[(T // meta["C"], BH)](q, k, v, tr, tc, slot, mask, do, lse, delta, dk, dv, *args, **meta)
        return (dq, dk, dv, dtr, dtc if ctx.has_uni else None,
                None, None, None, None, None, None, None, None)


def upe_attention_triton(q, k, v, rel, uni=None, slot=None, key_mask=None, causal=False, block=None):
    """Same contract as upe.upe_attention_naive. The tables q R^T and q C^T are built here
    (autograd carries their gradient to q, R and C)."""
    B, H, T, D = q.shape
    if D not in (16, 32, 64, 128):
        raise ValueError(f"the UPE Triton kernel takes head dims 16, 32, 64 or 128, got {D}")
    C = block or (64 if D <= 64 else 32)
    pad = -T % C
    Tp = T + pad
    K = (rel.shape[1] - 1) // 2
    mask = torch.ones(B, T, dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    mask = F.pad(mask, (0, pad)).to(torch.int8).contiguous()                  # padded keys: masked
    slot_ = torch.full((B, T), -1, dtype=torch.long, device=q.device) if slot is None else slot
    slot_ = F.pad(slot_, (0, pad), value=-1).to(torch.int32).contiguous()
    qp, kp, vp = (F.pad(x, (0, 0, 0, pad)) if pad else x for x in (q, k, v))
    # bf16 inputs get bf16 tables (their rounding is that of the bf16 q.k products; half the traffic),
    # everything else float32. Zero rows pad the tables to a multiple of 8 columns: aligned rows let
    # the matmuls use their fast kernels; the padding columns are never read.
    tdt = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32

    def table(vecs):                                        # (H, N, D) -> (B, H, Tp, N + pad)
        return qp.to(tdt) @ F.pad(vecs.to(tdt), (0, 0, 0, -vecs.shape[1] % 8)).transpose(-1, -2)[None]

    tr = table(rel).reshape(B * H, Tp, -1)                  # (B*H, Tp, 2K+1 + pad)
    tc = None
    if uni is not None and slot is not None:
        tc = table(uni).reshape(B * H, Tp, -1)              # (B*H, Tp, M + pad)
    flat = lambda x: x.reshape(B * H, Tp, D).contiguous()  # noqa: E731
    has_mask = key_mask is not None or pad > 0
    o = UPEFlash.apply(flat(qp), flat(kp), flat(vp), tr, tc, slot_, mask, has_mask, H, K, D ** -0.5, causal, C)
    return o.view(B, H, Tp, D)[:, :, :T]
