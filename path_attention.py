"""PaTH attention: position encoding by accumulated, data-dependent Householder transforms.

Paper: "PaTH Attention: Position Encoding via Accumulating Householder Transformations"
(Yang et al., 2025; arXiv:2505.16381), sections 2-3. Also here: the Forgetting Transformer's gate (FoX, Lin et al.
2025) as a baseline and combined with PaTH (PaTH-FoX).

The logit between query i and key j <= i is

    s_ij = scale * q_i^T H_i H_{i-1} ... H_{j+1} k_j  +  G_i - G_j,     H_t = I - beta_t w_t w_t^T

with w_t a unit vector and beta_t in (0, 2) computed from token t, and G_t = sum_{s<=t} g_s the
cumulative log forget gate (g = 0 for plain PaTH; FoX is the same with every H = I). Attention
is softmax over j <= i. The product of the H's between two positions is not a function of
their distance but of the tokens in between, so the model can track state (e.g. flip-flop).

Products of Householder-like matrices have a compact "UT" form (section 3.1): for one block of
L transforms,

    H_{L-1} ... H_1 H_0 = I - W^T A W,    A = (I + strictLower(diag(beta) W W^T))^{-1} diag(beta)

(W: the L vectors as rows; the latest H is leftmost; A is lower triangular). Any sub-interval of
the block uses the matching sub-block of A, which gives, inside one block,

    S_blk = Q K^T - tril(Q W^T) A strictTril(W K^T).

Across blocks (section 3.3) each query is first carried to the start of its block and each key
to the end of its block ("boundary-adjusted"):

    Q^ = Q - tril(Q W^T) A W,        K^ = K - (A strictTril(W K^T))^T W,

and a query block then visits the key blocks right to left, scoring them with its current
query state and then carrying the state through the block's product P_m = I - W_m^T U_m
(U = A W):  Q~ <- Q~ - (Q~ W_m^T) U_m. `path_attention_torch` is this algorithm in PyTorch; the
Triton kernel (kernels/path_attention.py) runs it with an online softmax, one program per query
block, and has its own backward. It adds a second level: beyond its own chunk of 8 blocks a query
state scores a whole chunk of keys at once (carried in advance to the chunk's end) and is then
carried through the chunk's product, one D x D matrix.

Usage:

    from path_attention import path_attention, PathAttention
    o = path_attention(q, k, v, w, beta, g=None)        # q, k, w: (B, H, T, D); beta, g: (B, H, T)
    layer = PathAttention(cfg, forget_gate=True)       # PaTH-FoX layer, cfg: train.ModelConfig

Shapes: B batch, H heads, T time, D head dim (q, k, w), Dv value head dim, BL block length,
n = T / BL blocks, d_model = H * D.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import Method, causal_mask, note_logits, pick_backend, sdpa

BACKEND = None  # None = choose (Triton on CUDA, "torch" on CPU); or force "naive" | "torch" | "triton"


def _defaults(q, g, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    f = torch.promote_types(q.dtype, torch.float32)              # float64 stays float64
    G = None if g is None else g.to(f).cumsum(-1)                # (B, H, T) cumulative log gate
    return scale, G


# =============================================================================================
# Naive references: one reflection at a time
# =============================================================================================

def path_attention_naive(q, k, v, w, beta, g=None, scale=None):
    """The definition, read literally. q, k, w: (B, H, T, D); v: (B, H, T, Dv); beta, g: (B, H, T).

    For each query i and key j <= i: logit_ij = scale q_i^T H_i H_{i-1} ... H_{j+1} k_j + G_i - G_j,
    the product applied to q_i one reflection at a time, q^T H_t = q^T - beta_t (q . w_t) w_t^T.
    Two Python loops over (i, j): the ground truth for tests at small T."""
    scale, G = _defaults(q, g, scale)
    B, H, T, D = q.shape
    f = torch.promote_types(q.dtype, torch.float32)
    q, k, v, w, beta = q.to(f), k.to(f), v.to(f), w.to(f), beta.to(f)
    rows = []
    for i in range(T):
        qt, row = q[:, :, i], []                                   # (B, H, D): q_i^T H_i ... H_{j+1}
        for j in range(i, -1, -1):
            row.append(scale * (qt * k[:, :, j]).sum(-1))          # (B, H)
            qt = qt - beta[:, :, j, None] * (qt * w[:, :, j]).sum(-1, keepdim=True) * w[:, :, j]
        future = q.new_full((B, H, T - i - 1), -math.inf)          # keys after the query
        rows.append(torch.cat([torch.stack(row[::-1], -1), future], -1))
    logits = torch.stack(rows, 2)                                  # (B, H, T, T)
    if G is not None:
        logits = logits + (G[..., :, None] - G[..., None, :]).to(f)
    return (logits.softmax(-1) @ v).to(v.dtype)


def path_attention_carry(q, k, v, w, beta, g=None, scale=None):
    """`path_attention_naive` with the loop over queries vectorised: every query is carried leftwards
    at once, so one loop of T steps builds the (T, T) logits. A faster reference for tests."""
    scale, G = _defaults(q, g, scale)
    B, H, T, D = q.shape
    f = torch.promote_types(q.dtype, torch.float32)
    q, k, v, w, beta = q.to(f), k.to(f), v.to(f), w.to(f), beta.to(f)
    logits = q.new_full((B, H, T, T), -math.inf)
    qt = q                                                       # (B, H, T, D): q_i H_i ... H_{i-d+1}
    for d in range(T):
        i = torch.arange(d, T, device=q.device)                 # queries that reach key i - d
        logits[:, :, i, i - d] = scale * (qt[:, :, d:] * k[:, :, : T - d]).sum(-1)
        wd, bd = w[:, :, : T - d], beta[:, :, : T - d, None]    # the reflection at key i - d
        qt = qt[:, :, d:] - bd * (qt[:, :, d:] * wd).sum(-1, keepdim=True) * wd
        qt = torch.cat([q[:, :, :d], qt], dim=2)                # rows < d are finished, keep shape
    if G is not None:
        logits = logits + (G[..., :, None] - G[..., None, :]).to(f)
    return (logits.softmax(-1) @ v).to(v.dtype)


# =============================================================================================
# The UT transform, blockwise (shared by the PyTorch path and the Triton kernel)
# =============================================================================================

def ut_blocks(q, k, w, beta, scale, BL):
    """Per block of BL tokens: the UT factors and the boundary-adjusted queries and keys.

    q, k, w: (B, H, T, D) with T a multiple of BL; beta: (B, H, T). Returns, in float32 (float64
    for float64 input):
      qh: (B, H, T, D)  queries carried to the start of their block, q_i^T H_i ... H_{block start}
      kh: (B, H, T, D)  keys carried to the end of their block, H_{block end - 1} ... H_{j+1} k_j
      wb: (B, H, T, D)  w and u = A W: (B, H, T, D), the block product P = I - W^T U
      sd: (B, H, T, BL)  scaled logits inside each block (only j <= i is meaningful)"""
    with torch.autocast(q.device.type, enabled=False):   # the solve and products stay in float32
        return _ut_blocks(q, k, w, beta, scale, BL)


def _ut_blocks(q, k, w, beta, scale, BL):
    B, H, T, D = q.shape
    n = T // BL
    f = torch.promote_types(q.dtype, torch.float32)
    qb, kb, wb = (x.to(f).reshape(B, H, n, BL, D) for x in (q, k, w))     # (B, H, n, BL, D)
    bb = beta.to(f).reshape(B, H, n, BL)                                   # (B, H, n, BL)
    eye = torch.eye(BL, device=q.device, dtype=f)
    Tm = eye + (bb[..., :, None] * (wb @ wb.mT)).tril(-1)                  # (B, H, n, BL, BL)
    A = torch.linalg.solve_triangular(Tm, torch.diag_embed(bb), upper=False, unitriangular=True)
    u = A @ wb                                                             # (B, H, n, BL, D)
    QW = (qb @ wb.mT).tril()                                               # q_i . w_a, a <= i
    F_ = A @ (wb @ kb.mT).tril(-1)                                         # A (w_b . k_j, b > j)
    qh = qb - QW @ u
    kh = kb - F_.mT @ wb
    sd = scale * (qb @ kb.mT - QW @ F_)                                    # (B, H, n, BL, BL)
    flat = lambda x: x.reshape(B, H, T, x.shape[-1])  # noqa: E731
    return flat(qh), flat(kh), flat(wb), flat(u), flat(sd)


def _pad_time(BL, *xs):
    """Zero-pad the time axis (dim 2) to a multiple of BL. A zero w with beta = 0 is H = I, and
    padded keys come after every real query, so padding changes no real output."""
    T = xs[0].shape[2]
    pad = -T % BL
    if pad == 0:
        return xs
    return tuple(None if x is None else F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad)) for x in xs)


def path_attention_torch(q, k, v, w, beta, g=None, scale=None, block: int = 64):
    """The blockwise algorithm of the Triton kernel in plain PyTorch (autograd for the backward).
    Builds each query block's logits against every key block up to its own, (BL, (i + 1) BL), so
    it is for CPU-sized problems; same contract as the naive one."""
    scale, G = _defaults(q, g, scale)
    B, H, T, D = q.shape
    q, k, v, w, beta = _pad_time(block, q, k, v, w, beta)
    Tp, BL = q.shape[2], block
    n = Tp // BL
    qh, kh, wb, u, sd = ut_blocks(q, k, w, beta, scale, BL)
    split = lambda x: x.reshape(B, H, n, BL, x.shape[-1]) # noqa: E731  (B, H, n, BL, .)
    qh, kh, wb, u, sd = map(split, (qh, kh, wb, u, sd))
    P = torch.eye(D, dtype=u.dtype, device=q.device) - wb.mT @ u   # (B, H, n, D, D) each block's product
    inside = torch.ones(BL, BL, dtype=torch.bool, device=q.device).tril()
    blocks = [[None] * i + [s.masked_fill(~inside, -math.inf)] for i, s in enumerate(sd.unbind(2))]
    qt = qh                                                   # query states of blocks d..n-1
    for d in range(1, n):                                     # blocks[i][m]: (B, H, BL, BL) logits
        qt = qt[:, :, 1:]                                     # blocks i = d..n-1 score key block i-d
        for i, s in enumerate((scale * qt @ kh[:, :, : n - d].mT).unbind(2), start=d):
            blocks[i][i - d] = s
        qt = qt @ P[:, :, : n - d]                            # carry through P_{i-d}
    logits = [torch.cat(row, -1) for row in blocks]          # (B, H, BL, (i + 1) BL) per query block i
    logits[-1] = logits[-1][:, :, : T - (n - 1) * BL]         # the real queries of the last block
    if G is not None:
        G = F.pad(G, (0, Tp - T))
        logits = [x + G[..., i * BL:i * BL + x.shape[2], None] - G[..., None, :(i + 1) * BL]
                  for i, x in enumerate(logits)]
    note_logits(logits)
    vf = v.to(sd.dtype)
    out = [x.softmax(-1) @ vf[:, :, :(i + 1) * BL] for i, x in enumerate(logits)]
    return torch.cat(out, 2).to(v.dtype)


# =============================================================================================
# Fast path
# =============================================================================================

def _triton_ok():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@torch.compiler.disable   # --compile: inductor would pass the kernels' float arguments as fp64
def path_attention_triton(q, k, v, w, beta, g=None, scale=None, block: int | None = None,
                          chunk: int | None = None):
    """The Triton fast path (kernels/path_attention.py), same contract as `path_attention_naive`;
    q, k, v in fp16/bf16/fp32. Pads T to whole blocks, runs the UT preprocessing (fused in Triton
    for 16-bit inputs with D >= 32, `ut_blocks` otherwise), then the blockwise attention. `block`
    is BL, `chunk` the R blocks per chunk (tests use small ones)."""
    from kernels import path_attention as kp          # Triton is imported where it is used

    B, H, T, D = q.shape
    DV = v.shape[-1]
    if D not in (16, 32, 64, 128) or DV not in (16, 32, 64, 128):
        raise ValueError(f"the PaTH Triton kernel takes head dims 16, 32, 64 or 128, got D={D}, Dv={DV}")
    scale = D ** -0.5 if scale is None else scale
    BL = block or kp.block_size(max(D, DV), q.dtype)
    q, k, v, w, beta, g = _pad_time(BL, q, k, v, w, beta, g)
    Tp = q.shape[2]
    G = None if g is None else g.float().cumsum(-1).reshape(B * H, Tp).contiguous()
    f32 = torch.float32
    flat = lambda x, dt=None: x.reshape(B * H, Tp, x.shape[-1]).to(dt or x.dtype).contiguous()  # noqa: E731
    w = flat(w, f32)
    # float32 inputs: exact float32 products in PyTorch (cuBLAS). D = 16: the fused kernel's bf16
    # products hit an illegal memory access on an H100 (Triton 3.6), so PyTorch as well.
    wu = ()                                                 # W and U in fp16, where they carry the states
    if q.dtype == torch.float32 or D < 32:
        qh, kh, _, u, sd = (flat(x) for x in ut_blocks(q, k, w.view(B, H, Tp, D), beta, scale, BL))
        with torch.autocast(q.device.type, enabled=False):  # M = W^T U per block, in float32
            mb = w.view(B * H, Tp // BL, BL, D).mT @ u.view(B * H, Tp // BL, BL, D)
    else:                                                   # 16-bit inputs: fused, tensor-core products
        qh, kh, mb, sd, u = kp.UTBlocks.apply(flat(q), flat(k), w, beta.reshape(B * H, Tp).float().contiguous(),
                                              scale, BL, D in kp.CARRY_WU, kp.m_read(D, q.dtype))
        wu = (w.to(torch.float16), u) if D in kp.CARRY_WU else ()
    o = kp.PathScan.apply(qh, kh, flat(v), mb, sd, G, scale, BL, chunk or kp.CHUNK, *wu)
    return o.view(B, H, Tp, DV)[:, :, :T]


def path_attention(q, k, v, w, beta, g=None, scale=None):
    """PaTH attention (causal), same contract as `path_attention_naive`. Triton on CUDA, the
    blockwise PyTorch path on CPU; `BACKEND` forces one."""
    backend = pick_backend(BACKEND, "path_attention", q.is_cuda, _triton_ok() and q.shape[-1] in (16, 32, 64, 128),
                           f"no Triton kernel for head dim {q.shape[-1]} (triton installed: {_triton_ok()})")
    fn = {"naive": path_attention_naive, "torch": path_attention_torch, "triton": path_attention_triton}[backend]
    return fn(q, k, v, w, beta, g, scale)


# =============================================================================================
# Decoding: one token at a time with a key cache carried forward in place
# =============================================================================================

def path_decode_step(cache: dict, q, k, v, w, beta, g=None, scale=None):
    """One decoding step. q, k, w: (B, H, D); v: (B, H, Dv); beta, g: (B, H). `cache` (start with
    {}) holds the keys carried to the current position, the values and the gate cumsum.

    Token t first reflects every cached key, k_j <- (I - beta_t w_t w_t^T) k_j, so the cache
    always holds H_t ... H_{j+1} k_j, then appends its own key and attends."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if "k" in cache:
        K = cache["k"]                                                    # (B, H, t, D)
        K -= beta[..., None, None] * (K @ w[..., :, None]) * w[..., None, :]  # in place
        cache["k"] = torch.cat([K, k[:, :, None]], dim=2)
        cache["v"] = torch.cat([cache["v"], v[:, :, None]], dim=2)
    else:
        cache["k"], cache["v"] = k[:, :, None].clone(), v[:, :, None].clone()
    logits = scale * (cache["k"] @ q[..., :, None])[..., 0]                # (B, H, t + 1)
    if g is not None:
        G = cache.get("G_last", torch.zeros_like(g)) + g                  # G_t
        cache["G"] = torch.cat([cache["G"], G[..., None]], -1) if "G" in cache else G[..., None]
        cache["G_last"] = G
        logits = logits + G[..., None] - cache["G"]
    return (logits.softmax(-1)[..., None, :] @ cache["v"])[..., 0, :]     # (B, H, Dv)


# =============================================================================================
# Layers
# =============================================================================================

class PathAttention(nn.Module):
    """Causal multi-head PaTH attention (no RoPE). w_t: a rank-32 projection of x_t, a causal
    depthwise convolution of width 3, then unit length per head; beta_t = 2 sigmoid(linear(x_t));
    with forget_gate=True (PaTH-FoX) also g_t = logsigmoid(linear(x_t)) per head."""

    def __init__(self, cfg, forget_gate: bool = False, rank: int = 32, conv: int = 3):
        super().__init__()
        if not cfg.causal:
            raise ValueError("PaTH attention is causal; this task needs a bidirectional model")
        C, H = cfg.d_model, cfg.n_heads
        self.H, self.D, self.conv_width = H, C // H, conv
        self.qkv = nn.Linear(C, 3 * C, bias=False)
        self.out = nn.Linear(C, C, bias=False)
        self.w_proj = nn.Sequential(nn.Linear(C, rank, bias=False), nn.Linear(rank, C, bias=False))
        self.w_conv = nn.Conv1d(C, C, conv, groups=C, padding=conv - 1, bias=False)  # causal after cropping
        self.beta = nn.Linear(C, H)
        self.gate = nn.Linear(C, H) if forget_gate else None

    def gates(self, x):
        """x: (B, T, d_model) -> w (B, H, T, D) float32 unit vectors, beta, g: (B, H, T)."""
        B, T, _ = x.shape
        f = torch.promote_types(x.dtype, torch.float32)                   # at least float32
        w = self.w_conv(self.w_proj(x).transpose(1, 2))[..., :T]          # (B, d_model, T)
        w = F.normalize(w.to(f).view(B, self.H, self.D, T).transpose(2, 3), dim=-1)
        beta = 2 * torch.sigmoid(self.beta(x).to(f)).transpose(1, 2)      # (B, H, T)
        g = None if self.gate is None else F.logsigmoid(self.gate(x).to(f)).transpose(1, 2)
        return w, beta, g

    def forward(self, x, ctx=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, self.D).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        w, beta, g = self.gates(x)
        o = path_attention(q, k, v, w, beta, g)
        return self.out(o.transpose(1, 2).reshape(B, T, C))

    def step(self, x, cache: dict):
        """Decode one token. x: (B, d_model); cache: {} at the start, updated in place."""
        B, C = x.shape
        hist = torch.cat([cache["x"], x[:, None]], 1) if "x" in cache else x[:, None]
        cache["x"] = hist[:, -self.conv_width:]                          # inputs the conv still needs
        w, beta, g = self.gates(cache["x"])
        q, k, v = self.qkv(x).view(B, 3, self.H, self.D).unbind(1)        # 3 x (B, H, D)
        o = path_decode_step(cache.setdefault("attn", {}), q, k, v, w[:, :, -1], beta[:, :, -1],
                             None if g is None else g[:, :, -1])
        return self.out(o.reshape(B, C))


class FoxAttention(nn.Module):
    """The Forgetting Transformer's attention (the FoX baseline): softmax attention whose logits
    get G_i - G_j, G the cumsum of g_t = logsigmoid(linear(x_t)) per head. No position encoding."""

    def __init__(self, cfg):
        super().__init__()
        if not cfg.causal:
            raise ValueError("FoX attention is causal; this task needs a bidirectional model")
        C, H = cfg.d_model, cfg.n_heads
        self.H, self.D = H, C // H
        self.qkv = nn.Linear(C, 3 * C, bias=False)
        self.out = nn.Linear(C, C, bias=False)
        self.gate = nn.Linear(C, H)

    def forward(self, x, ctx=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, self.D).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        f = torch.promote_types(x.dtype, torch.float32)
        G = F.logsigmoid(self.gate(x).to(f)).transpose(1, 2).cumsum(-1)            # (B, H, T)
        bias = (G[..., :, None] - G[..., None, :]).masked_fill(~causal_mask(T, x.device), -math.inf)  # (B, H, T, T)
        o = sdpa(q, k, v, attn_mask=bias.to(q.dtype))
        return self.out(o.transpose(1, 2).reshape(B, T, C))


PATH = Method(PathAttention, causal_only=True)
PATH_FOX = Method(functools.partial(PathAttention, forget_gate=True), causal_only=True)
FOX = Method(FoxAttention, causal_only=True)
