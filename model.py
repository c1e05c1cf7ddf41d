"""The shared tiny Transformer that every position encoding plugs into, and the baseline encodings.

    from model import Model, ModelConfig, baseline
    model = Model(ModelConfig(vocab_size=12, method="rope"), baseline("rope"))

A pre-norm Transformer (the layer interface below): token embedding -> N blocks (norm, attention, residual, norm,
MLP, residual) -> norm -> linear head, with optional dropout (`ModelConfig.dropout`) on the embeddings
and each residual branch. Causal (decoder) or bidirectional (encoder), set by the task.
An encoding is a `Method`: an attention layer class with the shared interface

    layer = SomeAttention(cfg)         # cfg: a ModelConfig; method options in cfg.opts
    y = layer(x, ctx)                  # x: (B, T, C) -> (B, T, C); ctx: token ids, key mask, ...

and, for encodings that act outside one attention call (APE on the embeddings, PRISM's position
streams before chosen blocks), a `Hooks` subclass. The registry of every method by name is in
train.py; the baselines nope, ape, rope, alibi, t5 and fire are defined here.

Shapes: B batch, T time, C d_model, H heads, D head dim, V vocabulary.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

@dataclass
class ModelConfig:
    vocab_size: int = 16         # set from the task
    d_model: int = 128           # residual width C
    n_layers: int = 2            # Transformer blocks
    n_heads: int = 4             # attention heads H (head dim D = C / H)
    mlp_ratio: int = 4           # MLP hidden width = mlp_ratio * C
    dropout: float = 0.0         # on the embeddings and each residual branch, in training only
    causal: bool = True          # decoder (True) or bidirectional encoder (False), set by the task
    method: str = "nope"         # position encoding, a key of train.METHODS (recorded with the run)
    tie_weights: bool = False    # share the token embedding with the output head
    ape_shift: int = 0           # APE: random offset in [0, ape_shift] added to positions in training
    t5_buckets: int = 32         # T5 bias: number of buckets
    t5_max_distance: int = 128   # T5 bias: distances beyond this share the last bucket
    fire_hidden: int = 32        # FIRE: hidden width of the bias MLP
    rope_base: float = 10000.0   # RoPE: frequency base
    norm: str = "pre"            # "pre": each branch reads a normalised copy, one norm before the head;
                                 # "post" (BERT): the embedding and each block's sums normalised, none after
    opts: dict = field(default_factory=dict)  # options of methods defined in other files


def causal_mask(T: int, device) -> torch.Tensor:
    """(T, T) bool, True where query i may attend key j (j <= i)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


BACKENDS = ("naive", "torch", "triton")

# The logit probe: the largest attention logit of each attention call in one forward pass, the
# first thing to grow when a run is about to blow up. Each method's PyTorch path reports its logits
# (`note_logits`, or `sdpa` in place of F.scaled_dot_product_attention); `largest_logits` runs it.
_probe: list | None = None


def pick_backend(forced: str | None, name: str, cuda: bool, has_kernel: bool, why: str = "") -> str:
    """The path a method's dispatcher takes: `forced` (its module's BACKEND) when set, else "triton"
    on CUDA where a kernel exists and "torch" otherwise (on CUDA with a warning, once, saying why).
    Under `largest_logits` always "torch", whose logits can be read."""
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"unknown BACKEND {forced!r}; use None, 'naive', 'torch' or 'triton'")
    if _probe is not None:
        return "torch"
    if forced is not None:
        return forced
    if cuda and not has_kernel:
        warn_once(f"{name}: {why}; using the slower PyTorch path")
    return "triton" if cuda and has_kernel else "torch"


@functools.cache
def warn_once(msg: str):
    warnings.warn(msg, stacklevel=4)


def note_logits(logits):
    """Reports one attention call's logits (..., Tq, Tk), -inf where masked, or a list of the pieces
    of one call's logits, to `largest_logits`."""
    if _probe is not None:
        pieces = [x.detach().float() for x in (logits if isinstance(logits, (list, tuple)) else [logits])]
        _probe.append(max(float(x.masked_fill(~torch.isfinite(x), 0).abs().amax()) for x in pieces))


def sdpa(q, k, v, attn_mask=None, is_causal: bool = False, scale: float | None = None):
    """F.scaled_dot_product_attention, which also reports its logits to `largest_logits`."""
    if _probe is not None:
        logits = q.float() @ k.float().mT * (q.shape[-1] ** -0.5 if scale is None else scale)
        if attn_mask is not None:
            logits = logits.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool \
                else logits + attn_mask.float()
        if is_causal:
            logits = logits.masked_fill(~causal_mask(q.shape[-2], q.device), -math.inf)
        note_logits(logits)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


@torch.no_grad()
def largest_logits(model, x, ctx=None) -> list[float]:
    """The largest |attention logit| of each attention call of one forward pass of `model` (in eval
    mode, every method on its PyTorch path), in the order of the calls."""
    global _probe
    was, _probe = model.training, []
    model.eval()
    try:
        model(x, ctx)
        return _probe
    finally:
        _probe = None
        model.train(was)


def attend(q, k, v, causal: bool, bias=None, key_mask=None):
    """Softmax attention. q, k: (B, H, T, D); v: (B, H, T, Dv); bias: (H, T, T) added to the
    logits; key_mask: (B, T) bool, True = attend. Uses SDPA's fused kernels when possible."""
    if bias is None and key_mask is None:
        return sdpa(q, k, v, is_causal=causal)
    T = q.shape[-2]
    mask = torch.zeros(1, 1, T, T, device=q.device, dtype=q.dtype)  # (1, 1, T, T) additive
    if bias is not None:
        mask = mask + bias.to(q.dtype)[None]
    if causal:
        mask = mask.masked_fill(~causal_mask(T, q.device), -math.inf)
    if key_mask is not None:
        mask = mask.masked_fill(~key_mask[:, None, None, :], -math.inf)
    return sdpa(q, k, v, attn_mask=mask)


def rotary(x, base: float):
    """RoPE on the last dim of x: (B, H, T, D), rotating pairs (i, i + D/2) by angle t * base^(-2i/D)."""
    T, D = x.shape[-2], x.shape[-1]
    inv_freq = base ** (-torch.arange(0, D // 2, device=x.device, dtype=torch.float32) / (D // 2))
    angle = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv_freq  # (T, D/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def relative_distance(T: int, device) -> torch.Tensor:
    """(T, T) matrix of i - j (query i, key j)."""
    pos = torch.arange(T, device=device)
    return pos[:, None] - pos[None, :]


class AlibiBias(nn.Module):
    """ALiBi (Press et al. 2022): bias -m_h |i - j| with slopes m_h = 2^(-8h/H)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = torch.arange(1, cfg.n_heads + 1, dtype=torch.float32)
        self.register_buffer("slopes", 2.0 ** (-8.0 * h / cfg.n_heads), persistent=False)

    def forward(self, T, device):
        return -self.slopes[:, None, None] * relative_distance(T, device).abs()  # (H, T, T)


class T5Bias(nn.Module):
    """T5 relative bias (Raffel et al. 2020): a learned scalar per head and distance bucket; exact
    buckets for small distances, logarithmic ones up to max_distance. Bidirectional models give
    half of the buckets to each direction."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.causal, self.n, self.max_distance = cfg.causal, cfg.t5_buckets, cfg.t5_max_distance
        self.bias = nn.Embedding(cfg.t5_buckets, cfg.n_heads)

    def bucket(self, rel):
        n, offset = self.n, 0
        if not self.causal:
            n //= 2
            offset = (rel < 0).long() * n  # keys after the query get the upper half
        d = rel.abs()
        exact = n // 2
        log_bucket = exact + (torch.log(d.float().clamp(min=1) / exact)
                              / math.log(self.max_distance / exact) * (n - exact)).long()
        return offset + torch.where(d < exact, d, log_bucket.clamp(max=n - 1))

    def forward(self, T, device):
        return self.bias(self.bucket(relative_distance(T, device))).permute(2, 0, 1)  # (H, T, T)


class FireBias(nn.Module):
    """FIRE (Li et al. 2024): b(i, j) = f(psi(i - j) / psi(max(L, i))), psi(x) = log(c x + 1), f a
    small MLP, c and L learned. For a bidirectional model the MLP also reads the sign of i - j."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2, cfg.fire_hidden), nn.ReLU(), nn.Linear(cfg.fire_hidden, cfg.n_heads))
        self.c = nn.Parameter(torch.tensor(1.0))
        self.L = nn.Parameter(torch.tensor(16.0))

    def forward(self, T, device):
        rel = relative_distance(T, device).float()
        c = F.softplus(self.c)
        psi = lambda x: torch.log(c * x + 1)  # noqa: E731
        i = torch.arange(T, device=device, dtype=torch.float32)[:, None]
        x = psi(rel.abs()) / psi(torch.maximum(self.L.abs() + 1, i + 1))   # (T, T) in [0, 1]
        feats = torch.stack([x, rel.sign()], dim=-1)                       # (T, T, 2)
        return self.mlp(feats).permute(2, 0, 1)                            # (H, T, T)


class Attention(nn.Module):
    """Multi-head softmax attention with a baseline encoding: nope, rope, alibi, t5 or fire."""

    BIASES = {"alibi": AlibiBias, "t5": T5Bias, "fire": FireBias}

    def __init__(self, cfg: ModelConfig, encoding: str = "nope"):
        super().__init__()
        assert cfg.d_model % cfg.n_heads == 0, "d_model must be a multiple of n_heads"
        self.cfg, self.encoding = cfg, encoding
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.bias = self.BIASES[encoding](cfg) if encoding in self.BIASES else None

    def forward(self, x, ctx):
        B, T, C = x.shape
        H = self.cfg.n_heads
        q, k, v = self.qkv(x).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        if self.encoding == "rope":
            q, k = rotary(q, self.cfg.rope_base), rotary(k, self.cfg.rope_base)
        bias = None if self.bias is None else self.bias(T, x.device)
        o = attend(q, k, v, self.cfg.causal, bias, ctx.get("key_mask"))
        return self.out(o.transpose(1, 2).reshape(B, T, C))                  # (B, T, C)


class Hooks(nn.Module):
    """What an encoding may do outside its attention layer. Subclasses override either method;
    both receive ctx, the dict every attention layer also reads, and may write into it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    def embed(self, h, ctx):
        """h: (B, T, C) token embeddings -> (B, T, C), before the first block."""
        return h

    def before_block(self, i: int, h, ctx):
        """Called before block i with its input h: (B, T, C); returns nothing."""


class SinusoidalAPE(Hooks):
    """Absolute sinusoidal positions added to the token embeddings (Vaswani et al. 2017). With
    ape_shift > 0 every training sequence gets a random offset in [0, ape_shift] (randomised
    APE, PRISM's baseline), so positions beyond the training length are seen in training."""

    def embed(self, h, ctx):
        B, T, C = h.shape
        offset = torch.zeros(B, 1, device=h.device)
        if self.training and self.cfg.ape_shift > 0:
            offset = torch.randint(0, self.cfg.ape_shift + 1, (B, 1), device=h.device).float()
        pos = torch.arange(T, device=h.device, dtype=torch.float32)[None] + offset      # (B, T)
        inv_freq = 10000.0 ** (-torch.arange(0, C, 2, device=h.device, dtype=torch.float32) / C)
        angle = pos[..., None] * inv_freq                                             # (B, T, C/2)
        pe = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)[..., :C]     # (B, T, C)
        return h + pe.to(h.dtype)


@dataclass
class Opt:
    """One --method-opt option of a method: its kind (int, float, bool, str, or list of ints), the
    smallest value it takes (for a list, each item), the values a str takes, and a line of help."""
    kind: type
    help: str
    low: float | None = None
    choices: tuple = ()

    def parse(self, name: str, value):
        """The value as its kind, or ValueError naming the option: no silent conversions (the string
        "False" is not true, 2.7 is not the int 2)."""
        need = f"{name} must be {self.describe()}, got {value!r}"
        if self.kind is bool:
            text = str(value).lower() if isinstance(value, (bool, str)) else ""
            if text not in ("true", "false"):
                raise ValueError(need)
            return text == "true"
        items = value if self.kind is list else [value]
        if self.kind is list and not isinstance(value, list):
            raise ValueError(need)
        want = str if self.kind is str else float if self.kind is float else int
        for v in items:
            if isinstance(v, bool) or not isinstance(v, (int, float) if want is float else want):
                raise ValueError(need)
            if want is float and not math.isfinite(v):
                raise ValueError(need)
            if (self.low is not None and v < self.low) or (self.choices and v not in self.choices):
                raise ValueError(need)
        return float(value) if want is float else value

    def describe(self) -> str:
        if self.choices:
            return "one of " + " | ".join(self.choices)
        kind = "a list of ints" if self.kind is list else {int: "an int", float: "a float", bool: "true | false",
                                                             str: "a string"}[self.kind]
        return kind + (f" >= {self.low:g}" if self.low is not None else "")


@dataclass
class Method:
    """A position encoding as the model uses it."""
    attention: Callable            # layer class (or factory): attention(cfg) -> module, forward(x, ctx)
    hooks: type | None = None      # optional Hooks subclass
    param_groups: Callable | None = None   # optional fn(model, base_lr) -> extra optimiser groups
    causal_only: bool = False      # the layer cannot run as a bidirectional encoder
    options: dict = field(default_factory=dict)   # cfg.opts keys the method reads (--method-opt) -> Opt
    final_eval: Callable | None = None   # optional fn(Final) -> (rows, extra metrics): the method's
                                         # own evaluation after training (ViPE: its rules for s)


@dataclass
class Final:
    """What a method's own evaluation after training (Method.final_eval) may use, built by train.train:
    its options, the lengths, evaluate(lengths, s=1.0) -> rows and finetune(steps, s, fresh, lr) on the
    trained model; fork() -> the same over a copy of the model as it is now (and of its optimiser), to
    fine-tune another way without touching this one; during training (with eval_every) the same on a
    copy of the model, `during` True."""
    opts: dict
    train_max: int
    test_lengths: list
    log: Callable
    evaluate: Callable
    finetune: Callable
    during: bool = False
    fork: Callable | None = None


def baseline(encoding: str, hooks: type | None = None) -> Method:
    """A baseline: softmax attention with encoding nope, rope, alibi, t5 or fire."""
    return Method(lambda cfg: Attention(cfg, encoding), hooks=hooks)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attention):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)     # p = 0: the identity, drawing no random numbers
        self.post = cfg.norm == "post"

    def forward(self, h, ctx):
        if self.post:                                   # BERT: h = LN(h + f(h)) for each branch
            h = self.norm1(h + self.drop(self.attn(h, ctx)))
            return self.norm2(h + self.drop(self.mlp(h)))
        h = h + self.drop(self.attn(self.norm1(h), ctx))
        return h + self.drop(self.mlp(self.norm2(h)))


class Model(nn.Module):
    """Pre-norm Transformer: embedding -> blocks -> norm -> linear head (or post-norm, cfg.norm: embedding
    -> norm -> blocks -> linear head), with two generic hooks for encodings that act outside one attention
    call (embedding, before block i)."""

    def __init__(self, cfg: ModelConfig, method: Method):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.hooks = method.hooks(cfg) if method.hooks else None
        self.blocks = nn.ModuleList(Block(cfg, method.attention) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.post = cfg.norm == "post"
        if cfg.tie_weights:
            self.head.weight = self.embed.weight

    def forward(self, x, ctx=None):
        """x: (B, T) token ids -> logits (B, T, V). ctx: key_mask, slot, s, ... (see `batch_context`)."""
        ctx = dict(ctx or {})
        ctx.setdefault("tokens", x)
        h = self.embed(x)                                       # (B, T, C)
        if self.hooks is not None:
            h = self.hooks.embed(h, ctx)
        h = self.drop(self.norm(h) if self.post else h)         # post-norm: the norm on the embedding
        for i, block in enumerate(self.blocks):
            if self.hooks is not None:
                self.hooks.before_block(i, h, ctx)
            h = block(h, ctx)
        return self.head(h if self.post else self.norm(h))


def batch_context(task, batch, device, s: float = 1.0) -> dict:
    """What the attention layers may read beyond x, from a tasks.Batch of a tasks.Task: "s" (ViPE's
    distance compression, 1 in training), "slot" (UPE's uniform slots, with its largest value
    "slot_max") and "key_mask" (bidirectional batches with padding; True = attend). The model adds
    "tokens" (the ids)."""
    ctx = {"s": s}
    if batch.slot is not None:
        ctx["slot"] = batch.slot.to(device)
        ctx["slot_max"] = int(batch.slot.max())         # read before the copy: UPE checks it (upe.py)
    if not task.causal and (batch.x == task.pad_id).any():
        ctx["key_mask"] = (batch.x != task.pad_id).to(device)
    return ctx


def autocast(device, precision: str = "bf16"):
    """bf16 autocast on CUDA (without the weight-cast cache, which a CUDA graph cannot hold) unless
    precision is "fp32"; off on the CPU."""
    on = str(device).startswith("cuda") and precision == "bf16"
    return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False) if on \
        else torch.autocast(str(device).split(":")[0], enabled=False)
