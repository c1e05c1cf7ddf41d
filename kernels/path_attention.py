"""Triton kernels for PaTH attention: a FlashAttention-style forward and its backward, on two levels.

The math is in path_attention.py, and so is `path_attention_triton`, which pads the inputs to whole
blocks and calls what this file holds (it imports nothing of the project: kernels are the ground
floor). First the per-block UT preprocessing: `UTBlocks` (below: one
Triton program per block, forward and backward, 16-bit tensor-core products) for fp16/bf16 inputs
with D >= 32, `path_attention.ut_blocks` (PyTorch, exact float32, differentiated by autograd)
otherwise.
Then the attention kernels see, for blocks of BL tokens,

    qh, kh: queries / keys carried to their block boundaries   (B*H, T, D)     input dtype
    M:      the block products P_m = I - M_m, M_m = W_m^T U_m   (B*H, T/BL, D, D) float32
    sd:     the scaled logits inside each block                 (B*H, T, BL)     input dtype
    G:      the cumulative log forget gate (optional)           (B*H, T)        float32

Two levels. R consecutive blocks form a chunk (R = 8: 512 tokens at BL = 64). `chunk_products_fwd`
(Triton, for fp16/bf16 inputs with D = 32, 64 or 128) or `chunk_products` (PyTorch, otherwise)
multiplies each chunk's block products into one D x D matrix PL_b and carries every key on to
the end of its chunk (kL); the attention kernels carry a state through P_m with one product, by
M_m (the UT step forms it, so W and U stay there, and the UT backward alone forms dW; for the head
dims of CARRY_WU, two products by W_m and U_m in fp16 instead, and PL_b in fp16, the gradients still
M's and PL's; `_bwd_dq` then holds the state's gradient scaled by a power of two per row, `_row_scale`,
inside fp16's range). A query then needs the block products only inside its own chunk; further left
it scores a whole chunk of keys with one state and carries that state once per chunk.
Forward, one program per (query block i in chunk a, batch*head), online softmax as in
FlashAttention:

  1. the diagonal block, from sd;
  2. the earlier blocks m = i-1 ... aR of its chunk, right to left: score with the query state Q~
     (float32, in registers), and carry it through P_m:  Q~ <- Q~ - Q~ M_m;
  3. the earlier chunks b = a-1 ... 0: score chunk b's keys kL with Q~, and Q~ <- Q~ PL_b.
In both loops the next state is formed before the current one scores, so that the two overlap.

Backward. Let X be the gradient reaching the query state. It runs left to right, the opposite way:
before a product P it is X, after it X P^T, and every scored block adds dS K. The gradient of the
product needs the state and X at the same point, dP = Q~^T X, so the forward stores each state it
scores with (one BL x D tile per block pair in step 2 and per chunk in step 3: O(T D (R + T / (R BL)))
memory), and

  `_bwd_dq`  (per query block, left to right) recomputes the softmax, writes X at each state,
             dQ^_i, the gradient of sd and the query side of dG;
  `_bwd_dkv` (per key block) accumulates dK^ (queries of its own chunk), dkL (later chunks), dV,
             dP_m, its share of dPL_b and the key side of dG in registers: no atomics; with the
             Triton chunk kernels it also takes dkL back through kL = kh S^T; for the head dims in
             SPLIT_DKL, `_bwd_dkl` (per DKL_TILE key blocks) scores the later chunks first and
             `_bwd_dkv` adds its dkL, dV and dG;
  `_chunk_bwd` (per chunk) takes dPL and the gradients of the suffix products S back through the
             chunk products to M, adding the attention kernels' dM = -dP; the UT backward takes dM
             on to W and U.
Tensors are padded to a multiple of BL by the caller (zero w, beta = 0: H = I), so the kernels
have no bounds checks. Logits are kept in base 2 (times log2 e) as in the Triton tutorial.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)   # log2(e): the kernels keep logits in base 2
CHUNK = 8   # R: blocks per chunk
UT_WARPS = 4  # warps of the fused UT kernels (measured faster than 8: docs/perf/path.md)
UT_MAXNREG: int | None = None  # registers a thread of the UT kernels may take (ptxas' .maxnreg; fewer lets more
                               # programs share an SM, at the cost of spills); None: as many as they need
# Launch settings per head dim and kernel, each the fastest measured (docs/perf/path.md): warps,
# pipeline stages, and for _fwd and _bwd_dq the stages of their loop over a chunk's key tiles (KS)
# and of _bwd_dq's loop over the earlier blocks of its chunk (IS). D = 128 takes one stage less in
# both loops: at BL = 64 their D x D float32 tiles need more shared memory than an H100 has.
# Other head dims keep Triton's default (4 warps, 3 stages): at D = 32 one stage gave NaN outputs
# for fp16/bf16 inputs on Triton 3.6. 8 warps at D = 128 hit an illegal memory access (Triton 3.6).
# LAUNCH holds what differs from DEFAULT per head dim.
DEFAULT = dict(fwd=dict(num_warps=4, num_stages=3, KS=3), dq=dict(num_warps=4, num_stages=3, KS=3, IS=2),
               dkv=dict(num_warps=4, num_stages=3), dkl=dict(num_warps=4, num_stages=3),
               dm=dict(num_warps=4, num_stages=3), chunk=dict(num_warps=4, num_stages=3))
LAUNCH = {64: dict(fwd=dict(num_stages=1), dq=dict(num_stages=1)),
          128: dict(fwd=dict(num_stages=1, KS=2), dq=dict(num_stages=1, KS=2, IS=1),
                    chunk=dict(num_warps=8, num_stages=1), dkl=dict(num_warps=8), dm=dict(num_warps=8))}


# Head dims whose backward scores the later chunks' query blocks in a kernel of its own (`_bwd_dkl`,
# tiles of DKL_TILE key blocks, no D x D tensor in registers) instead of inside `_bwd_dkv`: D = 128,
# where `_bwd_dkv` spills and the split was measured faster; the tests run both ways.
SPLIT_DKL: set[int] = {128}
DKL_TILE = 2  # key blocks per `_bwd_dkl` program, where they divide the chunk (else 1)

# Head dims whose 16-bit runs carry a query state (and its gradient) through a block of its own chunk
# by the block's W and U (two BL x D products of fp16 operands, whose 10-bit mantissa is TF32's, for
# bf16 inputs too: Q~ - (Q~ W^T) U) instead of by the D x D float32 M = W^T U in TF32, and through an
# earlier chunk by its PL in fp16: the same products, half the bytes at D = 128, where the M carry spills; both
# head dims measured faster so (docs/perf/path.md); float32 inputs always take M and PL in float32.
CARRY_WU: set[int] = {64, 128}

# Head dims whose backward forms each block's D x D sums, dM and its share of dPL, in a kernel of its own
# (`_bwd_dm`, nothing else in registers) instead of inside `_bwd_dkv`, which then holds only the BL x D
# gradients: it reads the stored query states once more. D = 128, where `_bwd_dkv` spilled and the split was
# measured faster; at D = 64 it was slower (docs/perf/path.md). The tests run both ways.
SPLIT_DM: set[int] = {128}

# Head dims (of CARRY_WU too) whose `_chunk_fwd` carries the suffix products S through each block by its W and U in
# fp16 as the attention kernels carry the states (S - (S W^T) U: S is a product of reflections and contractions,
# entries at most 1), with kL = kh S^T in fp16 too, in one program per chunk instead of panels of rows (the fp16
# operands leave room for all D rows); CHUNK_WU_BWD: whose `_chunk_bwd` carries dS so (in fp16, row-scaled as
# `_bwd_dq` does X). D = 128 forward only: `_chunk_fwd` measured faster so, `_chunk_bwd` not (docs/perf/path.md);
# the tests run both ways.
CHUNK_WU: set[int] = {128}
CHUNK_WU_BWD: set[int] = set()


def launch(name: str, D: int) -> dict:
    return DEFAULT[name] | LAUNCH.get(D, {}).get(name, {})


def key_tile(BL: int, R: int, D: int) -> int:
    """Keys per tile where a query state scores a whole chunk (_fwd, _bwd_dq): two blocks (128 keys
    at BL = 64, measured faster than 64) when they divide the chunk and D <= 64, else one."""
    return 2 * BL if R % 2 == 0 and D <= 64 else BL


@triton.jit
def _intra(i, R: tl.constexpr):
    """First stored state of query block i inside its chunk (it has i % R: one per earlier block)."""
    a, r = i // R, i % R
    return a * (R * (R - 1) // 2) + r * (r - 1) // 2


@triton.jit
def _inter(i, R: tl.constexpr):
    """First stored state of query block i at the chunk boundaries (it has i // R: one per chunk)."""
    a, r = i // R, i % R
    return R * (a * (a - 1) // 2) + r * a


def n_states(n: int, R: int) -> tuple[int, int]:
    """How many states (BL x D tiles) per batch*head the two stores hold, for n blocks."""
    return sum(i % R for i in range(n)), sum(i // R for i in range(n))


@triton.jit
def _square(P, k, rd, D: tl.constexpr):
    """The k-th D x D matrix of P (row-major): M_m or PL_b."""
    return tl.load(P + (k * D + rd[:, None]) * D + rd[None, :])


@triton.jit
def _row_scale(do):
    """(BL, 1) powers of two that bring each row of do (BL, DV) to a largest entry in [1, 2) (1 for a zero
    row). Row r of the query-state gradient X is linear in row r of dO, so X times these stays inside
    fp16's range in the fp16 carries of CARRY_WU (bf16 training's gradients are often far below fp16's
    smallest normal value, 6e-5), and multiplying back by their inverses is exact."""
    top = tl.max(tl.abs(do.to(tl.float32)), 1)
    return tl.where(top > 0, tl.exp2(-tl.floor(tl.log2(tl.maximum(top, 1e-30)))), 1.0)[:, None]


@triton.jit
def _carry(x, MB, W, U, blk, col, rd, D: tl.constexpr, PREC: tl.constexpr, WU: tl.constexpr,
           BACK: tl.constexpr = False):
    """A state x (BL, D) float32 through block blk's product: x - x M (BACK: its gradient, x - x M^T),
    M = W^T U, by M (D x D float32) or, with WU, by the block's rows col of W and U (fp16):
    x - (x W^T) U (BACK: x - (x U^T) W)."""
    if WU:
        a = tl.load((U if BACK else W) + col[:, None] * D + rd[None, :])
        b = tl.load((W if BACK else U) + col[:, None] * D + rd[None, :])
        xa = tl.dot(x.to(tl.float16), tl.trans(a))                                  # (BL, BL)
        return x - tl.dot(xa.to(tl.float16), b)
    mb = _square(MB, blk, rd, D)                                                      # (D, D) M
    return x - tl.dot(x, tl.trans(mb) if BACK else mb, input_precision=PREC)


@triton.jit
def _softmax_step(s, v, mx, lsum, acc, PREC16: tl.constexpr):
    """One online-softmax update with base-2 logits s (BL, keys) and values v (keys, DV)."""
    mnew = tl.maximum(mx, tl.max(s, 1))
    alpha = tl.exp2(mx - mnew)
    p = tl.exp2(s - mnew[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC16)
    return mnew, lsum, acc


@triton.jit
def _fwd(QH, KH, KL, V, MB, W, U, PL, SD, G, O, LSE, QS, QL, T, n_chunks, n_intra, n_inter, qk_scale,
         D: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr, R: tl.constexpr, KB: tl.constexpr,
         KS: tl.constexpr, HAS_G: tl.constexpr, SAVE: tl.constexpr, PREC: tl.constexpr, PREC16: tl.constexpr,
         WU: tl.constexpr):
    i, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: buffers pass 2^31
    rc, rd, rv, rk = tl.arange(0, BL), tl.arange(0, D), tl.arange(0, DV), tl.arange(0, KB)
    tile = rc[:, None] * D + rd[None, :]                             # one stored state (BL, D)
    row = bh * T + i * BL + rc                                       # (BL,) query rows
    q = tl.load(QH + row[:, None] * D + rd[None, :]).to(tl.float32)  # (BL, D) query state
    if HAS_G:
        gq = tl.load(G + row) * LOG2E
    # 1. diagonal block: logits precomputed inside the block
    s = tl.load(SD + row[:, None] * BL + rc[None, :]).to(tl.float32) * LOG2E
    if HAS_G:
        s += gq[:, None] - gq[None, :]
    s = tl.where(rc[None, :] <= rc[:, None], s, float("-inf"))
    mx = tl.max(s, 1)
    p = tl.exp2(s - mx[:, None])
    lsum = tl.sum(p, 1)
    v = tl.load(V + row[:, None] * DV + rv[None, :])
    acc = tl.dot(p.to(v.dtype), v, input_precision=PREC16)                            # (BL, DV) float32
    # 2. the earlier blocks of this chunk, right to left
    a = i // R
    first = bh * n_intra + _intra(i, R)
    for t in range(0, i - a * R):
        m = i - 1 - t
        col = bh * T + m * BL + rc
        kh = tl.load(KH + col[:, None] * D + rd[None, :])
        qk = q.to(kh.dtype)
        if SAVE:
            tl.store(QS + (first + t) * BL * D + tile, qk)
        # the next state, while this one scores
        q = _carry(q, MB, W, U, bh * (T // BL) + m, col, rd, D, PREC, WU)
        s = tl.dot(qk, tl.trans(kh), input_precision=PREC16) * qk_scale
        if HAS_G:
            s += gq[:, None] - tl.load(G + col)[None, :] * LOG2E
        v = tl.load(V + col[:, None] * DV + rv[None, :])
        mx, lsum, acc = _softmax_step(s, v, mx, lsum, acc, PREC16)
    # 3. the earlier chunks, right to left, one state each
    first = bh * n_inter + _inter(i, R)
    for t in range(0, a):
        b = a - 1 - t
        qk = q.to(KL.dtype.element_ty)
        if SAVE:
            tl.store(QL + (first + b) * BL * D + tile, qk)
        if b > 0:                                          # the next state, while this one scores
            pl = _square(PL, bh * n_chunks + b, rd, D)                # fp16 with WU
            q = tl.dot(q.to(pl.dtype), pl) if WU else tl.dot(q, pl, input_precision=PREC)
        for j in tl.range(0, R * BL, KB, num_stages=KS):   # the chunk's keys, KB at a time
            ck = bh * T + b * R * BL + j + rk                # (KB,) key rows
            kl = tl.load(KL + ck[:, None] * D + rd[None, :])
            sk = tl.dot(qk, tl.trans(kl), input_precision=PREC16) * qk_scale
            if HAS_G:
                sk += gq[:, None] - tl.load(G + ck)[None, :] * LOG2E
            vk = tl.load(V + ck[:, None] * DV + rv[None, :])
            mx, lsum, acc = _softmax_step(sk, vk, mx, lsum, acc, PREC16)
    tl.store(O + row[:, None] * DV + rv[None, :], (acc / lsum[:, None]).to(O.dtype.element_ty))
    tl.store(LSE + row, mx + tl.log2(lsum))


@triton.jit
def _dq_pair(qs, k, col, V, G, gq, do, lse, delta, qk_scale, rv, HAS_G: tl.constexpr, DV: tl.constexpr,
             PREC16: tl.constexpr):
    """One (query block, key tile) pair of `_bwd_dq`: the queries' state qs against the keys k at
    rows col. Returns dS = dL/d(logit), (queries, keys)."""
    s = tl.dot(qs, tl.trans(k), input_precision=PREC16) * qk_scale
    if HAS_G:
        s += gq[:, None] - tl.load(G + col)[None, :] * LOG2E
    p = tl.exp2(s - lse[:, None])
    v = tl.load(V + col[:, None] * DV + rv[None, :])
    return p * (tl.dot(do, tl.trans(v), input_precision=PREC16) - delta[:, None])


@triton.jit
def _bwd_dq(QS, QL, KH, KL, V, MB, W, U, PL, SD, G, O, DO, LSE, DELTA, XS, XL, DQH, DSD, DGQ, T, n_chunks,
            n_intra, n_inter, qk_scale, scale, D: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr,
            R: tl.constexpr, KB: tl.constexpr, KS: tl.constexpr, IS: tl.constexpr, HAS_G: tl.constexpr,
            PREC: tl.constexpr, PREC16: tl.constexpr, WU: tl.constexpr):
    i, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: buffers pass 2^31
    rc, rd, rv, rk = tl.arange(0, BL), tl.arange(0, D), tl.arange(0, DV), tl.arange(0, KB)
    tile = rc[:, None] * D + rd[None, :]
    row = bh * T + i * BL + rc
    do = tl.load(DO + row[:, None] * DV + rv[None, :])
    lse = tl.load(LSE + row)
    delta = tl.sum(do.to(tl.float32) * tl.load(O + row[:, None] * DV + rv[None, :]).to(tl.float32), 1)
    tl.store(DELTA + row, delta)                                     # rowsum(dO * O), for _bwd_dkv
    gq = tl.load(G + row) * LOG2E if HAS_G else tl.zeros([BL], tl.float32)
    # diagonal block
    s = tl.load(SD + row[:, None] * BL + rc[None, :]).to(tl.float32) * LOG2E
    if HAS_G:
        s += gq[:, None] - gq[None, :]
    s = tl.where(rc[None, :] <= rc[:, None], s, float("-inf"))
    p = tl.exp2(s - lse[:, None])
    v = tl.load(V + row[:, None] * DV + rv[None, :])
    ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC16) - delta[:, None])  # dL/d(logit)
    tl.store(DSD + row[:, None] * BL + rc[None, :], ds.to(DSD.dtype.element_ty))
    dg = tl.sum(ds, 1)
    # X, kept as X rs: with WU, rs (BL, 1) brings its rows into fp16's range for the carries' products
    x = tl.zeros([BL, D], dtype=tl.float32)
    rs = _row_scale(do) if WU else 1.0
    irs, up = 1.0 / rs, scale * rs                                   # exact: powers of two
    # the earlier chunks, left to right: X is stored before PL_b, then carried through it
    a = i // R
    first = bh * n_inter + _inter(i, R)
    for b in range(0, a):
        at = (first + b) * BL * D + tile
        tl.store(XL + at, (x * irs).to(XL.dtype.element_ty))
        qs = tl.load(QL + at)
        pl = _square(PL, bh * n_chunks + b, rd, D)                    # fp16 with WU
        x = tl.dot(x.to(pl.dtype), tl.trans(pl)) if WU else tl.dot(x, tl.trans(pl), input_precision=PREC)
        for j in tl.range(0, R * BL, KB, num_stages=KS):   # the chunk's keys, KB at a time
            ck = bh * T + b * R * BL + j + rk
            kl = tl.load(KL + ck[:, None] * D + rd[None, :])
            dsk = _dq_pair(qs, kl, ck, V, G, gq, do, lse, delta, qk_scale, rv, HAS_G, DV, PREC16)
            dg += tl.sum(dsk, 1)
            x += up * tl.dot(dsk.to(kl.dtype), kl, input_precision=PREC16)
    # the earlier blocks of this chunk, left to right
    first = bh * n_intra + _intra(i, R)
    for m in tl.range(a * R, i, num_stages=IS):
        col = bh * T + m * BL + rc
        at = (first + i - 1 - m) * BL * D + tile
        tl.store(XS + at, (x * irs).to(XS.dtype.element_ty))
        qs = tl.load(QS + at)
        kh = tl.load(KH + col[:, None] * D + rd[None, :])
        ds = _dq_pair(qs, kh, col, V, G, gq, do, lse, delta, qk_scale, rv, HAS_G, DV, PREC16)
        dg += tl.sum(ds, 1)
        x = _carry(x, MB, W, U, bh * (T // BL) + m, col, rd, D, PREC, WU, True)
        x += up * tl.dot(ds.to(kh.dtype), kh, input_precision=PREC16)
    tl.store(DQH + row[:, None] * D + rd[None, :], (x * irs).to(DQH.dtype.element_ty))
    if HAS_G:
        tl.store(DGQ + row, dg)


@triton.jit
def _dkv_pair(qs, k, v, DO, LSE, DELTA, G, gk, row, rv, qk_scale, dv, dg, HAS_G: tl.constexpr,
              DV: tl.constexpr, PREC16: tl.constexpr):
    """One (key block, query block) pair of `_bwd_dkv`, kept transposed (keys x queries) so that P^T
    and dS^T are left operands as computed: adds to dV and the key side of dG, returns dS^T."""
    st = tl.dot(k, tl.trans(qs), input_precision=PREC16) * qk_scale            # (BL keys, BL queries)
    if HAS_G:
        st += tl.load(G + row)[None, :] * LOG2E - gk[:, None]
    pt = tl.exp2(st - tl.load(LSE + row)[None, :])
    do = tl.load(DO + row[:, None] * DV + rv[None, :])
    dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC16)
    dst = pt * (tl.dot(v, tl.trans(do), input_precision=PREC16) - tl.load(DELTA + row)[None, :])
    dg -= tl.sum(dst, 1)
    return dst, dv, dg


@triton.jit
def _later_chunks(QL, kl, v, DO, LSE, DELTA, G, gk, b, bh, T, n_blocks, n_inter, qk_scale, scale, dkl, dv, dg,
                  D: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr, R: tl.constexpr, HAS_G: tl.constexpr,
                  PREC16: tl.constexpr):
    """The keys kL of chunk b (any number of rows) against the query blocks of the later chunks, one
    stored state per (query block, chunk): adds to dkL, dV and the key side of dG."""
    rc, rd, rv = tl.arange(0, BL), tl.arange(0, D), tl.arange(0, DV)
    for i in range(b * R + R, n_blocks):
        qs = tl.load(QL + (bh * n_inter + _inter(i, R) + b) * BL * D + rc[:, None] * D + rd[None, :])
        dst, dv, dg = _dkv_pair(qs, kl, v, DO, LSE, DELTA, G, gk, bh * T + i * BL + rc, rv, qk_scale, dv, dg,
                                HAS_G, DV, PREC16)
        dkl += scale * tl.dot(dst.to(qs.dtype), qs, input_precision=PREC16)
    return dkl, dv, dg


@triton.jit
def _bwd_dkl(QL, KL, V, G, DO, LSE, DELTA, DKLP, DVP, DGP, T, n_blocks, n_inter, qk_scale, scale,
             D: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr, R: tl.constexpr, KT: tl.constexpr,
             HAS_G: tl.constexpr, PREC16: tl.constexpr):
    """The later chunks' part of `_bwd_dkv` for KT key blocks of one chunk at once (KT divides R): their
    keys kL meet the query states stored per (query block, chunk), which every key block of the chunk
    shares, so one state tile serves KT * BL keys. Writes dkL and these pairs' shares of dV and of the
    key side of dG, float32, for `_bwd_dkv` to add; zeros for the keys of the last chunk (no later query)."""
    t, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    KB: tl.constexpr = KT * BL
    rk, rd, rv = tl.arange(0, KB), tl.arange(0, D), tl.arange(0, DV)
    b = t * KT // R
    inside = t * KB + rk < T                          # the last tile may pass the last block
    col = bh * T + t * KB + rk
    kl = tl.load(KL + col[:, None] * D + rd[None, :], mask=inside[:, None], other=0.0)     # (KB, D)
    v = tl.load(V + col[:, None] * DV + rv[None, :], mask=inside[:, None], other=0.0)      # (KB, DV)
    gk = tl.load(G + col, mask=inside, other=0.0) * LOG2E if HAS_G else tl.zeros([KB], tl.float32)
    dkl, dv, dg = _later_chunks(QL, kl, v, DO, LSE, DELTA, G, gk, b, bh, T, n_blocks, n_inter, qk_scale, scale,
                                tl.zeros([KB, D], dtype=tl.float32), tl.zeros([KB, DV], dtype=tl.float32),
                                tl.zeros([KB], dtype=tl.float32), D, DV, BL, R, HAS_G, PREC16)
    tl.store(DKLP + col[:, None] * D + rd[None, :], dkl, mask=inside[:, None])
    tl.store(DVP + col[:, None] * DV + rv[None, :], dv, mask=inside[:, None])
    if HAS_G:
        tl.store(DGP + col, dg, mask=inside)


@triton.jit
def _dpl_share(QL, XL, DPL, m, b, bh, dd, tile, n_blocks, n_inter, D: tl.constexpr, BL: tl.constexpr,
               R: tl.constexpr, PREC16: tl.constexpr):
    """Block m's share of dPL_b: the query blocks i of later chunks with i = m (mod R)."""
    dpl = tl.zeros([D, D], dtype=tl.float32)
    for i in range(b * R + R + m % R, n_blocks, R):
        at = (bh * n_inter + _inter(i, R) + b) * BL * D + tile
        dpl += tl.dot(tl.trans(tl.load(QL + at)), tl.load(XL + at), input_precision=PREC16)
    tl.store(DPL + dd, dpl)


@triton.jit
def _bwd_dm(QS, QL, XS, XL, KH, SUF, DKLP, DKL, DM, DPL, T, n_blocks, n_intra, n_inter, D: tl.constexpr,
            BL: tl.constexpr, R: tl.constexpr, FOLD: tl.constexpr, PREC16: tl.constexpr):
    """SPLIT_DM: block m's dM = -sum Q~^T X over the later query blocks of its chunk, and its share of
    dPL, each from the states stored for them (what `_bwd_dkv` forms otherwise). With FOLD (`_bwd_dkl`
    wrote the block's dkL to DKLP, and the Triton chunk backward follows), also the fold of dkL through
    kL = kh S^T: dkL S over dkL in DKLP (for `_bwd_dkv` to add to dK^) and dkL^T kh to DKL."""
    m, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rc, rd = tl.arange(0, BL), tl.arange(0, D)
    tile = rc[:, None] * D + rd[None, :]
    b = m // R
    dd = ((bh * n_blocks + m) * D + rd[:, None]) * D + rd[None, :]
    dp_m = tl.zeros([D, D], dtype=tl.float32)
    for i in range(m + 1, tl.minimum(b * R + R, n_blocks)):
        at = (bh * n_intra + _intra(i, R) + i - 1 - m) * BL * D + tile
        dp_m += tl.dot(tl.trans(tl.load(QS + at)), tl.load(XS + at), input_precision=PREC16)
    tl.store(DM + dd, -dp_m)
    _dpl_share(QL, XL, DPL, m, b, bh, dd, tile, n_blocks, n_inter, D, BL, R, PREC16)
    if FOLD:
        col = bh * T + m * BL + rc
        kh = tl.load(KH + col[:, None] * D + rd[None, :])
        # the same fold as `_bwd_dkv`'s, written out in each: as a shared helper it changed `_bwd_dkv`'s
        # register allocation (spills 3,716 -> 3,872 bytes at D = 128, sm_90)
        dkl16 = tl.load(DKLP + col[:, None] * D + rd[None, :]).to(kh.dtype)
        fold = tl.dot(dkl16, _square(SUF, bh * n_blocks + m, rd, D).to(kh.dtype), input_precision=PREC16)
        tl.store(DKL + dd, tl.dot(tl.trans(dkl16), kh, input_precision=PREC16))
        tl.store(DKLP + col[:, None] * D + rd[None, :], fold)


@triton.jit
def _bwd_dkv(QS, QL, XS, XL, KH, KL, V, SD, G, SUF, DO, LSE, DELTA, DKH, DKL, DV_, DM, DPL, DGK, DKLP, DVP, DGP,
             T, n_blocks, n_intra, n_inter, qk_scale, scale, D: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr,
             R: tl.constexpr, HAS_G: tl.constexpr, FOLD_KL: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
             PREC16: tl.constexpr, SPLIT_M: tl.constexpr = False, FOLDED: tl.constexpr = False):
    """Without FOLD_KL it writes dK^ and dkL (float32, BL x D per block); with FOLD_KL (the Triton chunk
    backward follows) it takes dkL through kL = kh S^T itself, with this block's suffix product S
    (SUF): dK^ + dkL S in kh's dtype to DKH, and the gradient of S, dkL^T kh (D x D), to DKL. With
    SPLIT_M, `_bwd_dm` writes dM and the dPL share instead; with FOLDED it also made the fold, and DKLP
    holds dkL S."""
    m, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rc, rd, rv = tl.arange(0, BL), tl.arange(0, D), tl.arange(0, DV)
    tile = rc[:, None] * D + rd[None, :]
    col = bh * T + m * BL + rc
    kh = tl.load(KH + col[:, None] * D + rd[None, :])
    v = tl.load(V + col[:, None] * DV + rv[None, :])
    gk = tl.load(G + col) * LOG2E if HAS_G else tl.zeros([BL], tl.float32)
    # diagonal block (query block m itself), transposed: only dV and the gate here; sd's gradient is
    # in _bwd_dq
    st = tl.load(SD + col[None, :] * BL + rc[:, None]).to(tl.float32) * LOG2E   # (keys, queries)
    if HAS_G:
        st += gk[None, :] - gk[:, None]
    st = tl.where(rc[:, None] <= rc[None, :], st, float("-inf"))
    pt = tl.exp2(st - tl.load(LSE + col)[None, :])
    do = tl.load(DO + col[:, None] * DV + rv[None, :])
    dv = tl.dot(pt.to(do.dtype), do, input_precision=PREC16)                   # (BL, DV)
    dst = pt * (tl.dot(v, tl.trans(do), input_precision=PREC16) - tl.load(DELTA + col)[None, :])
    dg = -tl.sum(dst, 1)
    # the later query blocks of this chunk: keys kh, their states stored per block pair
    b = m // R
    dd = ((bh * n_blocks + m) * D + rd[:, None]) * D + rd[None, :]
    dk = tl.zeros([BL, D], dtype=tl.float32)
    if not SPLIT_M:
        dp_m = tl.zeros([D, D], dtype=tl.float32)
    for i in range(m + 1, tl.minimum(b * R + R, n_blocks)):
        at = (bh * n_intra + _intra(i, R) + i - 1 - m) * BL * D + tile
        qs = tl.load(QS + at)
        dst, dv, dg = _dkv_pair(qs, kh, v, DO, LSE, DELTA, G, gk, bh * T + i * BL + rc, rv, qk_scale, dv, dg,
                                HAS_G, DV, PREC16)
        dk += scale * tl.dot(dst.to(qs.dtype), qs, input_precision=PREC16)
        if not SPLIT_M:
            dp_m += tl.dot(tl.trans(qs), tl.load(XS + at), input_precision=PREC16)
    if not SPLIT_M:
        # each D x D sum is stored as soon as it is complete, so that no two are held in registers at once
        tl.store(DM + dd, -dp_m)                                              # dM = -dP (P = I - M)
        _dpl_share(QL, XL, DPL, m, b, bh, dd, tile, n_blocks, n_inter, D, BL, R, PREC16)
    # the query blocks of later chunks: keys kL, one state per (query block, chunk)
    if SPLIT:                                       # scored by _bwd_dkl, which ran first
        dkl = tl.load(DKLP + col[:, None] * D + rd[None, :])                  # (dkL S with FOLDED)
        dv += tl.load(DVP + col[:, None] * DV + rv[None, :])
        if HAS_G:
            dg += tl.load(DGP + col)
    else:
        dkl, dv, dg = _later_chunks(QL, tl.load(KL + col[:, None] * D + rd[None, :]), v, DO, LSE, DELTA, G, gk, b,
                                    bh, T, n_blocks, n_inter, qk_scale, scale, tl.zeros([BL, D], dtype=tl.float32),
                                    dv, dg, D, DV, BL, R, HAS_G, PREC16)
    if FOLDED:                                      # _bwd_dm folded it and stored DKL
        dk += dkl
    elif FOLD_KL:
        dkl16 = dkl.to(kh.dtype)   # 16-bit products: faster than TF32 (docs/perf/path.md)
        dk += tl.dot(dkl16, _square(SUF, bh * n_blocks + m, rd, D).to(kh.dtype), input_precision=PREC16)
        tl.store(DKL + dd, tl.dot(tl.trans(dkl16), kh, input_precision=PREC16))
    else:
        tl.store(DKL + col[:, None] * D + rd[None, :], dkl)
    tl.store(DKH + col[:, None] * D + rd[None, :], dk.to(DKH.dtype.element_ty))
    tl.store(DV_ + col[:, None] * DV + rv[None, :], dv.to(DV_.dtype.element_ty))
    if HAS_G:
        tl.store(DGK + col, dg)


# ---- the UT preprocessing of each block, fused (path_attention.ut_blocks is its PyTorch form) -------
# One program per (block, batch*head) holds the block's BL x BL matrices in registers: T^-1 (built in
# 16 x 16 pieces, `_tril_inverse`), then a dozen BL x BL and BL x D products; the backward recomputes
# all but T^-1, which the forward stores (timings and the variants tried: docs/perf/path.md).

@triton.jit
def _mm(a, b, LP: tl.constexpr, dt):
    """a @ b with float32 accumulation: with LP the operands are rounded to dt (the input dtype, 16
    bits) for the tensor cores; without, exact float32 products."""
    if LP:
        ab = tl.dot(a.to(dt), b.to(dt))
    else:
        ab = tl.dot(a, b, input_precision="ieee")
    return ab


@triton.jit
def _piece(TI, row, r, c, BL: tl.constexpr):
    """Pointers to the 16 x 16 piece (r, c) of the BL x BL matrix of the block whose rows start at row."""
    r16 = tl.arange(0, 16)
    return TI + (row + r * 16 + r16)[:, None] * BL + c * 16 + r16[None, :]


@triton.jit
def _tril_inverse(W, BETA, TI, row, LP: tl.constexpr, dt, D: tl.constexpr, BL: tl.constexpr):
    """T^-1 for T = I + strictLower(diag(beta) W W^T) of one block (BL rows from `row`), written to TI
    (BL x BL) in pieces of 16 x 16. The BL / 16 diagonal pieces together, as a (BL / 16, 16, 16) tensor,
    by forward substitution, one row of every piece per step; then the pieces left of the diagonal,
    row of pieces a after row a - 1: T^-1_ab = -T^-1_aa sum_{b <= c < a} L_ac T^-1_cb (L = T - I),
    with exact float32 products. The pieces go through TI, so the caller syncs before loading it."""
    NP: tl.constexpr = BL // 16
    r16, rp, rd, rc = tl.arange(0, 16), tl.arange(0, NP), tl.arange(0, D), tl.arange(0, BL)
    rows = row + rp[:, None] * 16 + r16[None, :]                                     # (NP, 16)
    w3 = tl.load(W + rows[:, :, None] * D + rd[None, None, :])                       # (NP, 16, D)
    lower = r16[None, :, None] > r16[None, None, :]
    L = tl.where(lower, tl.load(BETA + rows)[:, :, None] * _mm(w3, tl.trans(w3, (0, 2, 1)), LP, dt), 0.0)
    ti = tl.where(r16[None, :, None] == r16[None, None, :], 1.0, 0.0) + tl.zeros([NP, 16, 16], tl.float32)
    for i in range(1, 16):                       # row i = e_i - L[i, :] T^-1 (rows < i done), per piece
        li = tl.sum(tl.where(r16[None, :, None] == i, L, 0.0), 1)                     # (NP, 16)
        ri = tl.where(r16[None, :] == i, 1.0, 0.0) - tl.sum(li[:, :, None] * ti, 1)
        ti = tl.where(r16[None, :, None] == i, ri[:, None, :], ti)
    tl.store(TI + rows[:, :, None] * BL + rp[:, None, None] * 16 + r16[None, None, :], ti)
    tl.store(TI + (row + rc)[:, None] * BL + rc[None, :], tl.zeros([BL, BL], tl.float32),
             mask=rc[None, :] // 16 > rc[:, None] // 16)                           # above the diagonal
    tl.debug_barrier()                                                  # the diagonal pieces are stored
    for a in tl.static_range(1, NP):
        wa = tl.load(W + (row + a * 16 + r16)[:, None] * D + rd[None, :])
        beta_a = tl.load(BETA + row + a * 16 + r16)
        tia = tl.load(_piece(TI, row, a, a, BL))
        for b in tl.static_range(a):
            acc = tl.zeros([16, 16], tl.float32)
            for c in tl.static_range(b, a):
                wc = tl.load(W + (row + c * 16 + r16)[:, None] * D + rd[None, :])
                lac = beta_a[:, None] * _mm(wa, tl.trans(wc), LP, dt)
                acc += tl.dot(lac, tl.load(_piece(TI, row, c, b, BL)), input_precision="ieee")
            tl.store(_piece(TI, row, a, b, BL), -tl.dot(tia, acc, input_precision="ieee"))
        tl.debug_barrier()                                              # row of pieces a is stored


@triton.jit
def _ut_fwd(Q, K, W, BETA, QH, KH, MB, SD, TI, U, scale, D: tl.constexpr, BL: tl.constexpr, LP: tl.constexpr,
            STORE_U: tl.constexpr, STORE_M: tl.constexpr = True):
    """One block: qh = q - QW u, kh = k - F^T w, sd = scale (q k^T - QW F), the block product as
    M = W^T u (P = I - M, D x D; with STORE_M) with u = A w (stored in fp16 with STORE_U), and T^-1 kept for the
    backward. QW = lower(q w^T), F = A strictLower(w k^T)."""
    blk, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rc, rd = tl.arange(0, BL), tl.arange(0, D)
    row = bh * tl.num_programs(0) * BL + blk * BL + rc                # (BL,) token rows
    cd, cc = row[:, None] * D + rd[None, :], row[:, None] * BL + rc[None, :]
    dt = Q.dtype.element_ty                                           # product operands with LP
    _tril_inverse(W, BETA, TI, bh * tl.num_programs(0) * BL + blk * BL, LP, dt, D, BL)
    tl.debug_barrier()
    # tensors used only as product operands are held in dt from the start (with LP, _mm would round
    # them to it anyway): half the registers
    q, k, w = tl.load(Q + cd), tl.load(K + cd), tl.load(W + cd).to(dt)
    a = (tl.load(TI + cc) * tl.load(BETA + row)[None, :]).to(dt)      # A = T^-1 diag(beta)
    u32 = _mm(a, w, LP, dt)
    if STORE_U:                                                       # for CARRY_WU, in fp16
        tl.store(U + cd, u32.to(U.dtype.element_ty))
    u = u32.to(dt)
    qw = tl.where(rc[:, None] >= rc[None, :], _mm(q, tl.trans(w), LP, dt), 0.0).to(dt)
    f = _mm(a, tl.where(rc[:, None] > rc[None, :], _mm(w, tl.trans(k), LP, dt), 0.0).to(dt), LP, dt).to(dt)
    tl.store(QH + cd, (q - _mm(qw, u, LP, dt)).to(QH.dtype.element_ty))
    tl.store(KH + cd, (k - _mm(tl.trans(f), w, LP, dt)).to(KH.dtype.element_ty))
    tl.store(SD + cc, (scale * (_mm(q, tl.trans(k), LP, dt) - _mm(qw, f, LP, dt))).to(SD.dtype.element_ty))
    if STORE_M:
        dd = (bh * tl.num_programs(0) + blk) * D * D + rd[:, None] * D + rd[None, :]
        tl.store(MB + dd, _mm(tl.trans(w), u, LP, dt))


@triton.jit
def _ut_bwd(Q, K, W, BETA, TI, DQH, DKH, DMB, DSD, DQ, DK, DW, DBETA, scale, D: tl.constexpr, BL: tl.constexpr,
            LP: tl.constexpr):
    """The gradients of `_ut_fwd`'s outputs taken back to q, k, w and beta, for one block. As in the
    forward, product operands are held in dt; each gradient is stored as soon as it is complete."""
    blk, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rc, rd = tl.arange(0, BL), tl.arange(0, D)
    row = bh * tl.num_programs(0) * BL + blk * BL + rc
    cd, cc = row[:, None] * D + rd[None, :], row[:, None] * BL + rc[None, :]
    dt = Q.dtype.element_ty                                           # product operands with LP
    lower = rc[:, None] > rc[None, :]
    q, k, w = tl.load(Q + cd), tl.load(K + cd), tl.load(W + cd).to(dt)
    beta = tl.load(BETA + row)
    a = (tl.load(TI + cc) * beta[None, :]).to(dt)                    # A = T^-1 diag(beta), T^-1 stored
    u = _mm(a, w, LP, dt).to(dt)
    qw = tl.where(rc[:, None] >= rc[None, :], _mm(q, tl.trans(w), LP, dt), 0.0).to(dt)
    mk = tl.where(lower, _mm(w, tl.trans(k), LP, dt), 0.0).to(dt)   # M = strictLower(w k^T)
    f = _mm(a, mk, LP, dt).to(dt)
    dqh, dkh, dsd = tl.load(DQH + cd), tl.load(DKH + cd), tl.load(DSD + cc).to(dt)
    # qh = q - QW u,  kh = k - F^T w,  sd = scale (q k^T - QW F),  M = W^T u
    dqw = -_mm(dqh, tl.trans(u), LP, dt) - scale * _mm(dsd, tl.trans(f), LP, dt)
    dqw = tl.where(rc[:, None] >= rc[None, :], dqw, 0.0).to(dt)
    dq = dqh.to(tl.float32) + scale * _mm(dsd, k, LP, dt) + _mm(dqw, w, LP, dt)
    tl.store(DQ + cd, dq.to(DQ.dtype.element_ty))
    dmb = _square(DMB, bh * tl.num_programs(0) + blk, rd, D).to(dt)
    du = (_mm(w, dmb, LP, dt) - _mm(tl.trans(qw), dqh, LP, dt)).to(dt)
    # dW's first terms before df and in this order: with df first, or with the dM term first, Triton
    # 3.6 compiled them wrongly at D = 32 (dW off by 40 % and 9 % on an H100; the GPU tests catch it)
    dw = -_mm(f, dkh, LP, dt) + _mm(tl.trans(dqw), q, LP, dt) + _mm(u, tl.trans(dmb), LP, dt)
    df = (-_mm(w, tl.trans(dkh), LP, dt) - scale * _mm(tl.trans(qw), dsd, LP, dt)).to(dt)
    dk = dkh.to(tl.float32) + scale * _mm(tl.trans(dsd), q, LP, dt)
    # F = A M,  u = A w
    dm = tl.where(lower, _mm(tl.trans(a), df, LP, dt), 0.0).to(dt)
    dk += _mm(tl.trans(dm), w, LP, dt)
    tl.store(DK + cd, dk.to(DK.dtype.element_ty))
    dw += _mm(dm, k, LP, dt) + _mm(tl.trans(a), du, LP, dt)
    da = _mm(df, tl.trans(mk), LP, dt) + _mm(du, tl.trans(w), LP, dt)
    # A = T^-1 diag(beta),  d(T^-1) -> dT = -T^-T d(T^-1) T^-T,  T = I + strictLower(diag(beta) W W^T)
    ti = tl.load(TI + cc)                                             # T^-1, for dbeta and dT
    dbeta = tl.sum(da * ti, 0)                                                    # column scaling
    dti = (da * beta[None, :]).to(dt)
    ti = ti.to(dt)
    dtm = tl.where(lower, -_mm(_mm(tl.trans(ti), dti, LP, dt).to(dt), tl.trans(ti), LP, dt), 0.0)
    dbeta += tl.sum(dtm * _mm(w, tl.trans(w), LP, dt), 1)                        # row scaling
    dww = (dtm * beta[:, None]).to(dt)
    dw += _mm(dww, w, LP, dt) + _mm(tl.trans(dww), w, LP, dt)
    tl.store(DW + cd, dw)
    tl.store(DBETA + row, dbeta)


def ut_registers() -> dict:
    return {"maxnreg": UT_MAXNREG} if UT_MAXNREG else {}


class UTBlocks(torch.autograd.Function):
    """(qh, kh, M, sd) from q, k, w, beta of shapes (BH, T, D) and (BH, T), T a multiple of BL; fused
    per block in Triton. qh, kh and sd are those of `path_attention.ut_blocks`, M = W^T U per block
    (BH, T / BL, D, D) is its block product P = I - M. qh and kh come out in the input dtype (they
    are rounded to it for the tensor cores later anyway), and so does sd: its gradient, which
    autograd gives in sd's dtype, then costs half the memory traffic, and it is no less exact than
    the logits that the attention kernels form from qh and kh. M is float32. With store_u it also
    returns U (BH, T, D), in fp16 for 16-bit inputs, which only serves as a second form of M (CARRY_WU): it has no
    gradient of its own, M's carries it. Without store_m M is not formed (where nothing reads it: `m_read`):
    a zero-stride stand-in of its shape, no memory, still carries M's gradient back."""

    @staticmethod
    def forward(ctx, q, k, w, beta, scale, BL, store_u=False, store_m=True):
        BH, T, D = q.shape
        f32 = dict(device=q.device, dtype=torch.float32)
        shape = (BH, T // BL, D, D)
        mb = torch.empty(shape, **f32) if store_m else torch.zeros((), **f32).expand(shape)
        qh, kh = torch.empty_like(q), torch.empty_like(k)
        sd, ti = torch.empty(BH, T, BL, device=q.device, dtype=q.dtype), torch.empty(BH, T, BL, **f32)
        lp = q.dtype != torch.float32                           # 16-bit inputs: 16-bit products
        u = torch.empty_like(q, dtype=torch.float16 if lp else torch.float32) if store_u else None
        _ut_fwd[(T // BL, BH)](q, k, w, beta, qh, kh, mb, sd, ti, qh if u is None else u, scale, D=D, BL=BL, LP=lp,
                               STORE_U=store_u, STORE_M=store_m, num_warps=UT_WARPS, **ut_registers())
        ctx.save_for_backward(q, k, w, beta, ti)
        ctx.scale, ctx.BL, ctx.lp = scale, BL, lp
        if u is not None:
            ctx.mark_non_differentiable(u)
        return qh, kh, mb, sd, u

    @staticmethod
    def backward(ctx, dqh, dkh, dmb, dsd, du=None):
        q, k, w, beta, ti = ctx.saved_tensors
        BH, T, D = q.shape
        f32 = dict(device=q.device, dtype=torch.float32)
        grads = [torch.zeros_like(x) if g is None else g.contiguous() for g, x in ((dqh, q), (dkh, k))]
        grads.append(torch.zeros(BH, T // ctx.BL, D, D, **f32) if dmb is None else dmb.float().contiguous())
        dsd = torch.zeros(BH, T, ctx.BL, device=q.device, dtype=q.dtype) if dsd is None else dsd.contiguous()
        dq, dk, dw = torch.empty_like(q), torch.empty_like(k), torch.empty(BH, T, D, **f32)
        dbeta = torch.empty(BH, T, **f32)
        _ut_bwd[(T // ctx.BL, BH)](q, k, w, beta, ti, *grads, dsd, dq, dk, dw, dbeta, ctx.scale, D=D, BL=ctx.BL,
                                  LP=ctx.lp, num_warps=UT_WARPS, **ut_registers())
        return dq, dk, dw, dbeta, None, None, None, None


def m_read(D: int, dtype) -> bool:
    """Whether anything reads the block products M of 16-bit inputs: not where the attention kernels carry by
    W and U (CARRY_WU) and both chunk kernels do too (CHUNK_WU, CHUNK_WU_BWD)."""
    by_wu = D in CARRY_WU and D in CHUNK_WU and D in CHUNK_WU_BWD
    return not (by_wu and chunk_kernels_apply(D, dtype))


def chunk_products(kh, mb, BL: int, R: int):
    """kL: every key carried from the end of its block on to the end of its chunk of R blocks, and
    PL: each chunk's product P_last ... P_first as a D x D matrix (q <- q PL), with P = I - M.
    Float32, autograd. kh: (BH, T, D), mb: M per block (BH, T / BL, D, D) -> kL (BH, T, D),
    PL (BH, n_chunks, D, D)."""
    BH, T, D = kh.shape
    n = T // BL
    n_chunks = -(-n // R)
    pad = n_chunks * R - n                                     # identity blocks (M = 0) fill the last chunk
    kb = F.pad(kh, (0, 0, 0, pad * BL)).view(BH, n_chunks, R, BL, D)
    eye = torch.eye(D, device=kh.device, dtype=kh.dtype)
    P = eye - F.pad(mb, (0, 0, 0, 0, 0, pad)).view(BH, n_chunks, R, D, D)   # (BH, n_chunks, R, D, D)
    suffix = [eye.expand(BH, n_chunks, D, D)]                 # P_{R-1} ... P_{r+1}, from r = R-1 down
    for r in range(R - 1, 0, -1):
        suffix.append(suffix[-1] @ P[:, :, r])
    suffix = torch.stack(suffix[::-1], 2)                      # (BH, n_chunks, R, D, D)
    kl = (kb @ suffix.mT).reshape(BH, n_chunks * R * BL, D)[:, :T]
    return kl, suffix[:, :, 0] @ P[:, :, 0]


@triton.jit
def _chunk_fwd(KH, MB, W, U, KL, PL, SUF, T, n_blocks, D: tl.constexpr, DP: tl.constexpr, BL: tl.constexpr,
               R: tl.constexpr, PREC: tl.constexpr, WU: tl.constexpr):
    """One chunk and one panel of DP rows of the suffix product S, its blocks right to left:
    S = P_{R-1} ... P_{r+1} (D x D, float32) carries the keys of block r to the chunk's end,
    kL_r = kh_r S^T; then S <- S P_r = S - S M_r. Each row of S evolves on its own, so a program
    holds DP rows (DP x D) and writes the DP columns of kL that they give. S is kept per block for
    the backward; PL = S at the end. With WU (CHUNK_WU) both products take S in fp16, and S M_r is
    (S W_r^T) U_r with the block's rows of W and U in fp16."""
    b, bh, p = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    rc, rd, rp = tl.arange(0, BL), tl.arange(0, D), p * DP + tl.arange(0, DP)
    pd = rp[:, None] * D + rd[None, :]                                    # this panel's rows of a D x D
    s = tl.where(rp[:, None] == rd[None, :], 1.0, 0.0)                    # (DP, D)
    for t in range(0, R):
        m = b * R + R - 1 - t
        if m < n_blocks:                                                  # the last chunk may be short
            row = bh * T + m * BL + rc
            tl.store(SUF + (bh * n_blocks + m) * D * D + pd, s)
            kh = tl.load(KH + row[:, None] * D + rd[None, :])
            if WU:
                kl = tl.dot(kh.to(tl.float16), tl.trans(s.to(tl.float16)))                 # (BL, DP)
            else:
                kl = tl.dot(kh.to(tl.float32), tl.trans(s), input_precision=PREC)
            tl.store(KL + row[:, None] * D + rp[None, :], kl.to(KL.dtype.element_ty))
            s = _carry(s, MB, W, U, bh * n_blocks + m, row, rd, D, PREC, WU)
    tl.store(PL + (bh * tl.num_programs(0) + b) * D * D + pd, s)


@triton.jit
def _chunk_bwd(MB, W, U, SUF, DSK, DPL, DMA, DMO, T, n_blocks, D: tl.constexpr, DP: tl.constexpr, BL: tl.constexpr,
               p, R: tl.constexpr, PREC: tl.constexpr, WU: tl.constexpr):
    """The backward of `_chunk_fwd` for the panel of DP rows from p * DP, blocks left to right with
    dS, the gradient of S after block r: dM_r = -S_r^T dS (P = I - M), then dS <- dS P_r^T +
    dkL_r^T kh_r. The rows of dS evolve on their own as the rows of S do; dM_r sums over the panels,
    so the panels run one launch after another, each adding its term to DMA (the attention
    kernels' own dM_r = -dP_r before the first) and writing DMO. dS starts as dPL, the sum of the
    shares in DPL that the chunk's R blocks hold. `_bwd_dkv` has done the rest, which needs one
    block only: dkL_r^T kh_r (DSK) and dkh_r += dkL_r S_r. With WU (CHUNK_WU_BWD) dS goes through P_r^T as
    dS - (dS U_r^T) W_r in fp16, scaled by a power of two per row (`_row_scale`) for the products, as `_bwd_dq`
    carries its X."""
    b, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rd, rp, rc = tl.arange(0, D), p * DP + tl.arange(0, DP), tl.arange(0, BL)
    dd = rd[:, None] * D + rd[None, :]
    pd = rp[:, None] * D + rd[None, :]
    ds = tl.zeros([DP, D], dtype=tl.float32)                                 # (DP, D)
    for r in range(0, R):
        if b * R + r < n_blocks:
            ds += tl.load(DPL + (bh * n_blocks + b * R + r) * D * D + pd)
    for r in range(0, R):
        m = b * R + r
        if m < n_blocks:
            at = (bh * n_blocks + m) * D * D
            s, mb = tl.load(SUF + at + pd), (0.0 if WU else tl.load(MB + at + dd))   # M beside S: as timed
            tl.store(DMO + at + dd, tl.load(DMA + at + dd) - tl.dot(tl.trans(s), ds, input_precision=PREC))
            if WU:                                       # dS row-scaled into fp16's range for the products
                rs = _row_scale(ds)
                ds = _carry(ds * rs, MB, W, U, 0, bh * T + m * BL + rc, rd, D, PREC, WU, True) * (1.0 / rs)
                ds += tl.load(DSK + at + pd)
            else:
                ds = ds - tl.dot(ds, tl.trans(mb), input_precision=PREC) + tl.load(DSK + at + pd)


def chunk_kernels_apply(D: int, dtype) -> bool:
    """Whether `chunk_products_fwd` / `_bwd` (Triton, TF32) build the chunk products: fp16/bf16 inputs
    with D = 32, 64 or 128. Float32 inputs keep the exact `chunk_products`; D = 16 keeps it too."""
    return dtype != torch.float32 and D in (32, 64, 128)


def chunk_panel(D: int) -> int:
    """Rows of the suffix product per program of the chunk kernels: all of them up to D = 64; at
    D = 128 a whole D x D float32 product needs more shared memory than an H100 has (376,832 bytes
    against 232,448), so two panels of 64 rows."""
    return min(D, 64)


def chunk_products_fwd(kh, mb, BL: int, R: int, kl_dtype=torch.float32, wu=None):
    """`chunk_products` in Triton, one program per chunk and panel of rows: kL (in kl_dtype), PL and
    the suffix products S per block (BH, n, D, D), kept for the backward. kh: (BH, T, D) float32 or
    16 bits, mb: float32. wu: W and U (BH, T, D) in fp16 to carry S by (CHUNK_WU), all D rows a program."""
    BH, T, D = kh.shape
    n = T // BL
    n_chunks = -(-n // R)
    DP = D if wu else chunk_panel(D)
    w16, u16 = wu if wu else (mb, mb)                                   # not read without wu
    f32 = dict(device=kh.device, dtype=torch.float32)
    kl, pl = torch.empty(BH, T, D, device=kh.device, dtype=kl_dtype), torch.empty(BH, n_chunks, D, D, **f32)
    suf = torch.empty(BH, n, D, D, **f32)
    _chunk_fwd[(n_chunks, BH, D // DP)](kh, mb, w16, u16, kl, pl, suf, T, n, D=D, DP=DP, BL=BL, R=R, PREC="tf32",
                                        WU=bool(wu), **launch("chunk", D))
    return kl, pl, suf


def chunk_products_bwd(mb, suf, dsk, dpl, dmb, BL: int, R: int, wu=None):
    """The gradient of M through `chunk_products_fwd`, given per block (BH, n, D, D): dsk = dkL^T kh
    (the gradient of S through kL = kh S^T), dpl, each block's share of dPL (a chunk's R shares are
    summed here), and dmb, the attention kernels' own dM, to which the chunk's is added. kh's
    gradient, dkL S, needs no chunk: `_bwd_dkv` adds it. wu: W and U (BH, T, D) in fp16 (CHUNK_WU_BWD)."""
    BH, n, D, _ = mb.shape
    DP = chunk_panel(D)
    w16, u16 = wu if wu else (mb, mb)                                   # not read without wu
    dmo = torch.empty_like(mb)
    for p in range(D // DP):                     # the panels' terms of dM add up: one launch each
        _chunk_bwd[(-(-n // R), BH)](mb, w16, u16, suf, dsk, dpl, dmb if p == 0 else dmo, dmo, n * BL, n, D=D, DP=DP,
                                     BL=BL, p=p, R=R, PREC="tf32", WU=bool(wu), **launch("chunk", D))
    return dmo


def block_size(D: int, dtype=torch.bfloat16) -> int:
    """Block length BL: 64 (at D = 128 in 16 bits, 32 measured slower: docs/perf/path.md), except
    for float32 inputs at D = 128, whose float32 tiles at BL = 64 need more shared memory than an
    H100 has (280,064 bytes against 232,448)."""
    return 32 if D > 64 and dtype == torch.float32 else 64


class PathScan(torch.autograd.Function):
    """o = attention over the block pairs, given the UT preprocessing (see the module docstring). It
    builds the chunk products itself, so that their backward can take in the attention kernels'
    gradients of kh and M instead of autograd adding them afterwards. The blocks' products come in
    as M (P = I - M): w then reaches this function only through M, and its gradient is formed once,
    in the UT backward. w16 and u16 (BH, T, D), given for the head dims of CARRY_WU, are the same
    products' W and U in fp16, which the kernels carry the states of a chunk through instead; the
    states then go through the chunks' products PL in fp16 as well. For the head dims of CHUNK_WU
    (CHUNK_WU_BWD) the chunk products' forward (backward) carries through them too."""

    @staticmethod
    def forward(ctx, qh, kh, v, mb, sd, G, scale, BL, R, w16=None, u16=None):
        BH, T, D = qh.shape
        if chunk_kernels_apply(D, v.dtype):                  # kL straight in the tensor cores' dtype
            khc = None                                       # (their backward needs no kh)
            cw = (w16, u16) if w16 is not None and D in CHUNK_WU else None
            kl, pl, suf = chunk_products_fwd(kh, mb, BL, R, v.dtype, cw)
        else:
            khc = kh.float()                                 # float32, for the chunk products' backward
            with torch.no_grad(), torch.autocast(v.device.type, enabled=False):   # float32 products
                (kl, pl), suf = chunk_products(khc, mb, BL, R), None
            pl = pl.contiguous()
        DV = v.shape[-1]
        n = T // BL
        n_intra, n_inter = n_states(n, R)
        save = any(ctx.needs_input_grad)
        # float32 input: exact float32 products everywhere; 16-bit input: tensor-core products of the
        # input dtype, and TF32 for the float32 transport products of the carried query state
        prec, prec16 = ("ieee", "ieee") if v.dtype == torch.float32 else ("tf32", None)
        kh, kl = kh.to(v.dtype).contiguous(), kl.to(v.dtype).contiguous()  # tensor-core operands
        o = torch.empty_like(v)
        lse = torch.empty(BH, T, device=v.device, dtype=torch.float32)
        states = lambda k: torch.empty(BH, max(k, 1), BL, D, device=v.device, dtype=kh.dtype) # noqa: E731
        qs, ql = (states(n_intra), states(n_inter)) if save else (o, o)
        has_g = G is not None
        wu = w16 is not None
        w16, u16 = (w16, u16) if wu else (mb, mb)                # not read without WU
        plc = pl.to(torch.float16) if wu else pl                 # the carries' PL: fp16 with WU
        _fwd[(n, BH)](qh, kh, kl, v, mb, w16, u16, plc, sd, G if has_g else lse, o, lse, qs, ql, T, pl.shape[1],
                      n_intra, n_inter, scale * LOG2E.value, D=D, DV=DV, BL=BL, R=R, KB=key_tile(BL, R, D),
                      HAS_G=has_g, SAVE=save, PREC=prec, PREC16=prec16, WU=wu, **launch("fwd", D))
        ctx.save_for_backward(qs, ql, khc, kh, kl, v, mb, w16, u16, pl, plc, suf, sd, G, o, lse)
        ctx.wu, ctx.cw = wu, chunk_kernels_apply(D, v.dtype) and wu and D in CHUNK_WU_BWD
        ctx.scale, ctx.BL, ctx.R, ctx.prec, ctx.qh_dtype = scale, BL, R, (prec, prec16), qh.dtype
        return o

    @staticmethod
    def backward(ctx, do):
        qs, ql, khc, kh, kl, v, mb, w16, u16, pl, plc, suf, sd, G, o, lse = ctx.saved_tensors
        scale, BL, R, (prec, prec16) = ctx.scale, ctx.BL, ctx.R, ctx.prec
        BH, T, D = kh.shape
        DV = v.shape[-1]
        n = T // BL
        n_chunks = pl.shape[1]
        n_intra, n_inter = n_states(n, R)
        do = do.contiguous()
        delta = torch.empty(BH, T, device=v.device, dtype=torch.float32)   # written by _bwd_dq
        has_g = G is not None
        f32 = dict(device=v.device, dtype=torch.float32)
        xs, xl = torch.empty_like(qs), torch.empty_like(ql)
        dqh, dsd = torch.empty(BH, T, D, device=v.device, dtype=ctx.qh_dtype), torch.empty_like(sd)
        fold_kl = suf is not None                               # the Triton chunk backward follows
        dkh = torch.empty(BH, T, D, device=v.device, dtype=kh.dtype if fold_kl else torch.float32)
        dkl = torch.empty(BH, n, D, D, **f32) if fold_kl else torch.empty(BH, T, D, **f32)   # see _bwd_dkv
        dv, dmb, dpl = torch.empty_like(v), torch.empty(BH, n, D, D, **f32), torch.empty(BH, n, D, D, **f32)
        dgq, dgk = (torch.empty(BH, T, **f32), torch.empty(BH, T, **f32)) if has_g else (lse, lse)
        meta = dict(D=D, DV=DV, BL=BL, R=R, HAS_G=has_g, PREC=prec, PREC16=prec16)
        _bwd_dq[(n, BH)](qs, ql, kh, kl, v, mb, w16, u16, plc, sd, G if has_g else lse, o, do, lse, delta, xs, xl,
                         dqh, dsd, dgq, T, n_chunks, n_intra, n_inter, scale * LOG2E.value, scale,
                         KB=key_tile(BL, R, D), WU=ctx.wu, **meta, **launch("dq", D))
        suf_arg = suf if fold_kl else mb                        # _bwd_dkv reads SUF only with FOLD_KL
        split = D in SPLIT_DKL
        if split:                                               # the later chunks' pairs first
            kt = DKL_TILE if R % DKL_TILE == 0 else 1
            dklp, dvp = torch.empty(BH, T, D, **f32), torch.empty(BH, T, DV, **f32)
            dgp = torch.empty(BH, T, **f32) if has_g else lse
            _bwd_dkl[(triton.cdiv(n, kt), BH)](ql, kl, v, G if has_g else lse, do, lse, delta, dklp, dvp, dgp, T, n,
                                               n_inter, scale * LOG2E.value, scale, D=D, DV=DV, BL=BL, R=R, KT=kt,
                                               HAS_G=has_g, PREC16=prec16, **launch("dkl", D))
        else:
            dklp = dvp = dgp = lse                              # not read
        split_m = D in SPLIT_DM
        folded = split_m and split and fold_kl                  # _bwd_dm folds dkL too: _bwd_dkv holds no D x D
        if split_m:                                             # the D x D sums in a kernel of their own
            _bwd_dm[(n, BH)](qs, ql, xs, xl, kh, suf_arg, dklp if split else lse, dkl, dmb, dpl, T, n, n_intra,
                             n_inter, D=D, BL=BL, R=R, FOLD=folded, PREC16=prec16, **launch("dm", D))
        _bwd_dkv[(n, BH)](qs, ql, xs, xl, kh, kl, v, sd, G if has_g else lse, suf_arg, do, lse,
                          delta, dkh, dkl, dv, dmb, dpl, dgk, dklp, dvp, dgp, T, n, n_intra, n_inter,
                          scale * LOG2E.value, scale, FOLD_KL=fold_kl, SPLIT=split, SPLIT_M=split_m,
                          FOLDED=folded, **meta, **launch("dkv", D))
        if fold_kl:                                             # Triton: the chunk backward sums it all
            dmb = chunk_products_bwd(mb, suf, dkl, dpl, dmb, BL, R, (w16, u16) if ctx.cw else None)
        else:                                                # PyTorch: autograd through chunk_products
            dpl = F.pad(dpl, (0, 0, 0, 0, 0, n_chunks * R - n)).view(BH, n_chunks, R, D, D).sum(2)  # R shares
            with torch.enable_grad(), torch.autocast(v.device.type, enabled=False):
                ins = [x.detach().requires_grad_(True) for x in (khc, mb)]
                grads = torch.autograd.grad(chunk_products(*ins, BL, R), ins, (dkl, dpl))
            dkh, dmb = dkh + grads[0], dmb + grads[1]
        dG = dgq + dgk if has_g else None
        return dqh, dkh, dv, dmb, dsd, dG, None, None, None, None, None
