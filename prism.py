"""PRISM: positions as probability distributions, tracked by a differentiable histogram filter.

Paper: "Position as Probability: Self-Supervised Transformers that Think Past Their Training for
Length Extrapolation" (Lee, 2025; arXiv:2506.00920), sections 4-6 and Algorithms 1-4 (appendix C).

Each cursor c keeps a histogram h_t over P position bins. Token t's gates move it (Algorithm 1),
with S = sum_i h[i] the mass:

    reset branch:     h'[1] += S p_reset p_inc          h'[0] += S p_reset (p_dec + p_keep)
    no-reset branch:  h'[i]   += h[i] (1 - p_reset) p_keep
                      h'[i+1] += h[i] (1 - p_reset) p_inc     (clamped at P - 1)
                      h'[i-1] += h[i] (1 - p_reset) p_dec     (clamped at 0)
    copy (optional):  h' *= p_nocopy ;  h'[k] += S p_copy[k]
    sharpen:          h' = (h' + eps)^gamma_c / sum (h' + eps)^gamma_c     (gamma_c learned, init 2)

(p_inc, p_dec, p_keep) is a categorical over three moves and p_reset a separate Bernoulli, both
read from a GRU over the token embeddings. Before token 0 every histogram is one-hot at bin 0 and
token t's histogram is token t-1's moved by token t's gates: with p_inc = 1 it counts tokens
(absolute position), with resets it counts from the last reset (a relative position).

A histogram becomes a vector by superposition of a sinusoidal table f over the bins,
g_t = sum_k h_t[k] f(k) (Algorithm 2); the cursors of a head are normalised together (Algorithm 3)
and give position scores sum_c |alpha_{h,c}| <g_q, g_k> / sqrt(O d) (Algorithm 4), mixed with the
content scores per head (eq. 8):  a_ts = mu_h <q_t, k_s> / sqrt(D) + (1 - mu_h) position_ts.
Queries and keys have separate cursors.

Usage:

    from prism import histogram_scan
    hist = histogram_scan(p_reset, p_inc, p_dec, p_keep, gamma, P)    # gates: (B, N, T) -> (B, N, T, P)

    python train.py --method prism --task copy      # options: --method-opt prism_cursors / _bins / _dim / _blocks
                                                    #   / _alpha (initial alpha, 8) / _copy
    python prism.py --plot runs/copy/prism          # cursor modes, gates and attention of a trained run

Shapes: B batch, T time, N cursors (O per head), P histogram bins, d sinusoid width, H heads.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from model import Hooks, Method, Model, ModelConfig, Opt, batch_context, causal_mask, note_logits, pick_backend

BACKEND = None  # None = choose (Triton on CUDA, else "torch"); or "naive" | "torch" | "triton"


# =============================================================================================
# Naive reference: Algorithm 1, bin by bin
# =============================================================================================

def histogram_step_naive(h, p_reset, p_inc, p_dec, p_keep, gamma, p_copy=None, eps: float = 1e-6):
    """One update. h: (..., P); gates and gamma: (...); p_copy: (..., P + 1), last entry = no copy."""
    P = h.shape[-1]
    if P < 2:
        raise ValueError(f"a histogram needs at least 2 bins, got P={P}")
    total = h.sum(-1)
    out = [torch.zeros_like(total) for _ in range(P)]                 # h'[i], one tensor per bin
    out[1] = out[1] + total * p_reset * p_inc                           # reset branch
    out[0] = out[0] + total * p_reset * (p_dec + p_keep)
    w_inc, w_dec, w_keep = (1 - p_reset) * p_inc, (1 - p_reset) * p_dec, (1 - p_reset) * p_keep
    for i in range(P):                                                  # no-reset branch
        out[i] = out[i] + h[..., i] * w_keep
        out[min(i + 1, P - 1)] = out[min(i + 1, P - 1)] + h[..., i] * w_inc
        out[max(i - 1, 0)] = out[max(i - 1, 0)] + h[..., i] * w_dec
    if p_copy is not None:                                              # copy branch
        for k in range(P):
            out[k] = out[k] * p_copy[..., P] + total * p_copy[..., k]
    h_next = torch.stack(out, -1)
    sharp = (h_next + eps) ** gamma[..., None]                          # sharpen and renormalise
    return sharp / sharp.sum(-1, keepdim=True)


def _scan(step, p_reset, p_inc, p_dec, p_keep, gamma, P, p_copy=None, eps: float = 1e-6):
    B, N, T = p_reset.shape
    gamma = torch.as_tensor(gamma, dtype=p_reset.dtype, device=p_reset.device).expand(B, N)
    h = torch.zeros(B, N, P, dtype=p_reset.dtype, device=p_reset.device)
    h[..., 0] = 1                                                       # one-hot at 0 before token 0
    hist = []
    for t in range(T):
        h = step(h, p_reset[..., t], p_inc[..., t], p_dec[..., t], p_keep[..., t], gamma,
                 None if p_copy is None else p_copy[:, :, t], eps)
        hist.append(h)
    return torch.stack(hist, 2)                                         # (B, N, T, P)


def histogram_scan_naive(p_reset, p_inc, p_dec, p_keep, gamma, P: int, p_copy=None, eps: float = 1e-6):
    """gates: (B, N, T); gamma: broadcastable to (B, N); p_copy: (B, N, T, P + 1) -> (B, N, T, P)."""
    return _scan(histogram_step_naive, p_reset, p_inc, p_dec, p_keep, gamma, P, p_copy, eps)


# =============================================================================================
# Fast path: the same step with whole-vector shifts
# =============================================================================================

def histogram_step(h, p_reset, p_inc, p_dec, p_keep, gamma, p_copy=None, eps: float = 1e-6):
    """`histogram_step_naive` without the loop over bins: moving mass by one bin is a shift of the
    whole vector, with the mass that would leave the ends kept in the end bins (the clamp)."""
    P = h.shape[-1]
    if P < 2:
        raise ValueError(f"a histogram needs at least 2 bins, got P={P}")
    total = h.sum(-1, keepdim=True)
    w = (1 - p_reset)[..., None]
    up = torch.cat([torch.zeros_like(h[..., :1]), h[..., :-2], h[..., -2:].sum(-1, keepdim=True)], -1)
    down = torch.cat([h[..., :2].sum(-1, keepdim=True), h[..., 2:], torch.zeros_like(h[..., :1])], -1)
    h_next = w * (p_keep[..., None] * h + p_inc[..., None] * up + p_dec[..., None] * down)
    first_two = torch.stack([p_dec + p_keep, p_inc], -1) * (total * p_reset[..., None])  # (..., 2)
    h_next = h_next + torch.cat([first_two, torch.zeros_like(h[..., 2:])], -1)
    if p_copy is not None:
        h_next = h_next * p_copy[..., P:] + total * p_copy[..., :P]
    sharp = (h_next + eps) ** gamma[..., None]
    return sharp / sharp.sum(-1, keepdim=True)


def histogram_scan(p_reset, p_inc, p_dec, p_keep, gamma, P: int, p_copy=None, eps: float = 1e-6):
    """Same contract as `histogram_scan_naive`. On CUDA the Triton scan of kernels/prism_scan.py:
    one program per (batch, cursor), forward and backward, copy branch included; otherwise the
    vectorised step in a loop over T (each step needs the last)."""
    backend = pick_backend(BACKEND, "histogram_scan", p_reset.is_cuda, True)
    if backend == "naive":
        return histogram_scan_naive(p_reset, p_inc, p_dec, p_keep, gamma, P, p_copy, eps)
    if backend == "triton":
        from kernels.prism_scan import histogram_scan_triton
        return histogram_scan_triton(p_reset, p_inc, p_dec, p_keep, gamma, P, p_copy, eps)
    return _scan(histogram_step, p_reset, p_inc, p_dec, p_keep, gamma, P, p_copy, eps)


# =============================================================================================
# From histograms to position scores (Algorithms 2-4): as written (the reference), then through
# the Gram matrix (what the model runs)
# =============================================================================================

def sinusoid_table(P: int, d: int, device=None) -> torch.Tensor:
    """(P, d): f(k) = [sin(k w_j), cos(k w_j)], w_j = 10000^(-2j/d), the transformer's table."""
    k = torch.arange(P, device=device, dtype=torch.float32)[:, None]
    w = 10000.0 ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    return torch.stack([torch.sin(k * w), torch.cos(k * w)], -1).flatten(-2)[:, :d]


def superpose(hist, table):
    """Algorithm 2: g_t = sum_k h_t[k] f(k), one matrix product. hist (..., P) -> (..., d)."""
    return hist @ table


def normalise(g, H: int):
    """Algorithm 3 (the projection-free norm): the cursors of one head, at one position, scaled
    together to norm sqrt(d). g: (B, H*O, T, d) -> (B, H, O, T, d)."""
    B, HO, T, d = g.shape
    g = g.view(B, H, HO // H, T, d)
    norm = g.pow(2).sum((2, 4), keepdim=True).sqrt().clamp(min=1e-6)   # over (O, d) per (b, h, t)
    return g / norm * d ** 0.5


def position_scores(gq, gk, alpha):
    """Algorithm 4: sum_c |alpha_{h,c}| <gq_c, gk_c> / sqrt(O d). gq, gk: (B, H, O, T, d);
    alpha: (H, O) -> (B, H, T, T)."""
    B, H, O, T, d = gq.shape
    gq = (gq * alpha.abs()[None, :, :, None, None]).permute(0, 1, 3, 2, 4).reshape(B, H, T, O * d)
    gk = gk.permute(0, 1, 3, 2, 4).reshape(B, H, gk.shape[3], O * d)     # cursors side by side
    return gq @ gk.transpose(-1, -2) / (O * d) ** 0.5


# ---- the model's path ----------------------------------------------------------------------

# cursor_scores' path: "torch", or "triton": kernels/prism_scores.py, which holds a histogram in one tile (up to
# SCORES_KERNEL_BINS bins) and on a GPU computes in TF32, so it is taken there under --tf32 alone. Opt-in: at the
# paper-size runs' shapes the compiled PyTorch path is faster (docs/perf/prism.md).
SCORES_BACKEND = "torch"
SCORES_KERNEL_BINS = 128
# the dtype the scores are kept in between the position update and the blocks that read them: float32. float16
# halves their traffic: a switch for timing (docs/perf/step_profile.py --half-scores) that no run sets.
SCORES_DTYPE = torch.float32


def cursor_scores(hist, gram, H: int, d: int):
    """Algorithms 2-4 up to the cursor scales, from the histograms: each cursor's <g_q, g_k> / sqrt(O d)
    of the normalised streams. With g = h F (Algorithm 2) every inner product of two streams is one of
    histograms through the Gram matrix F F^T, <g, g'> = h (F F^T) h'^T, norms included, so the
    d-wide streams are never formed (fewer operations and far less memory while P is below about 1.5 d).
    hist: (2, B, H O, T, P), the query cursors (side 0) and the key cursors (side 1), each side one block
    of memory, so that the products read either side without copying it; gram: (P, P), the table's width
    d -> (B, H, O, T, T): d <g_q, g_k> / (|g_q| |g_k|) / sqrt(O d), the norms over a head's cursors.
    Every block between two position updates reads these with its own alpha (`mix_cursors`)."""
    _, B, HO, T, P = hist.shape
    O = HO // H
    # the kernels' products: TF32 on a GPU, taken there under --tf32 alone; float32 through the interpreter
    precision_ok = torch.backends.cuda.matmul.allow_tf32 or not hist.is_cuda
    if SCORES_BACKEND == "triton" and P <= SCORES_KERNEL_BINS and precision_ok:
        from kernels.prism_scores import cursor_dots_triton
        dots, sq = cursor_dots_triton(hist, gram, H)                      # the same, h G kept in registers
    else:
        hg = hist @ gram                                                  # h F F^T: (2, B, H O, T, P)
        sq = (hg * hist).sum(-1)                                          # |g|^2 of each cursor
        dots = hg[0].reshape(B, H, O, T, P) @ hist[1].reshape(B, H, O, T, P).transpose(-1, -2)
    norm = sq.view(2, B, H, O, T).sum(3).clamp(min=1e-12).sqrt()          # Algorithm 3, over (O, d): (2, B, H, T)
    return (dots * (d / O) ** 0.5 / (norm[0][:, :, None, :, None] * norm[1][:, :, None, None, :])).to(SCORES_DTYPE)


def sides_first(x):
    """(B, 2 H O, ...) per cursor, the query cursors then the key cursors -> (2 B, H O, ...): the query
    cursors of every sequence, then the key cursors (the layout `cursor_scores` reads)."""
    B, N = x.shape[:2]
    return x.view(B, 2, N // 2, *x.shape[2:]).transpose(0, 1).reshape(2 * B, N // 2, *x.shape[2:])


def mix_cursors(scores, alpha):
    """sum_c |alpha_{h,c}| scores_c: (B, H, O, T, T), alpha (H, O) -> (B, H, T, T). With
    `cursor_scores`: `position_scores` of the normalised streams, reassociated."""
    return (scores * alpha.abs()[:, :, None, None]).sum(2)


# =============================================================================================
# The model parts: gate network and position streams (hooks), attention layer
# =============================================================================================

GAMMA_INIT = 2.0
ALPHA_INIT = 8.0   # see PrismAttention


class OrthogonalExp(nn.Module):
    """Parametrisation of an (n, k) matrix, n >= k, with orthonormal columns (section 6.3):

        W = base · exp(S)[:, :k],   S = Y - Y^T,   Y = [tril(X), 0] (n x n),

    torch.nn.utils.parametrizations.orthogonal with orthogonal_map="matrix_exp" (base: the initial
    weight, completed to an orthogonal n x n matrix; X starts at zero). exp is evaluated here with a
    fixed scaling and squaring, a Taylor polynomial of degree DEGREE on S / 2^SQUARINGS, so that no
    step waits for a value read back from the GPU (torch.matrix_exp picks its degree on the host) and
    the training step fits in a CUDA graph; torch's default for non-square matrices, Householder
    products, spends most of a PRISM training step in its backward. Truncation error: below
    float32 rounding while |S| < 2^SQUARINGS (S stays far smaller: X starts at zero)."""

    SQUARINGS, DEGREE = 6, 8

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("base", torch.eye(n))

    def forward(self, X):
        n, k = X.shape
        Y = torch.cat([X.tril(), X.new_zeros(n, n - k)], 1)                  # (n, n)
        S = (Y - Y.T) / 2 ** self.SQUARINGS
        eye = torch.eye(n, dtype=X.dtype, device=X.device)
        E = eye
        for j in range(self.DEGREE, 0, -1):                                   # Horner: sum_j S^j / j!
            E = eye + S @ E / j
        for _ in range(self.SQUARINGS):
            E = E @ E
        return self.base @ E[:, :k]

    def right_inverse(self, W):
        n, k = W.shape
        full = torch.cat([W, torch.randn(n, n - k, dtype=W.dtype, device=W.device)], 1)
        Q, R = torch.linalg.qr(full)
        self.base.copy_(Q * R.diagonal().sign())                              # W's columns, orthonormalised
        return torch.zeros_like(W)


class FrobeniusScaled(nn.Module):
    """Parametrisation of W_hh from the paper's footnote to section 6.3 (an ablation): W = g sqrt(k)
    V / ||V||_F, a fixed multiple sqrt(k) (the Frobenius norm of k orthonormal columns) of a small
    learnable scalar g, starting at `scale`. With g < 1 the recurrence forgets, so the gates depend on
    the recent stream more than on how long the sequence has run."""

    def __init__(self, k: int, scale: float):
        super().__init__()
        self.k, self.g = k, nn.Parameter(torch.tensor(float(scale)))

    def forward(self, V):
        return self.g * self.k ** 0.5 * V / V.norm()


class PrismGates(nn.Module):
    """A GRU (hidden 100) over the residual stream, emitting per cursor p_reset (Bernoulli) and
    (p_inc, p_dec, p_keep) (categorical). The hidden-to-hidden matrix is kept orthogonal (with
    whh_scale > 0, an ablation: Frobenius-scaled, see FrobeniusScaled).

    The GRU's weights are this module's own parameters, initialised as nn.GRU does, and go to the
    GRU op as they are. The nn.GRU module would, on CUDA, copy its weights into one cuDNN buffer on
    every call (a parametrised weight is a new tensor each time) and point its parameters at that
    buffer; captured in a CUDA graph, that copy runs again at every replay and writes the weights
    of the capture's time over the trained ones."""

    def __init__(self, d_model: int, n_cursors: int, hidden: int = 100, fixed_input: bool = False,
                 whh_scale: float = 0.0, count_bias: float = 0.0):
        super().__init__()
        self.n, self.hidden = n_cursors, hidden
        bound = hidden ** -0.5
        uniform = lambda *shape: nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))  # noqa: E731
        self.w_ih, self.w_hh = uniform(3 * hidden, d_model), uniform(3 * hidden, hidden)    # gates r, z, n
        self.b_ih, self.b_hh = uniform(3 * hidden), uniform(3 * hidden)
        parametrize.register_parametrization(self, "w_hh", FrobeniusScaled(hidden, whh_scale) if whh_scale > 0
                                             else OrthogonalExp(3 * hidden))
        for p in (self.w_ih, self.b_ih, self.b_hh) if fixed_input else ():  # an ablation: the GRU reads the
            p.requires_grad_(False)                                        # stream through a fixed random map
        self.head = nn.Linear(hidden, 4 * n_cursors)
        if count_bias:                   # every cursor starts out counting tokens (reset rare, increment
            with torch.no_grad():        # likely) instead of nn.Linear's random biases; the paper gives neither
                self.head.bias.copy_(torch.tensor([-count_bias, count_bias, 0.0, 0.0]).repeat(n_cursors))

    def forward(self, h):
        """h: (B, T, d_model) -> p_reset, p_inc, p_dec, p_keep: (B, n_cursors, T) float32."""
        B, T, _ = h.shape
        h0 = h.new_zeros(1, B, self.hidden, dtype=torch.float32)
        with torch.autocast(h.device.type, enabled=False), warnings.catch_warnings():  # W_hh and the recurrence
            warnings.filterwarnings("ignore", message="RNN module weights are not part of single contiguous")
            weights = [self.w_ih, self.w_hh, self.b_ih, self.b_hh]                       # in float32
            out, _ = torch.gru(h.float(), h0, weights, True, 1, 0.0, self.training, False, True)  # (B, T, hidden)
        logits = self.head(out).float().view(B, T, self.n, 4).permute(0, 2, 1, 3)   # (B, n, T, 4)
        move = logits[..., 1:].softmax(-1)
        return torch.sigmoid(logits[..., 0]), move[..., 0], move[..., 1], move[..., 2]


class CopyHead(nn.Module):
    """The copy branch's p_copy (section 5.0.4): a causal attention row of query t over the earlier
    tokens s <= t plus a "no copy" logit, one per head. Copying from token s jumps to the bin that
    token's increment-only key cursor holds, s + 1 (clamped at P - 1). -> (B, H, T, P + 1)."""

    def __init__(self, d_model: int, H: int, width: int = 32):
        super().__init__()
        self.H, self.width = H, width
        self.qk = nn.Linear(d_model, 2 * H * width, bias=False)
        self.null = nn.Linear(d_model, H)

    def forward(self, h, P: int):
        B, T, _ = h.shape
        q, k = self.qk(h).float().view(B, T, 2, self.H, self.width).permute(2, 0, 3, 1, 4)  # 2 x (B, H, T, w)
        scores = q @ k.transpose(-1, -2) / self.width ** 0.5                               # (B, H, T, T)
        scores = scores.masked_fill(~causal_mask(T, h.device), -math.inf)
        null = self.null(h).float().transpose(1, 2)[..., None]                              # (B, H, T, 1)
        p = torch.cat([scores, null], -1).softmax(-1)                                       # (B, H, T, T + 1)
        bins = (torch.arange(T, device=h.device) + 1).clamp(max=P - 1)                      # key s -> bin s + 1
        to_bins = torch.zeros(B, self.H, T, P, device=h.device).index_add(-1, bins, p[..., :T])
        return torch.cat([to_bins, p[..., T:]], -1)                                         # (B, H, T, P + 1)


def reachable_bins(P: int, T: int) -> int:
    """The bins a cursor can reach in T steps (T + 1 counts, rounded up to 8), at most the P it has. Batches
    come padded to a multiple of train.Step's bucket (8 or more tokens) on a GPU, so T + 1 is one past such a
    multiple: 8 keeps the products' widths aligned and adds 7 bins, where 32 would add 31 (128 bins for 96 tokens)."""
    return min(P, -(-(T + 1) // 8) * 8)


class PrismHooks(Hooks):
    """Computes the position streams before the chosen blocks and leaves each cursor's position
    scores in ctx for every following block: ctx["prism_scores"] (B, H, O, T, T) (`cursor_scores`);
    ctx["prism_hist"] (2, B, H O, T, P: the query cursors, then the key cursors) and ctx["prism_gates"]
    (4 x (B, 2 H O, T)) keep the histograms and gates for plots.

    A cursor moves at most one bin a token, and a copy jumps to bin s + 1 for a token s <= t, so after
    T tokens it holds mass only in bins 0..T; the bins past those hold the sharpening's eps alone
    (about eps^gamma each, far below float32's resolution of the others' sum). The scan and the
    scores therefore run on the first T + 1 bins only (rounded up to a multiple of 8): the same
    scores to float32 rounding, in a fraction of the work when P is far above T.

    With prism_copy, query cursor 0 of every head gets the copy branch, and its paired key cursor
    only increments (it holds the absolute position the copy jumps to), as in section 6.0.1."""

    def __init__(self, cfg):
        super().__init__(cfg)
        o = cfg.opts
        self.H, self.O = cfg.n_heads, int(o.get("prism_cursors", 4))
        self.P, self.d = int(o.get("prism_bins", 256)), int(o.get("prism_dim", 32))
        self.blocks = [int(b) for b in o.get("prism_blocks", [0])]
        if not self.blocks or max(self.blocks) >= cfg.n_layers or min(self.blocks) < 0:
            raise ValueError(f"prism_blocks {self.blocks}: blocks are numbered 0 to {cfg.n_layers - 1} "
                             f"(the model has {cfg.n_layers})")
        n = 2 * self.H * self.O                                         # query and key cursors
        fixed, scale = bool(o.get("prism_fixed_gru_input", False)), float(o.get("prism_whh_scale", 0.0))
        count = float(o.get("prism_count_bias", 0.0))
        for name, value in (("prism_whh_scale", scale), ("prism_count_bias", count)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0: the default), got {value}")
        self.gates = nn.ModuleList(PrismGates(cfg.d_model, n, fixed_input=fixed, whh_scale=scale, count_bias=count)
                                   for _ in self.blocks)
        # gamma = 1 + softplus(raw) > 1 (the paper's constraint), starting at GAMMA_INIT
        self.gamma_raw = nn.Parameter(torch.full((len(self.blocks), n), math.log(math.expm1(GAMMA_INIT - 1))))
        self.copy = bool(o.get("prism_copy", False))
        self.copy_heads = nn.ModuleList(CopyHead(cfg.d_model, self.H) for _ in self.blocks) if self.copy else None
        table = sinusoid_table(self.P, self.d)
        self.register_buffer("gram", table @ table.T, persistent=False)   # F F^T (`cursor_scores`)

    def before_block(self, i, h, ctx):
        if i not in self.blocks:
            return
        k, (B, T) = self.blocks.index(i), h.shape[:2]
        p_reset, p_inc, p_dec, p_keep = self.gates[k](h)                # (B, 2 H O, T) each
        gamma = 1 + F.softplus(self.gamma_raw[k])[None].expand(B, -1)   # (B, 2 H O)
        P = reachable_bins(self.P, T)
        p_copy = None
        if self.copy:
            n, O = self.H * self.O, self.O
            cursor = torch.arange(2 * n, device=h.device)
            count = (cursor >= n) & (cursor % O == 0)                    # query cursor 0's key cursors:
            one, zero = torch.ones_like(p_inc), torch.zeros_like(p_inc)  # increment only
            c = count[None, :, None]
            p_reset, p_dec, p_keep = (torch.where(c, zero, x) for x in (p_reset, p_dec, p_keep))
            p_inc = torch.where(c, one, p_inc)
            p_copy = self.copy_probs(k, h, P)
        gates = [sides_first(x) for x in (p_reset, p_inc, p_dec, p_keep, gamma)]   # (2 B, H O, T), (2 B, H O)
        hist = histogram_scan(*gates, P, p_copy).view(2, B, -1, T, P)    # a row per cursor: their order is free
        # float32 (no autocast): the scores of neighbouring bins differ by less than bfloat16 resolves
        with torch.autocast(h.device.type, enabled=False):
            ctx["prism_scores"] = cursor_scores(hist.float(), self.gram[:P, :P], self.H, self.d)
        ctx["prism_hist"], ctx["prism_gates"] = hist, (p_reset, p_inc, p_dec, p_keep)

    def copy_probs(self, k: int, h, P: int):
        """p_copy (2 B, H O, T, P + 1) of the copy branch before block self.blocks[k], the cursors' rows
        sides first (`sides_first`): query cursor 0 of each head copies (`CopyHead`), every other cursor
        never does (its last entry 1)."""
        B, T = h.shape[:2]
        p_copy = torch.zeros(2, B, self.H * self.O, T, P + 1, device=h.device)
        p_copy[..., P] = 1
        first = torch.arange(self.H, device=h.device) * self.O            # query cursor 0 of each head
        rows = torch.stack([self.copy_heads[k](h, P), p_copy[1][:, first]])   # (2, B, H, T, P + 1)
        return p_copy.index_copy(2, first, rows).view(2 * B, -1, T, P + 1)


class PrismAttention(nn.Module):
    """a_ts = mu_h <q_t, k_s> / sqrt(D) + (1 - mu_h) sum_c |alpha_{h,c}| <g_q, g_k> / sqrt(O d)
    (eq. 8), mu_h = sigmoid(learned), causal or bidirectional with a key padding mask.

    alpha starts at ALPHA_INIT = 8 (option prism_alpha). The paper does not give its initial value.
    With d = 32 the inner product of two superposed vectors falls off slowly around its peak, so at
    alpha = 1 the position scores barely separate neighbouring keys; short training lengths can be
    fitted with that blurred attention, and it fails as soon as there are more keys to tell apart.
    Measured on copy (CPU preset, 300 steps): exact match 0.61 on lengths 10-18 and 0 past 63 with
    alpha = 1, 1.00 on 10-18 and >= 0.997 up to 100 with alpha = 8."""

    def __init__(self, cfg):
        super().__init__()
        C, H = cfg.d_model, cfg.n_heads
        self.H, self.D, self.causal = H, C // H, cfg.causal
        self.qkv = nn.Linear(C, 3 * C, bias=False)
        self.out = nn.Linear(C, C, bias=False)
        self.mu_logit = nn.Parameter(torch.zeros(H))                     # mu = 0.5 at the start
        O, alpha = int(cfg.opts.get("prism_cursors", 4)), float(cfg.opts.get("prism_alpha", ALPHA_INIT))
        self.alpha = nn.Parameter(torch.full((H, O), alpha))             # cursor scales (own AdamW group)
        self.P = int(cfg.opts.get("prism_bins", 256))

    def check_context(self, ctx):
        """A sequence longer than the bins would clamp every cursor past bin P - 1 (the paper uses
        as many bins as positions); cli.validate calls this on sample batches before a run."""
        T = ctx["tokens"].shape[1]
        if T > self.P:
            raise ValueError(f"sequences of {T} tokens need at least as many bins (prism_bins = {self.P}): "
                             f"set --method-opt prism_bins={T} or more")

    def forward(self, x, ctx):
        if "prism_scores" not in ctx:
            raise RuntimeError("PrismAttention needs ctx['prism_scores'] from PrismHooks (use --method prism)")
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, self.D).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        o = self.weights(q, k, ctx).to(v.dtype) @ v
        return self.out(o.transpose(1, 2).reshape(B, T, C))

    def weights(self, q, k, ctx):
        """Attention weights (B, H, T, T) from q, k: (B, H, T, D) and the position streams."""
        T = q.shape[2]
        mu = torch.sigmoid(self.mu_logit)[:, None, None]
        content = (q @ k.transpose(-1, -2)).float() / self.D ** 0.5               # (B, H, T, T)
        with torch.autocast(q.device.type, enabled=False):                        # float32, as above
            logits = mu * content + (1 - mu) * mix_cursors(ctx["prism_scores"], self.alpha)
        if self.causal:
            logits = logits.masked_fill(~causal_mask(T, q.device), -math.inf)
        if ctx.get("key_mask") is not None:
            logits = logits.masked_fill(~ctx["key_mask"][:, None, None, :], -math.inf)
        note_logits(logits)
        return logits.softmax(-1)


def alpha_group(model, base_lr):
    """The paper's separate AdamW group for the cursor scales alpha (beta 0.8 / 0.92, lr 0.03)."""
    alphas = [p for name, p in model.named_parameters() if name.endswith(".alpha")]
    return [{"params": alphas, "lr": 0.03, "betas": (0.8, 0.92), "weight_decay": 0.0}] if alphas else []


PRISM = Method(PrismAttention, hooks=PrismHooks, param_groups=alpha_group,
               options={"prism_cursors": Opt(int, "query (and key) cursors per head (default 4)", 1),
                        "prism_bins": Opt(int, "histogram bins P, >= the longest sequence (default 256)", 2),
                        "prism_dim": Opt(int, "superposition width d per cursor (default 32)", 2),
                        "prism_blocks": Opt(list, "blocks (0-based) before which positions are computed "
                                                  "(default [0])", 0),
                        "prism_copy": Opt(bool, "the copy branch (default false)"),
                        "prism_alpha": Opt(float, "initial cursor scale alpha (default 8)"),
                        "prism_fixed_gru_input": Opt(bool, "ablation: the gate GRU's input weights and biases stay "
                                                           "at their random initial values (default false)"),
                        "prism_whh_scale": Opt(float, "ablation: W_hh = g sqrt(100) V / |V|_F with a learnable g "
                                                      "starting here, not orthogonal (default 0: orthogonal)", 0),
                        "prism_count_bias": Opt(float, "the gate head's initial biases, reset -b and increment +b, "
                                                       "so that cursors start out counting (the prism-* experiments "
                                                       "use 1) (default 0: nn.Linear's random biases)", 0)})


# =============================================================================================
# Plots from a trained run (paper appendix B):  python prism.py --plot runs/copy/prism
# =============================================================================================

def plot_run(run_dir, length: int | None = None) -> Path:
    """Cursor modes, gate probabilities and the first layer's attention on one example at an
    out-of-distribution length (default: twice the longest training length). Writes
    <run>/prism_plots.png. The task comes from tasks.py, imported at call time: the layer itself
    does not need it."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from tasks import TASKS

    run_dir = Path(run_dir)
    seeds = [run_dir] if (run_dir / "model.pt").exists() else sorted(run_dir.glob("seed*/"))
    if not seeds or not (seeds[0] / "model.pt").exists():
        raise FileNotFoundError(f"no trained model under {run_dir} (expected model.pt or seed*/model.pt)")
    seed_dir = seeds[0]
    meta = json.loads((seed_dir / "metrics.json").read_text())
    if meta["method"] != "prism":
        raise ValueError(f"{seed_dir} is a {meta['method']!r} run, not prism")
    model = Model(ModelConfig(**meta["config"]["model"]), PRISM)
    model.load_state_dict(torch.load(seed_dir / "model.pt", map_location="cpu"))
    model.eval()
    task = TASKS[meta["task"]]
    L = length or 2 * meta["train_max_length"]
    batch = task.sample(1, L, np.random.default_rng(0), **meta["config"]["task_opts"])
    ctx = batch_context(task, batch, "cpu")
    with torch.no_grad():
        h = model.hooks.embed(model.embed(batch.x), ctx)
        model.hooks.before_block(0, h, ctx)
        attn = model.blocks[0].attn
        B, T, C = h.shape
        q, k, _ = attn.qkv(model.blocks[0].norm1(h)).view(B, T, 3, attn.H, attn.D).permute(2, 0, 3, 1, 4)
        weights = attn.weights(q, k, ctx)[0, 0]                               # head 0: (T, T)
    O = model.hooks.O
    modes = ctx["prism_hist"][0, 0].argmax(-1)                                # the query cursors: (H O, T)
    p_reset, p_inc = ctx["prism_gates"][0][0], ctx["prism_gates"][1][0]        # (2 H O, T)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for c in range(O):
        axes[0].plot(modes[c].numpy(), label=f"query cursor {c}")
        axes[1].plot(p_reset[c].numpy(), label=f"reset {c}")
        axes[1].plot(p_inc[c].numpy(), linestyle="--", label=f"inc {c}")
    axes[0].set(title="histogram mode per token (head 0)", xlabel="token", ylabel="bin")
    axes[1].set(title="gate probabilities (head 0)", xlabel="token", ylim=(0, 1))
    axes[2].imshow(weights.numpy(), cmap="viridis")
    axes[2].set(title=f"layer 1 head 0 attention, length {L}", xlabel="key", ylabel="query")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=6, ncol=2)
    fig.suptitle(f"{meta['task']} / prism: {' '.join(task.decode(batch.x[0].tolist()))[:120]}", fontsize=8)
    fig.tight_layout()
    path = seed_dir.parent / "prism_plots.png" if seed_dir != run_dir else run_dir / "prism_plots.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(description="PRISM plots from a trained run (paper appendix B)")
    parser.add_argument("--plot", required=True, metavar="RUN_DIR", help="e.g. runs/copy/prism")
    parser.add_argument("--length", type=int, help="example length (default: 2x the training maximum)")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {plot_run(args.plot, args.length)}")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
