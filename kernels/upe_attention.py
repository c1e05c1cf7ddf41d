"""Triton kernels for RPE / UPE attention: FlashAttention with gathered position logits.

The logit of query i and key j is (q_i . k_j + t_ij) * scale, where t_ij is looked up in per-query
tables:

    QR: (B*H, T, NR)    column c = clip(j - i, -K, K) + K holds q_i . R[2K - c] = q_i . R[o] for the
                        clipped offset o = clip(i - j, -K, K) + K     (`_table` builds it)
    QC: (B*H, T, M)     q_i . C[m]  used instead when key j has slot m >= 0  (a PyTorch matmul)

so no (T, T, D) or (T, T) tensor exists. Forward: `_table`, then one program per (query block,
batch*head), online softmax over the key blocks. Backward: `_bwd_dq` (per query block: dQ and the
table gradients dQR / dQC, no atomics: the program owns its query rows; the entries that clipping or
slots share are summed in registers; it writes them divided by the softmax scale), then `_bwd_dkv`
(per key block: dK, dV in registers), then dQ += dQR R + dQC C, dR = dQR^T Q and dC = dQC^T Q
(PyTorch matmuls that apply the scale, `_table_grads`). The caller pads T to the largest tile with
masked keys.

QR has NR columns, NR = 1 (mod 8) and NR >= 2K + 8 (521 for K = 256; the columns after 2K are
padding). Row i then starts at i (mod 8), the cell of key j lies at i (NR - 1) + K + j, and for K
a multiple of 8 the band's cells of 8 consecutive keys are one aligned 16-byte load (bf16). The band
is loaded unclipped and the cells beyond +-K (which lie in the same table, in other columns or
rows) are replaced by the two clipped entries. Rows of that width are why the table is built in
Triton (`_table`, aligned stores too): cuBLAS writes 513-wide rows with slow kernels. dQR has
NG = NR - 1 columns, a multiple of 8, for the matmuls.

QR is q R^T with R in reverse order, so that along a query's row the columns of consecutive keys are
consecutive and ascending. The compiler then lays out the stores of the table gradient in the clip
band along the keys, and they coalesce. In the natural order they ran backwards and were scattered
(the dQ kernel's time: docs/perf/upe.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

LOG2E = 1.4426950408889634   # log2(e): the kernels take their logits in base 2 (qk_scale = scale LOG2E)


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
def _table(Q, RR, TR, TE, T, H, NR: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
           BC: tl.constexpr, PREC: tl.constexpr):
    """QR = Q R^T, and TE, the copy of its columns 0 and 2K that the clipped tiles read.
    RR: (H, NR - 1, D), R reversed, zero rows after 2K. Program (m, r, bh) takes BM rows of one
    residue r = i mod 8, i = 8 (m BM + 0 ... BM - 1) + r. Row i starts at cell i NR = i (mod 8), so
    the program writes the NR - 1 cells from column -r: they start at i NR - r, a multiple of 8, and
    every store is 16 aligned bytes (bf16). Columns -r ... -1 are the padding columns NR - r ... NR - 1
    of row i - 1 (NR >= 2K + 8), so the ranges of consecutive rows join; rows of residue 7 write 8
    cells more, their own columns NR - 8 ... NR - 1, which the next row does not reach. So every cell
    is written once, the padding with zeros (R's zero rows, or masked loads), and the unclipped band
    loads of `_logits` read only written cells."""
    m, r, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rd, x = tl.arange(0, D), tl.arange(0, BC)
    i = 8 * (m * BM + tl.arange(0, BM)) + r                                   # (BM,) rows
    ok = i < T
    q = tl.load(Q + (bh * T + i)[:, None] * D + rd[None, :], mask=ok[:, None], other=0.0)
    q = q.to(TR.dtype.element_ty)                                             # (BM, D)
    RRH = RR + (bh % H) * (NR - 1) * D
    # where row i's range starts, i NR - r: a multiple of 8 (T is one), which the compiler cannot see
    start = tl.multiple_of(bh * T * NR + 8 * (m * BM + tl.arange(0, BM)) * NR + r * (NR - 1), 8)
    n_cells = tl.where(r == 7, NR + 7, NR - 1)
    for c0 in tl.static_range(0, NR + 7, BC):
        c = c0 - r + x                                                        # (BC,) columns
        rv = tl.load(RRH + c[:, None] * D + rd[None, :], mask=((c >= 0) & (c < NR - 1))[:, None], other=0.0)
        t = tl.dot(q, tl.trans(rv), input_precision=PREC).to(TR.dtype.element_ty)      # (BM, BC)
        tl.store(TR + start[:, None] + c0 + x[None, :], t, mask=ok[:, None] & (x < n_cells - c0)[None, :])
        if c0 == 0:
            tl.store(TE + (bh * T + i) * 2, tl.sum(tl.where(c[None, :] == 0, t, 0.0), 1).to(TE.dtype.element_ty),
                     mask=ok)
        if (c0 <= 2 * K + 7) and (2 * K < c0 + BC):                           # column 2K may be here
            first = c0 - r + tl.zeros_like(i)                                 # (BM,) column of x = 0
            hit = (first <= 2 * K) & (first + BC > 2 * K)
            tl.store(TE + (bh * T + i) * 2 + 1,
                     tl.sum(tl.where(c[None, :] == 2 * K, t, 0.0), 1).to(TE.dtype.element_ty), mask=ok & hit)


@triton.jit
def _logits(a, b, ii, jj, lo, hi, shift, TR, TC, SLOTB, MASKB, bh, T, j0, s_lo, s_hi, qk_scale,
            NR: tl.constexpr, NC: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, MODE: tl.constexpr,
            SHIFTED: tl.constexpr, HAS_UNI: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
            PREC: tl.constexpr):
    """Base-2 logits (a b^T + t) qk_scale of one tile of KB keys from j0, masked, in either
    orientation: (a, b) = (q, k) with query positions ii = i[:, None] and key positions
    jj = j[None, :], or (k, q) with ii = i[None, :] and jj = j[:, None]. lo, hi (shaped like ii): the
    table entries t of columns 0 and 2K of each query, used in the clipped runs; the band gathers.
    Keys with a slot (those in [s_lo, s_hi) of this batch row may have one) take q.C[slot] instead.
    SHIFTED (`_bwd_dq`): the logits less shift (shaped like ii), with lo and hi passed as t qk_scale -
    shift, so that a clipped logit costs one fma. `_fwd` and `_bwd_dkv` measured slower that way
    (docs/perf/upe.md): in `_fwd` the compiler moved every clipped tile of logits to another
    register layout, `_bwd_dkv` spilled."""
    s = tl.dot(a, tl.trans(b), input_precision=PREC)
    row = bh * T + ii                                        # the queries' table rows
    if MODE == 1:   # the cell of (i, j) is row(i) NR + K + j - i = bh T NR + i (NR - 1) + K + j
        dif = jj - ii
        t = tl.load(TR + bh * T * NR + ii * (NR - 1) + K + jj).to(tl.float32)
        if SHIFTED:
            t = t * qk_scale - shift
        t = tl.where(dif <= -K, lo, tl.where(dif >= K, hi, t))
    elif MODE == 0:
        t = lo if SHIFTED else lo + tl.zeros_like(s)
    else:
        t = hi if SHIFTED else hi + tl.zeros_like(s)
    if HAS_UNI:
        if (j0 < s_hi) & (j0 + KB > s_lo):                   # only tiles that may hold slot keys
            sl = tl.load(SLOTB + jj)
            sl_in = tl.minimum(tl.maximum(sl, 0), NC - 1)       # a slot >= M (an error) stays in the table
            tc = tl.load(TC + row * NC + sl_in).to(tl.float32)
            if SHIFTED:    # s + (tc qk_scale - shift - t) / qk_scale, so that the line below adds tc
                s = tl.where(sl >= 0, s + tc - (t + shift) / qk_scale, s)
            else:
                t = tl.where(sl >= 0, tc, t)
    s = s * qk_scale + t if SHIFTED else (s + t) * qk_scale
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
    s = _logits(q, k, i_pos[:, None], j_pos[None, :], t_lo[:, None], t_hi[:, None], 0.0, TR, TC, SLOTB, MASKB,
                bh, T, j0, s_lo, s_hi, qk_scale, NR, NC, K, BN, MODE, False, HAS_UNI, HAS_MASK, CAUSAL, PREC)
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
def _dq_tile(q, do, lse, delta, dq, d_lo, d_hi, d_uni, c_lo, c_hi, KP, V, TR, DTR, TC, SLOTB, MASKB, bh, T,
             row, i_pos, j0, s_lo, s_hi, qk_scale, NR: tl.constexpr, NC: tl.constexpr,
             NCP: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr,
             HAS_UNI: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """The keys j0 ... j0 + BN - 1 of `_bwd_dq`: their share of dQ and of the table gradients, both
    divided by the softmax scale (one multiply per logit fewer; `_bwd_dq` scales dQ at its end,
    `_table_grads` the tables)."""
    rd = tl.arange(0, D)
    j_pos = j0 + tl.arange(0, BN)
    col = bh * T + j_pos
    k = tl.load(KP + col[:, None] * D + rd[None, :])
    s = _logits(q, k, i_pos[:, None], j_pos[None, :], c_lo[:, None], c_hi[:, None], lse[:, None], TR, TC, SLOTB,
                MASKB, bh, T, j0, s_lo, s_hi, qk_scale, NR, NC, K, BN, MODE, True, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    p = tl.exp2(s)
    v = tl.load(V + col[:, None] * D + rd[None, :])
    ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])  # d(raw logit) / scale
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
        tl.store(DTR + row[:, None] * (NR - 1) + K + dif, ds, mask=(dif > -K) & (dif < K))   # dQR: NR - 1 wide
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
    c_lo = tl.load(TE + row * 2).to(tl.float32) * qk_scale - lse      # shifted clipped logits (`_logits`)
    c_hi = tl.load(TE + row * 2 + 1).to(tl.float32) * qk_scale - lse
    s_lo, s_hi = tl.load(SRANGE + 2 * b), tl.load(SRANGE + 2 * b + 1)
    SLOTB, MASKB = SLOT + b * T, MASK + b * T
    dq = tl.zeros([BM, D], tl.float32)
    d_lo = tl.zeros([BM], tl.float32)                    # dQR[:, 0]:  j - i <= -K
    d_hi = tl.zeros([BM], tl.float32)                    # dQR[:, 2K]: j - i >= K
    d_uni = tl.zeros([BM, NCP], tl.float32)              # dQC
    n_keys = (i + 1) * BM if CAUSAL else T
    a, c = _runs(i * BM, 0, n_keys, K, BM, BN)
    for j0 in range(0, a, BN):
        dq, d_lo, d_hi, d_uni = _dq_tile(q, do, lse, delta, dq, d_lo, d_hi, d_uni, c_lo, c_hi, KP, V, TR, DTR,
                                         TC, SLOTB, MASKB, bh, T, row, i_pos, j0, s_lo, s_hi, qk_scale,
                                         NR, NC, NCP, K, D, BN, 0, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    for j0 in range(a, c, BN):
        dq, d_lo, d_hi, d_uni = _dq_tile(q, do, lse, delta, dq, d_lo, d_hi, d_uni, c_lo, c_hi, KP, V, TR, DTR,
                                         TC, SLOTB, MASKB, bh, T, row, i_pos, j0, s_lo, s_hi, qk_scale,
                                         NR, NC, NCP, K, D, BN, 1, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    for j0 in range(c, n_keys, BN):
        dq, d_lo, d_hi, d_uni = _dq_tile(q, do, lse, delta, dq, d_lo, d_hi, d_uni, c_lo, c_hi, KP, V, TR, DTR,
                                         TC, SLOTB, MASKB, bh, T, row, i_pos, j0, s_lo, s_hi, qk_scale,
                                         NR, NC, NCP, K, D, BN, 2, HAS_UNI, HAS_MASK, CAUSAL, PREC)
    tl.store(DTR + row * (NR - 1), d_lo)
    tl.store(DTR + row * (NR - 1) + 2 * K, d_hi)
    tl.store(DQ + row[:, None] * D + rd[None, :], dq * scale)
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
    st = _logits(k, q, i_pos[None, :], j_pos[:, None], t_lo[None, :], t_hi[None, :], 0.0, TR, TC, SLOTB, MASKB,
                 bh, T, j0, s_lo, s_hi, qk_scale, NR, NC, K, BM, MODE, False, HAS_UNI, HAS_MASK, CAUSAL, PREC)
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
TABLE = (64, 128, 4)    # `_table`: rows per residue, columns per step, warps (the best of nine
                        # settings measured: docs/perf/upe.md)
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


def table_width(K: int) -> int:
    """NR, the row width of QR: 1 (mod 8) and at least 2K + 8 (module docstring)."""
    return (2 * K + 14) // 8 * 8 + 1


def build_table(q, rr, H: int, K: int):
    """QR (B*H, T, NR) and its columns 0 and 2K (B*H, T, 2) from q (B*H, T, D) and the reversed,
    zero-padded R (H, NR - 1, D), in R's dtype; the padding columns of QR hold zeros.
    T must be a multiple of 8 (the caller pads it to the tile), so that every (batch, head) starts
    aligned."""
    BH, T, D = q.shape
    if T % 8:
        raise ValueError(f"build_table needs T a multiple of 8, got {T}")
    NR = rr.shape[1] + 1
    tr = torch.empty(BH, T, NR, device=q.device, dtype=rr.dtype)
    te = torch.empty(BH, T, 2, device=q.device, dtype=rr.dtype)
    bm, bc, warps = TABLE
    _table[(triton.cdiv(T, 8 * bm), 8, BH)](q, rr, tr, te, T, H, NR=NR, K=K, D=D, BM=bm, BC=bc,
                                            PREC="ieee" if rr.dtype == torch.float32 else None, num_warps=warps)
    return tr, te


def _table_grad_buffer(BH: int, T: int, rr, K: int, causal: bool):
    """dQR (B*H, T, NG), uninitialised except the cells `_bwd_dq` does not write, which are zeroed:
    the padding columns, and the offsets whose key lies before 0 (rows i < K, columns < K - i),
    beyond T (rows i > T - K, columns > K + T - i) or, causal, beyond the query's own block
    (columns > K). Zeroing a superset is fine, as the kernel runs after and overwrites what it writes.
    Zeroing all of it would be a 1 GB fill at T = 4096, B = 8, H = 32."""
    dtr = torch.empty(BH, T, rr.shape[1], device=rr.device, dtype=rr.dtype)
    dtr[..., 2 * K + 1:] = 0
    dtr[:, :K, :K] = 0
    dtr[:, 0 if causal else max(T - K, 0):, K + 1:2 * K + 1] = 0
    return dtr


def _table_grads(dq, q, vecs, dtab, H: int, scale: float):
    """The matmuls behind a table T = q V^T (V: (H, N, D); T: (B*H, T, N)), given dtab = dT / scale
    as `_bwd_dq` writes it: dq += dT V in place, one matmul with the add fused, and the return value
    dV = dT^T q summed over the batch."""
    BH, T, D = q.shape
    B, N = BH // H, vecs.shape[1]
    per_bh = vecs.expand(B, H, N, D).reshape(BH, N, D)
    if dq.dtype == dtab.dtype:
        dq.baddbmm_(dtab, per_bh, alpha=scale)
    else:                                                   # float16 inputs have float32 tables
        dq.copy_(dq.to(dtab.dtype).baddbmm_(dtab, per_bh, alpha=scale))
    return (dtab.view(B, H, T, N).transpose(-1, -2) @ q.view(B, H, T, D).to(dtab.dtype)).sum(0) * scale


class UPEFlash(torch.autograd.Function):
    """(q, k, v, R reversed and padded, C padded or None, ...) -> o. Builds both tables (QR with
    `_table`, QC with a matmul) and returns the gradients of R and C."""

    @staticmethod
    def forward(ctx, q, k, v, rr, uc, slot, srange, mask, has_mask, H, K, scale, causal, cfg):
        BH, T, D = q.shape
        has_uni = uc is not None
        prec = "ieee" if q.dtype == torch.float32 else None
        tr, te = build_table(q, rr, H, K)
        tc = None
        if has_uni:                                         # (B*H, T, M + pad)
            tc = (q.view(BH // H, H, T, D).to(uc.dtype) @ uc.transpose(-1, -2)[None]).view(BH, T, -1)
        o = torch.empty_like(q)
        lse = torch.empty(BH, T, device=q.device, dtype=torch.float32)
        tc_ = tc if has_uni else tr
        meta = dict(NR=tr.shape[-1], NC=tc_.shape[-1], K=K, D=D, HAS_UNI=has_uni, HAS_MASK=has_mask,
                    CAUSAL=causal, PREC=prec)
        own, step, warps, stages = cfg["fwd"]
        _fwd[(T // own, BH)](q, k, v, tr, te, tc_, slot, srange, mask, o, lse, T, H, scale * LOG2E,
                             **meta, BM=own, BN=step, num_warps=warps, num_stages=stages)
        ctx.save_for_backward(q, k, v, rr, uc, tr, te, tc_, slot, srange, mask, o, lse)
        ctx.meta, ctx.H, ctx.scale, ctx.has_uni, ctx.cfg = meta, H, scale, has_uni, cfg
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, rr, uc, tr, te, tc, slot, srange, mask, o, lse = ctx.saved_tensors
        meta, H, scale, cfg = ctx.meta, ctx.H, ctx.scale, ctx.cfg
        BH, T, D = q.shape
        do = do.contiguous()
        delta = torch.empty(BH, T, device=q.device, dtype=torch.float32)   # written by _bwd_dq
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))   # the kernels accumulate in float32
        dtr = _table_grad_buffer(BH, T, rr, meta["K"], meta["CAUSAL"])      # dQR
        dtc = torch.empty_like(tc) if ctx.has_uni else dtr      # dQC: `_bwd_dq` writes every cell
        args = (T, H, scale * LOG2E, scale)
        ncp = triton.next_power_of_2(meta["NC"]) if ctx.has_uni else 1
        own, step, warps, stages = cfg["dq"]
        _bwd_dq[(T // own, BH)](q, k, v, tr, te, tc, slot, srange, mask, o, do, lse, delta, dq, dtr, dtc, *args,
                                NCP=ncp, **meta, BM=own, BN=step, num_warps=warps, num_stages=stages)
        own, step, warps, stages = cfg["dkv"]
        _bwd_dkv[(T // own, BH)](q, k, v, tr, te, tc, slot, srange, mask, do, lse, delta, dk, dv, *args, **meta,
                                 BM=own, BN=step, num_warps=warps, num_stages=stages)
        drr = _table_grads(dq, q, rr, dtr, H, scale)
        duc = _table_grads(dq, q, uc, dtc, H, scale) if ctx.has_uni else None
        return (dq, dk, dv, drr, duc,
                None, None, None, None, None, None, None, None, None)


@torch.compiler.disable   # --compile: inductor would pass the kernels' float arguments as fp64
def upe_attention_triton(q, k, v, rel, uni=None, slot=None, key_mask=None, causal=False, block=None):
    """Same contract as upe.upe_attention_naive; `UPEFlash` builds the tables q R^T and q C^T.
    `block`: see `launch_configs`. The kernels take head dims 16, 32, 64 and 128; a head dim in between
    (96 at the UPE paper's width of 768 with 8 heads) is zero-padded to the next of them: zero columns add
    nothing to any dot product and give zero output columns, which are sliced off (the scale stays D's)."""
    B, H, T, D = q.shape
    DK = next((d for d in (16, 32, 64, 128) if d >= D), None)                 # the kernel's head dim
    if DK is None:
        raise ValueError(f"the UPE Triton kernel takes head dims up to 128, got {D}")
    cfg = launch_configs(DK, T, block)
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
    qp, kp, vp = (F.pad(x, (0, DK - D, 0, pad)) if pad or DK > D else x for x in (q, k, v))
    # bf16 inputs get bf16 tables (their rounding is that of the bf16 q.k products; half the traffic),
    # everything else float32. R, reversed, gets zero rows up to NG = NR - 1 (module docstring); QC
    # is a matmul, its rows padded to a multiple of 8 columns so that the matmul uses its fast kernels
    # (the padding columns are never read).
    tdt = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    NG = table_width(K) - 1
    rr = F.pad(rel.flip(1).to(tdt), (0, DK - D, 0, NG - 2 * K - 1))           # (H, NG, DK)
    uc = None
    if uni is not None and slot is not None:
        uc = F.pad(uni.to(tdt), (0, DK - D, 0, -uni.shape[1] % 8))               # (H, M + pad, DK)
    flat = lambda x: x.reshape(B * H, Tp, DK).contiguous()  # noqa: E731
    has_mask = key_mask is not None or pad > 0
    o = UPEFlash.apply(flat(qp), flat(kp), flat(vp), rr, uc, slot_, srange, mask, has_mask, H, K, D ** -0.5,
                       causal, cfg)
    return o.view(B, H, Tp, DK)[:, :, :T, :D]
