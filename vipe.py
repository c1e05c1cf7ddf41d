"""ViPE: a value-side relative position code with logit rescaling.

Paper: "Dissecting the Role of Positional Encoding in Length Generalization" (anonymous ICLR 2026
submission, section 6, eq. 7-9; no arXiv version: https://openreview.net/forum?id=bppDDqbO3V).

With n the 1-based query position, i <= n the key position, and the base logit
l_ni = q_n . k_i / sqrt(D):

    logits:   l~_ni = lambda_ni * l_ni,      lambda_ni = s * log(n) * (1 + u^T k_i)
    weights:  a_ni  = softmax_i(l~_ni)                                   (causal)
    values:   v~_ni = v_i (+) p_{n-i},       p_{n-i} = W_p (n - i) / s + b_p   ((+): concatenation)
    output:   z_n   = sum_i a_ni v~_ni                                    (Dv + d_p channels)

log(n) keeps the attention entropy from growing with the length, s = L_test_max / L_train_max
(1 in training) compresses distances at test time and restores the contrast, and (1 + u^T k_i)
lets each key scale its own logits.

The fast path is exact. The rescaling factors into a per-query and a per-key factor,

    l~_ni = (s log(n) q_n) . ((1 + u^T k_i) k_i) / sqrt(D),

so it is ordinary softmax attention on rescaled queries and keys. And because each row of a sums to
one, the positional part of z_n is

    sum_i a_ni (W_p (n - i) / s + b_p) = W_p (n - E_n[i]) / s + b_p,     E_n[i] = sum_i a_ni i,

so one extra value channel holding i gives it: z_n = (a v)_n (+) (W_p (n - (a i)_n) / s + b_p).
`vipe_attention` calls SDPA once with v (+) i. SDPA's fast (flash) kernels want the value head dim
equal to the query head dim; with one more channel it falls back to a much slower kernel. So
v (+) i is zero-padded to D channels when Dv < D, and the layer uses a value head of D - 1
channels so that v (+) i is exactly D wide. On CUDA the scaling, the appended channel and the code
are two small Triton kernels each way around that SDPA call (kernels/vipe_attention.py); as PyTorch
ops they cost more than half the attention's own time. (Under bf16 autocast the channel i is
rounded like any bf16 value: E_n[i] carries a relative error of about 2^-8; float32 is exact.)

Usage:

    from vipe import vipe_attention, ViPEAttention
    z = vipe_attention(q, k, v, u, w_p, b_p, s=1.0)   # (B, H, T, Dv + d_p)
    layer = ViPEAttention(cfg)                       # reads ctx["s"] (default 1)

Options (cfg.opts, from `--method-opt`): vipe_mode = "both" | "value" (the value code alone, no
rescaling) | "scale" (the rescaling alone, no value code); vipe_dp = d_p (default 8); vipe_s, the
rule for s beyond the training lengths, and vipe_finetune, the steps trained with the fixed s
before the test (see `final_evaluation`).

Shapes: B batch, H heads, T time, D query/key head dim, Dv value head dim, d_p code width.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import Method, Opt, causal_mask, pick_backend, sdpa

BACKEND = None  # None = choose (Triton on CUDA, "torch" on CPU); or force "naive" | "torch" | "triton"
MODES = ("both", "value", "scale")


# =============================================================================================
# Naive reference: the (T, T) logits and the (T, T, d_p) codes, as written in the paper
# =============================================================================================

def vipe_attention_naive(q, k, v, u, w_p, b_p, s: float = 1.0, rescale: bool = True):
    """q, k: (B, H, T, D); v: (B, H, T, Dv); u: (H, D); w_p, b_p: (H, d_p) -> z: (B, H, T, Dv + d_p).
    rescale=False drops lambda (the value code alone); d_p = 0 drops the code (the rescaling alone)."""
    B, H, T, D = q.shape
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):                            # 16-bit: computed in float32
        q, k, v = q.float(), k.float(), v.float()
    n = torch.arange(1, T + 1, device=q.device, dtype=q.dtype)              # 1-based positions
    logits = q @ k.transpose(-1, -2) / math.sqrt(D)                         # (B, H, T, T) base logits
    if rescale:
        lam = s * torch.log(n)[:, None] * (1 + (k * u[:, None, :]).sum(-1))[..., None, :]  # (B, H, T, T)
        logits = lam * logits
    a = logits.masked_fill(~causal_mask(T, q.device), -math.inf).softmax(-1)                 # (B, H, T, T)
    dist = (n[:, None] - n[None, :]) / s                                    # (T, T) compressed n - i
    codes = dist[None, :, :, None] * w_p[:, None, None, :] + b_p[:, None, None, :]  # (H, T, T, d_p)
    pos = torch.einsum("bhni,hnip->bhnp", a, codes)                         # (B, H, T, d_p)
    return torch.cat([a @ v, pos.to(a.dtype)], dim=-1).to(dtype)


# =============================================================================================
# Fast path: one fused attention call with the key index as an extra value channel
# =============================================================================================

def sdpa_width(D: int, Dv: int) -> int:
    """The one head width for q, k and v (+) i: D when v (+) i fits (the layer's value head is D - 1),
    else the next multiple of 8, so that SDPA keeps a fused kernel (zero channels change nothing)."""
    return D if Dv + 1 <= D else 8 * math.ceil((Dv + 1) / 8)


def attention_with_mean_position(q, k, v, scale: float):
    """Causal softmax attention that also returns E_n[i] = sum_i a_ni i (0-based i), in one SDPA
    call on v (+) i. -> ((B, H, T, Dv), (B, H, T))."""
    B, H, T, D = q.shape
    Dv = v.shape[-1]
    width = sdpa_width(D, Dv)
    idx = torch.arange(T, device=v.device, dtype=v.dtype).expand(B, H, T)[..., None]  # (B, H, T, 1)
    vi = F.pad(torch.cat([v, idx], dim=-1), (0, width - Dv - 1))            # (B, H, T, width)
    q, k = F.pad(q, (0, width - D)), F.pad(k, (0, width - D))               # (B, H, T, width)
    out = sdpa(q, k, vi, is_causal=True, scale=scale)
    return out[..., :Dv], out[..., Dv]


def vipe_attention_torch(q, k, v, u, w_p, b_p, s: float = 1.0, rescale: bool = True):
    """The fast path in PyTorch ops (the CPU backend; float64 anywhere)."""
    B, H, T, D = q.shape
    f = torch.promote_types(q.dtype, torch.float32)                         # float64 stays float64
    if rescale:
        n = torch.arange(1, T + 1, device=q.device, dtype=f)
        q = q * (s * torch.log(n)).to(q.dtype)[:, None]                     # per-query factor
        k = k * (1 + k @ u[:, :, None].to(k.dtype))                         # per-key factor (B, H, T, 1)
    o, mean_i = attention_with_mean_position(q, k, v, D ** -0.5)
    if w_p.shape[-1] == 0:
        return o
    n0 = torch.arange(T, device=q.device, dtype=f)                         # 0-based, like mean_i
    dist = (n0 - mean_i.to(f)) / s                                        # (B, H, T) n - E[i]
    pos = dist[..., None] * w_p[:, None, :] + b_p[:, None, :]               # (B, H, T, d_p)
    return torch.cat([o, pos.to(o.dtype)], dim=-1)


def vipe_attention_triton(q, k, v, u, w_p, b_p, s: float = 1.0, rescale: bool = True):
    """The same SDPA call with the work around it in two Triton kernels each way
    (kernels/vipe_attention.py): no cat, slice or extra elementwise pass."""
    from kernels.vipe_attention import PositionCode, RescaleAppendIndex

    D, Dv = q.shape[-1], v.shape[-1]
    q, k, vi = RescaleAppendIndex.apply(q, k, v, u, s, rescale, sdpa_width(D, Dv))  # 3 x (B, H, T, width)
    o = F.scaled_dot_product_attention(q, k, vi, is_causal=True, scale=D ** -0.5)     # o[..., Dv] = E_n[i]
    if w_p.shape[-1] == 0:
        return o[..., :Dv]
    return PositionCode.apply(o, w_p, b_p, Dv, s)                          # (B, H, T, Dv + d_p)


def vipe_attention(q, k, v, u, w_p, b_p, s: float = 1.0, rescale: bool = True):
    """ViPE attention, same contract as `vipe_attention_naive` (exact, see the module docstring).
    Triton around SDPA on CUDA (float32 and 16-bit), the PyTorch ops elsewhere."""
    backend = pick_backend(BACKEND, "vipe_attention", q.is_cuda, q.dtype != torch.float64, "float64 inputs")
    fn = {"naive": vipe_attention_naive, "torch": vipe_attention_torch, "triton": vipe_attention_triton}[backend]
    return fn(q, k, v, u, w_p, b_p, s, rescale)


# =============================================================================================
# The test-time factor s, and ViPE's evaluation after training
# =============================================================================================

S_RULES = ("fixed", "per_length", "one")
S_TEXT = {"fixed": "s = L_test_max / L_train_max", "per_length": "s = L / L_train_max per length", "one": "s = 1"}


def ablation_label(rule: str) -> str:
    """The name of a rule's rows in a run's "eval_ablations" (metrics written before these names keyed
    the rows by the rule itself: experiments.summarize reads both)."""
    return S_TEXT[rule] + ", no fine-tuning"


def compression(rule: str, L: int, train_max: int, test_max: int) -> float:
    """ViPE's test-time factor s at length L: "fixed" s = test_max / train_max at every length
    beyond training (the paper's eq. 7, after a short fine-tuning with it), "per_length"
    s = max(1, L / train_max), "one" s = 1. Passed to every layer in ctx["s"]; other encodings
    ignore it."""
    return {"fixed": max(1.0, test_max / train_max), "per_length": max(1.0, L / train_max), "one": 1.0}[rule]


def ramp(s: float, steps: int):
    """The fine-tuning's s at step k = 0 .. steps - 1 when it rises linearly from 1 to s (vipe_ramp)."""
    return lambda k: 1.0 + (s - 1.0) * (k + 1) / steps


def final_evaluation(run) -> tuple[list[dict], dict]:
    """ViPE after training (Method.final_eval; `run` is a model.Final). Its rows: the training
    lengths at s = 1, the model as trained (the paper's bar: in-distribution accuracy), and the
    longer lengths under the rule `vipe_s` (default "fixed": after `vipe_finetune` steps trained with
    s = L_test_max / L_train_max, or with s rising to it from 1 with `vipe_ramp`). Beside them, under
    "eval_ablations", every other rule at every length before any fine-tuning, each named by its s."""
    rule, steps = run.opts.get("vipe_s", "fixed"), run.opts.get("vipe_finetune", 0)
    top, test_max = run.train_max, max(run.test_lengths)
    rules = {r: (lambda L, r=r: compression(r, L, top, test_max)) for r in S_RULES}
    before = {r: run.evaluate(run.test_lengths, rules[r]) for r in S_RULES if r == "one" or r != rule}
    after = before.get(rule)
    if after is None:                                     # the rule beyond training: fine-tune, then test
        if steps:
            s, rising = compression(rule, test_max, top, test_max), run.opts.get("vipe_ramp", False)
            run.finetune(steps, ramp(s, steps) if rising else s)
            run.log(f"  fine-tuned {steps} steps with s = {test_max} / {top}" + (", ramped from 1" if rising else ""))
        after = run.evaluate([L for L in run.test_lengths if L > top], rules[rule])
    rows = [r for r in before["one"] if r["length"] <= top] + [r for r in after if r["length"] > top]
    ablations = {ablation_label(r): rows_ for r, rows_ in before.items() if r != rule}
    return rows, {"eval_ablations": ablations}


# =============================================================================================
# Layer
# =============================================================================================

class ViPEAttention(nn.Module):
    """Causal multi-head ViPE attention. The value head has D - 1 channels (so v (+) i is D wide for
    SDPA's fused kernels) and the output projection reads H * (D - 1 + d_p) channels. It uses
    ctx["s"] as given (default 1): 1 in training, the fixed s = L_test_max / L_train_max in the
    fine-tuning stage, and at evaluation the s of the run's rule (`final_evaluation`).

    The layer runs in float32 under autocast (the paper does not say which precision it trains
    in). Trained ViPE logits reach the hundreds to thousands, ~50x RoPE's, because the rescaling
    multiplies logits that training already makes large; rounded to bf16, q and k carry an error of
    about 2^-8 of the logit, a few units at that size, enough to change which key wins. Long bf16
    runs then blew up, float32 ones did not (docs/perf/vipe.md, "Long runs")."""

    def __init__(self, cfg):
        super().__init__()
        if not cfg.causal:
            raise ValueError("ViPE attention is causal; this task needs a bidirectional model")
        self.mode = cfg.opts.get("vipe_mode", "both")
        if self.mode not in MODES:
            raise ValueError(f"vipe_mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        C, H = cfg.d_model, cfg.n_heads
        self.H, self.D = H, C // H
        self.Dv = self.D - 1
        self.dp = 0 if self.mode == "scale" else int(cfg.opts.get("vipe_dp", 8))
        self.qk = nn.Linear(C, 2 * C, bias=False)
        self.v = nn.Linear(C, H * self.Dv, bias=False)
        self.out = nn.Linear(H * (self.Dv + self.dp), C, bias=False)
        self.u = nn.Parameter(torch.zeros(H, self.D))                       # starts as pure s log(n)
        self.w_p = nn.Parameter(0.02 * torch.randn(H, self.dp))
        self.b_p = nn.Parameter(torch.zeros(H, self.dp))

    def forward(self, x, ctx=None):
        B, T, C = x.shape
        s = float((ctx or {}).get("s", 1.0))
        with torch.autocast(x.device.type, enabled=False):                   # float32: see above
            x = x.to(torch.promote_types(x.dtype, torch.float32))
            q, k = self.qk(x).view(B, T, 2, self.H, self.D).permute(2, 0, 3, 1, 4)  # 2 x (B, H, T, D)
            v = self.v(x).view(B, T, self.H, self.Dv).transpose(1, 2)               # (B, H, T, D - 1)
            z = vipe_attention(q, k, v, self.u, self.w_p, self.b_p, s, rescale=self.mode != "value")
            return self.out(z.transpose(1, 2).reshape(B, T, -1))                  # (B, T, C)


VIPE = Method(ViPEAttention, causal_only=True, final_eval=final_evaluation,
              options={"vipe_mode": Opt(str, "both, value (the code alone) or scale (the rescaling alone) "
                                             "(default both)", choices=MODES),
                       "vipe_dp": Opt(int, "code width d_p (default 8)", 1),
                       "vipe_s": Opt(str, "the test-time s beyond the training lengths: fixed "
                                          "(L_test_max / L_train_max), per_length (L / L_train_max) or one "
                                          "(default fixed)", choices=S_RULES),
                       "vipe_finetune": Opt(int, "with vipe_s=fixed: steps trained with that s before the "
                                                 "test (default 0)", 0),
                       "vipe_ramp": Opt(bool, "with vipe_finetune: s rises linearly from 1 to the fixed s over "
                                              "those steps (default false: s fixed throughout)")})
