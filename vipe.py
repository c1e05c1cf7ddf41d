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
rescaling) | "scale" (the rescaling alone, no value code); vipe_dp = d_p (default 8). The protocol
(`final_evaluation`): vipe_s, the rule for s at test; vipe_s_fixed, the fixed s (default the paper's
L_test_max / L_train_max), and vipe_s_also, a second one tried on a copy; vipe_finetune, the steps
trained with it before the test, with vipe_ft_optim (fresh, the default, or continued) at vipe_ft_lr
(default the run's final rate) and vipe_ramp. Ablations of the paper's forms, each an open question
of the paper's text: vipe_code (`code_distance`: the paper's linear code, or a bounded one) and vipe_g
(the logit factor g(s) = s, or a s + b learned per head, its appendix C.3). They run on the PyTorch
paths (`vipe_attention`).

Shapes: B batch, H heads, T time, D query/key head dim, Dv value head dim, d_p code width.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import Method, Opt, causal_mask, note_logits, pick_backend, sdpa

BACKEND = None  # None = choose (Triton on CUDA, "torch" on CPU); or force "naive" | "torch" | "triton"
MODES = ("both", "value", "scale")
G_FORMS = ("s", "affine")   # the logit factor's g(s): s (eq. 9), or a s + b learned per head (appendix C.3)


# =============================================================================================
# Naive reference: the (T, T) logits and the (T, T, d_p) codes, as written in the paper
# =============================================================================================

def vipe_attention_naive(q, k, v, u, w_p, b_p, s: float = 1.0, rescale: bool = True, code: str = "linear", g=None):
    """q, k: (B, H, T, D); v: (B, H, T, Dv); u: (H, D); w_p, b_p: (H, d_p) -> z: (B, H, T, Dv + d_p).
    rescale=False drops lambda (the value code alone); d_p = 0 drops the code (the rescaling alone).
    code: the distance the code carries (CODES); g: (H,) the logit factor in place of s (vipe_g=affine)."""
    B, H, T, D = q.shape
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):                            # 16-bit: computed in float32
        q, k, v = q.float(), k.float(), v.float()
    n = torch.arange(1, T + 1, device=q.device, dtype=q.dtype)              # 1-based positions
    logits = q @ k.transpose(-1, -2) / math.sqrt(D)                         # (B, H, T, T) base logits
    if rescale:
        g = torch.full((H,), s, dtype=q.dtype, device=q.device) if g is None else g.to(q.dtype)  # (H,)
        lam = g[:, None, None] * torch.log(n)[:, None] * (1 + (k * u[:, None, :]).sum(-1))[..., None, :]  # (B, H, T, T)
        logits = lam * logits
    logits = logits.masked_fill(~causal_mask(T, q.device), -math.inf)     # (B, H, T, T)
    note_logits(logits)                                                     # the loop's logit probe
    a = logits.softmax(-1)                                                  # (B, H, T, T)
    dist = code_distance(code, n[:, None] - n[None, :], n[:, None], s)     # (T, T) the code's n - i
    codes = dist[None, :, :, None] * w_p[:, None, None, :] + b_p[:, None, None, :]  # (H, T, T, d_p)
    pos = torch.einsum("bhni,hnip->bhnp", a, codes)                         # (B, H, T, d_p)
    return torch.cat([a @ v, pos.to(a.dtype)], dim=-1).to(dtype)


CODES = ("linear", "tanh", "over_n")
TANH_SCALE = 16.0   # tokens: tanh(d / (s * 16)) is 0.97 at the longest training distance of the ViPE tasks (34)


def code_distance(code: str, dist, n, s: float):
    """What the value code carries for distance dist = n - i at the 1-based query position n: "linear"
    dist / s (the paper's eq. 8); two bounded forms (the paper's text calls the code "monotonic, bounded"):
    "tanh" tanh(dist / (s * TANH_SCALE)), and "over_n" dist / n, in [0, 1) at any length, so s is not applied."""
    if code == "linear":
        return dist / s
    if code == "tanh":
        return torch.tanh(dist / (s * TANH_SCALE))
    return dist / n


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


def vipe_attention_torch(q, k, v, u, w_p, b_p, s: float = 1.0, rescale: bool = True, code: str = "linear",
                         g=None):
    """The fast path in PyTorch ops (the CPU backend; float64 anywhere). code "linear" or "over_n" (both
    linear in i, so E_n[i] gives them); g as in the naive path."""
    B, H, T, D = q.shape
    f = torch.promote_types(q.dtype, torch.float32)                         # float64 stays float64
    if rescale:
        n = torch.arange(1, T + 1, device=q.device, dtype=f)
        g = torch.full((H,), s, dtype=f, device=q.device) if g is None else g.to(f)  # (H,)
        q = q * (g[:, None, None] * torch.log(n)[:, None]).to(q.dtype)      # per-query factor
        k = k * (1 + k @ u[:, :, None].to(k.dtype))                         # per-key factor (B, H, T, 1)
    o, mean_i = attention_with_mean_position(q, k, v, D ** -0.5)
    if w_p.shape[-1] == 0:
        return o
    n0 = torch.arange(T, device=q.device, dtype=f)                         # 0-based, like mean_i
    dist = code_distance(code, n0 - mean_i.to(f), n0 + 1, s)                # (B, H, T) n - E[i], as the code reads it
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


def vipe_attention(q, k, v, u, w_p, b_p, s: float = 1.0, rescale: bool = True, code: str = "linear", g=None):
    """ViPE attention, same contract as `vipe_attention_naive` (exact, see the module docstring).
    Triton around SDPA on CUDA (float32 and 16-bit), the PyTorch ops elsewhere. The ablations' forms go
    elsewhere: the kernels take the paper's alone (the PyTorch ops), and a tanh code is not linear in i,
    so it has no E_n[i] form (the naive path)."""
    backend = pick_backend(BACKEND, "vipe_attention", q.is_cuda, q.dtype != torch.float64, "float64 inputs")
    if code == "tanh":
        backend = "naive"
    elif backend == "triton" and (code != "linear" or g is not None):
        backend = "torch"
    if backend == "triton":
        return vipe_attention_triton(q, k, v, u, w_p, b_p, s, rescale)
    fn = {"naive": vipe_attention_naive, "torch": vipe_attention_torch}[backend]
    return fn(q, k, v, u, w_p, b_p, s, rescale, code, g)


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


FT_OPTIMS = ("fresh", "continued")


def final_evaluation(run) -> tuple[list[dict], dict]:
    """ViPE after training (Method.final_eval; `run` is a model.Final). The run's rows are the reading of
    the rule `vipe_s` (default "fixed", the paper's) on ONE model at every length, training lengths
    included, each row with its s and its "model":

    - "fixed" with vipe_finetune > 0 (the paper's protocol): the model after `vipe_finetune` steps
      trained with the fixed s (`fixed_s`; rising to it from 1 with vipe_ramp), tested with that s at
      every length ("fine-tuned"). So the in-distribution accuracy that the paper's 0.85 bar reads is
      that of the model it tests beyond training.
    - otherwise the model as trained under the rule ("as trained").

    Beside them, under "eval_ablations", every rule on the model as trained (before any fine-tuning),
    at every length, each named by its s; with vipe_s_also, the paper's protocol with that s in place of
    the fixed one, on a copy of the trained model (run.fork), so that two values of s are compared on the
    same trained weights. During training (run.during) the rows alone, on a copy.

    The fine-tuning: `vipe_finetune` steps of the training stream with a fresh AdamW (vipe_ft_optim =
    fresh, the default) at the run's final learning rate (vipe_ft_lr to set another). The paper says
    only that the model is fine-tuned briefly with the compressed distances (eq. 7): a fine-tuning stage
    starts from the trained weights with an optimiser of its own, as the context-extension recipes it
    compares with do (YaRN); "continued" keeps the run's Adam moments instead, whose second moments were
    made by the small gradients of a converged run, not the large ones at the new s. The final rate is the
    rate the model converged at (the paper's setup trains at a constant rate, so it is its rate)."""
    rule, steps = run.opts.get("vipe_s", "fixed"), run.opts.get("vipe_finetune", 0)
    top, test_max = run.train_max, max(run.test_lengths)
    s_fixed = fixed_s(run.opts, top, test_max)
    rules = {r: (lambda L, r=r: s_fixed if r == "fixed" else compression(r, L, top, test_max)) for r in S_RULES}
    before = {} if run.during else {r: tag(run.evaluate(run.test_lengths, rules[r]), "as trained") for r in S_RULES}
    also = {}                  # vipe_s_also: the same protocol with another fixed s, on a copy of the trained model
    if rule == "fixed" and steps:
        def tuned(net, s: float) -> list[dict]:   # `net` fine-tuned with s, then its rows at s
            rising, fresh = net.opts.get("vipe_ramp", False), net.opts.get("vipe_ft_optim", "fresh") == "fresh"
            net.finetune(steps, ramp(s, steps) if rising else s, fresh=fresh, lr=net.opts.get("vipe_ft_lr") or None)
            net.log(f"  fine-tuned {steps} steps with s = {s:g}" + (", ramped from 1" if rising else ""))
            return tag(net.evaluate(net.test_lengths, lambda L: s), "fine-tuned")
        if run.opts.get("vipe_s_also") and not run.during:
            s_also = float(run.opts["vipe_s_also"])
            how = " ramped from 1" if run.opts.get("vipe_ramp") else ""
            also = {f"s = {s_also:g}, fine-tuned with it{how} (vipe_s_also)": tuned(run.fork(), s_also)}
        rows = tuned(run, s_fixed)
    else:
        rows = before.get(rule) or tag(run.evaluate(run.test_lengths, rules[rule]), "as trained")
    ablations = {**{ablation_label(r): rows_ for r, rows_ in before.items() if rows_ is not rows}, **also}
    return rows, ({"eval_ablations": ablations} if ablations else {})


def fixed_s(opts: dict, train_max: int, test_max: int) -> float:
    """The fixed s: vipe_s_fixed if given, else the paper's L_test_max / L_train_max (eq. 7)."""
    return float(opts.get("vipe_s_fixed") or compression("fixed", test_max, train_max, test_max))


def tag(rows: list[dict], model: str) -> list[dict]:
    """Rows marked with the model they were measured on: "as trained" or "fine-tuned"."""
    return [{**r, "model": model} for r in rows]


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
        self.code, self.g = cfg.opts.get("vipe_code", "linear"), cfg.opts.get("vipe_g", "s")
        for name, value, allowed in (("vipe_mode", self.mode, MODES), ("vipe_code", self.code, CODES),
                                     ("vipe_g", self.g, G_FORMS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        tuning = [k for k in ("vipe_ft_optim", "vipe_ft_lr", "vipe_ramp", "vipe_s_also") if k in cfg.opts]
        if tuning and not (cfg.opts.get("vipe_finetune") and cfg.opts.get("vipe_s", "fixed") == "fixed"):
            raise ValueError(f"{tuning[0]} sets the fine-tuning, which runs with vipe_s=fixed and vipe_finetune=N "
                             "(N > 0) only")
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
        if self.g == "affine":                                              # g(s) = a s + b, from a = 1, b = 0
            self.g_ab = nn.Parameter(torch.tensor([[1.0, 0.0]] * H))        # (H, 2)

    def forward(self, x, ctx=None):
        B, T, C = x.shape
        s = float((ctx or {}).get("s", 1.0))
        with torch.autocast(x.device.type, enabled=False):                   # float32: see above
            x = x.to(torch.promote_types(x.dtype, torch.float32))
            q, k = self.qk(x).view(B, T, 2, self.H, self.D).permute(2, 0, 3, 1, 4)  # 2 x (B, H, T, D)
            v = self.v(x).view(B, T, self.H, self.Dv).transpose(1, 2)               # (B, H, T, D - 1)
            g = self.g_ab[:, 0] * s + self.g_ab[:, 1] if self.g == "affine" else None    # (H,)
            z = vipe_attention(q, k, v, self.u, self.w_p, self.b_p, s, self.mode != "value", self.code, g)
            return self.out(z.transpose(1, 2).reshape(B, T, -1))                  # (B, T, C)


VIPE = Method(ViPEAttention, causal_only=True, final_eval=final_evaluation,
              options={"vipe_mode": Opt(str, "both, value (the code alone) or scale (the rescaling alone) "
                                             "(default both)", choices=MODES),
                       "vipe_dp": Opt(int, "code width d_p (default 8)", 1),
                       "vipe_code": Opt(str, "the distance the value code carries: linear ((n - i) / s, eq. 8), "
                                             "tanh (tanh((n - i) / (16 s))) or over_n ((n - i) / n) (default "
                                             "linear)", choices=CODES),
                       "vipe_g": Opt(str, "the logit factor's g(s): s (eq. 9) or affine (a s + b, a and b learned "
                                          "per head, appendix C.3) (default s)", choices=G_FORMS),
                       "vipe_s": Opt(str, "the test-time s: fixed (one s at every length, after vipe_finetune "
                                          "steps with it), per_length (L / L_train_max) or one (default fixed)",
                                     choices=S_RULES),
                       "vipe_s_fixed": Opt(float, "the fixed s (default L_test_max / L_train_max)", 1),
                       "vipe_s_also": Opt(float, "with vipe_s=fixed and vipe_finetune: a second fixed s, the same "
                                                 "fine-tuning and test with it on a copy of the trained model, under "
                                                 "eval_ablations (default none)", 1),
                       "vipe_finetune": Opt(int, "with vipe_s=fixed: steps trained with that s before the "
                                                 "test (default 0)", 0),
                       "vipe_ft_optim": Opt(str, "the fine-tuning's optimiser: fresh (a new AdamW) or continued "
                                                 "(the run's, with its moments) (default fresh)", choices=FT_OPTIMS),
                       "vipe_ft_lr": Opt(float, "the fine-tuning's learning rate (default: the run's final one)",
                                         1e-12),
                       "vipe_ramp": Opt(bool, "with vipe_finetune: s rises linearly from 1 to the fixed s over "
                                              "those steps (default false: s fixed throughout)")})
