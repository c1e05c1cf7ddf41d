"""The shared tiny Transformer, the baseline position encodings, training, evaluation, plots, CLI.

    python train.py --method rope --task flipflop          # one model, table + plot in runs/
    python train.py --methods nope,rope,alibi --task polynomial --seeds 0,1,2
    python train.py --reproduce vipe-poly                  # a paper's headline experiment

One run trains a pre-norm Transformer on data generated on the fly, evaluates exact-match and
token accuracy at every test length in one teacher-forced pass per batch (for a causal model
this equals greedy decoding, see `greedy_decode`), prints a table, and writes
runs/<task>/<method>/seed<S>/{metrics.json, model.pt}, a summary over seeds in
runs/<task>/<method>/metrics.json, and runs/<task>/extrapolation.png overlaying every method run
on the task. On a GPU the defaults follow the paper's setting (scaled to minutes); on a CPU a
small preset shows the mechanics.

Position encodings here (baselines): nope, ape (sinusoidal, optional random shift), rope, alibi,
t5 (bucketed relative bias), fire (learned MLP of the normalised log distance). The methods of
the papers live in their own files and register themselves through their METHODS dict.

Shapes: B batch, T time, C d_model, H heads, D head dim, V vocabulary.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks import IGNORE, TASKS, Batch, Task, sample_mixed

ALL_METHODS = ["nope", "ape", "rope", "alibi", "t5", "fire", "fox", "path", "path-fox", "vipe",
               "rpe", "upe", "prism"]
METHOD_FILES = ["path_attention", "vipe", "upe", "prism"]  # each may export METHODS


class UsageError(Exception):
    """Bad input: printed as one line by the CLI, which then exits with status 2."""


# =============================================================================================
# Model
# =============================================================================================

@dataclass
class ModelConfig:
    vocab_size: int = 16         # set from the task
    d_model: int = 128           # residual width C
    n_layers: int = 2            # Transformer blocks
    n_heads: int = 4             # attention heads H (head dim D = C / H)
    mlp_ratio: int = 4           # MLP hidden width = mlp_ratio * C
    causal: bool = True          # decoder (True) or bidirectional encoder (False), set by the task
    method: str = "nope"         # position encoding, a key of METHODS
    tie_weights: bool = False    # share the token embedding with the output head
    ape_shift: int = 0           # APE: random offset in [0, ape_shift] added to positions in training
    t5_buckets: int = 32         # T5 bias: number of buckets
    t5_max_distance: int = 128   # T5 bias: distances beyond this share the last bucket
    fire_hidden: int = 32        # FIRE: hidden width of the bias MLP
    rope_base: float = 10000.0   # RoPE: frequency base
    opts: dict = field(default_factory=dict)  # options of methods defined in other files


def attend(q, k, v, causal: bool, bias=None, key_mask=None):
    """Softmax attention. q, k: (B, H, T, D); v: (B, H, T, Dv); bias: (H, T, T) added to the
    logits; key_mask: (B, T) bool, True = attend. Uses SDPA's fused kernels when possible."""
    if bias is None and key_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    T = q.shape[-2]
    mask = torch.zeros(1, 1, T, T, device=q.device, dtype=q.dtype)  # (1, 1, T, T) additive
    if bias is not None:
        mask = mask + bias.to(q.dtype)[None]
    if causal:
        mask = mask.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), -math.inf)
    if key_mask is not None:
        mask = mask.masked_fill(~key_mask[:, None, None, :], -math.inf)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


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


class SinusoidalAPE(nn.Module):
    """Absolute sinusoidal positions added to the token embeddings (Vaswani et al. 2017). With
    ape_shift > 0 every training sequence gets a random offset in [0, ape_shift] (randomised
    APE, PRISM's baseline), so positions beyond the training length are seen in training."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

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

    def before_block(self, i, h, ctx):
        pass


@dataclass
class Method:
    attention: type                # layer class: __init__(cfg), forward(x, ctx)
    hooks: type | None = None      # optional module with embed(h, ctx) and before_block(i, h, ctx)
    param_groups: object = None    # optional fn(model, base_lr) -> list of extra optimiser groups
    causal_only: bool = False      # the layer cannot run as a bidirectional encoder


def _baseline(encoding):
    return lambda cfg: Attention(cfg, encoding)


METHODS: dict[str, Method] = {
    "nope": Method(_baseline("nope")),
    "ape": Method(_baseline("nope"), hooks=SinusoidalAPE),
    "rope": Method(_baseline("rope")),
    "alibi": Method(_baseline("alibi")),
    "t5": Method(_baseline("t5")),
    "fire": Method(_baseline("fire")),
}
for _name in METHOD_FILES:
    try:
        _module = importlib.import_module(_name)
    except ModuleNotFoundError as e:
        if e.name != _name:
            raise
        continue
    for _key, _spec in getattr(_module, "METHODS", {}).items():
        METHODS[_key] = _spec if isinstance(_spec, Method) else Method(**_spec)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attention):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model))

    def forward(self, h, ctx):
        h = h + self.attn(self.norm1(h), ctx)
        return h + self.mlp(self.norm2(h))


class Model(nn.Module):
    """Pre-norm Transformer: embedding -> blocks -> norm -> linear head, with two generic hooks
    for encodings that act outside one attention call (embedding, before block i)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        method = METHODS[cfg.method]
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.hooks = method.hooks(cfg) if method.hooks else None
        self.blocks = nn.ModuleList(Block(cfg, method.attention) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.embed.weight

    def forward(self, x, ctx=None):
        """x: (B, T) token ids -> logits (B, T, V). ctx: key_mask, slot, s, ... (see SPEC §4)."""
        ctx = dict(ctx or {})
        ctx.setdefault("tokens", x)
        h = self.embed(x)                                       # (B, T, C)
        if self.hooks is not None:
            h = self.hooks.embed(h, ctx)
        for i, block in enumerate(self.blocks):
            if self.hooks is not None:
                self.hooks.before_block(i, h, ctx)
            h = block(h, ctx)
        return self.head(self.norm(h))


def batch_context(task: Task, batch: Batch, device, s: float = 1.0) -> dict:
    """What the attention layers may read beyond x (SPEC §4)."""
    ctx = {"s": s}
    if batch.slot is not None:
        ctx["slot"] = batch.slot.to(device)
        ctx["slot_max"] = int(batch.slot.max())         # read before the copy: UPE checks it (upe.py)
    if not task.causal and (batch.x == task.pad_id).any():
        ctx["key_mask"] = (batch.x != task.pad_id).to(device)
    return ctx


# =============================================================================================
# Evaluation
# =============================================================================================

def score(logits, y):
    """Per-sequence exact match (every supervised position right) and token counts."""
    pred = logits.argmax(-1)
    sup = y != IGNORE
    right = (pred == y) & sup
    exact = (right | ~sup).all(dim=1)                          # (B,)
    return exact, right.sum().item(), sup.sum().item()


@torch.no_grad()
def greedy_decode(model, task: Task, batch: Batch, device="cpu") -> torch.Tensor:
    """Reference for the teacher-forced metric: decode token by token, feeding the model's own
    prediction back at every supervised position (the task's tokens elsewhere). Returns (B,)
    exact match. Quadratic in T: for tests and checks only."""
    assert task.causal, "greedy decoding is defined for causal tasks"
    x, y = batch.x.to(device), batch.y.to(device)
    seq = x.clone()
    correct = torch.ones(len(x), dtype=torch.bool, device=device)
    for t in range(x.shape[1]):
        pred = model(seq[:, : t + 1])[:, -1].argmax(-1)          # (B,)
        sup = y[:, t] != IGNORE
        correct &= ~sup | (pred == y[:, t])
        if t + 1 < x.shape[1]:
            seq[:, t + 1] = torch.where(sup, pred, x[:, t + 1])
    return correct


@torch.no_grad()
def evaluate(model, task: Task, lengths, n: int, seed: int, device, task_opts=None,
             train_max: int | None = None, batch_size: int = 256) -> list[dict]:
    """Exact-match and token accuracy at every test length (and every task variant). Uses its
    own generator, so evaluating never changes the training data stream."""
    model.eval()
    rng = np.random.default_rng([seed, 1])
    rows = []
    variants = task.variants or {None: {}}
    for L in lengths:
        for vname, vopts in variants.items():
            n_exact = n_right = n_sup = 0
            for start in range(0, n, batch_size):
                batch = task.sample(min(batch_size, n - start), L, rng, **{**(task_opts or {}), **vopts})
                s = max(1.0, L / train_max) if train_max else 1.0
                with autocast(device):
                    logits = model(batch.x.to(device), batch_context(task, batch, device, s))
                exact, right, sup = score(logits.float(), batch.y.to(device))
                n_exact += exact.sum().item()
                n_right += right
                n_sup += sup
            rows.append({"name": vname or str(L), "length": L, "variant": vname,
                         "exact": n_exact / n, "token": n_right / max(n_sup, 1), "n": n})
    model.train()
    return rows


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if str(device).startswith("cuda") \
        else torch.autocast("cpu", enabled=False)


# =============================================================================================
# Training
# =============================================================================================

@dataclass
class TrainConfig:
    task: str = "flipflop"            # a key of tasks.TASKS
    method: str = "rope"              # a key of METHODS
    seed: int = 0                     # seeds the model init and the data stream
    steps: int = 1000                 # optimiser steps
    batch_size: int = 64              # sequences per step
    lr: float = 1e-3                  # peak learning rate (AdamW)
    weight_decay: float = 0.01        # AdamW weight decay
    warmup: int = 100                 # linear warm-up steps, then cosine decay to lr * min_lr_ratio
    min_lr_ratio: float = 0.1         # final learning rate as a fraction of the peak
    grad_clip: float = 1.0            # global gradient-norm clip
    train_lengths: list | None = None   # problem lengths sampled in training (None: the task's)
    test_lengths: list | None = None    # problem lengths evaluated (None: the task's)
    task_opts: dict = field(default_factory=dict)  # options passed to task.sample (e.g. n_back)
    curriculum: bool = False          # grow the maximum training length over the first half
    n_eval: int = 256                 # evaluation examples per length (and variant)
    eval_every: int = 0               # evaluate during training every this many steps (0: only at the end)
    ckpt_every: int = 500             # write a checkpoint every this many steps
    log_every: float = 5.0            # seconds between progress lines
    device: str = "auto"              # auto | cpu | cuda
    compile: bool = False             # torch.compile the model (CUDA only)
    preset: str = ""                  # the preset the defaults came from (recorded, not used)
    out: str = "runs"                 # output root
    tag: str = ""                     # run name suffix: runs/<task>/<method>[-tag]
    model: ModelConfig = field(default_factory=ModelConfig)

    def run_dir(self) -> Path:
        name = self.method + (f"-{self.tag}" if self.tag else "")
        return Path(self.out) / self.task / name / f"seed{self.seed}"


# Presets: the paper's model for each task on a GPU, a small one on a CPU. Steps are scaled so a
# run takes minutes; EXPERIMENTS records what was scaled for each headline result.
PRESETS = {
    "gpu": {
        "default": dict(d_model=128, n_layers=2, n_heads=4, steps=3000, batch_size=64, lr=1e-3),
        "flipflop": dict(d_model=64, n_layers=1, n_heads=2, steps=5000, batch_size=64, lr=1e-3),
        "a5": dict(d_model=256, n_layers=2, n_heads=4, steps=6000, batch_size=128),
        "mqrar": dict(d_model=256, n_layers=2, n_heads=2, steps=6000, batch_size=64),
        "polynomial": dict(d_model=128, n_layers=2, n_heads=1, steps=4000, batch_size=256, lr=3e-4),
        "parity": dict(d_model=128, n_layers=2, n_heads=1, steps=4000, batch_size=256, lr=3e-4),
        "binary_copy": dict(d_model=128, n_layers=2, n_heads=1, steps=4000, batch_size=256, lr=3e-4),
        "scan": dict(d_model=256, n_layers=6, n_heads=4, steps=6000, batch_size=128, lr=3e-4),
        "add_padded": dict(d_model=256, n_layers=6, n_heads=8, steps=6000, batch_size=128, lr=3e-4),
        "mul_padded": dict(d_model=256, n_layers=6, n_heads=8, steps=6000, batch_size=128, lr=3e-4),
    },
    "cpu": {
        "default": dict(d_model=64, n_layers=2, n_heads=4, steps=300, batch_size=32, lr=2e-3, n_eval=64),
        "flipflop": dict(d_model=64, n_layers=1, n_heads=2, steps=600, batch_size=32, lr=3e-3, n_eval=128),
        "mqrar": dict(d_model=64, n_layers=2, n_heads=2, steps=300, batch_size=16, lr=2e-3, n_eval=32),
    },
}


def preset(name: str, task: str) -> dict:
    p = PRESETS[name]
    return {**p["default"], **p.get(task, {})}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio; a pure function of the step, so
    resuming needs no scheduler state."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def curriculum_lengths(step: int, cfg: TrainConfig, lengths: list[int]) -> list[int]:
    """PRISM's length curriculum (section 6.4) scaled to the run: the maximum length steps
    through 5, 10, 20, 30, ... up to the largest training length during the first half of the
    steps, in equal parts, then stays there."""
    top = max(lengths)
    caps = [c for c in [5] + list(range(10, top, 10)) if c < top] + [top]
    stage = min(len(caps) - 1, int(step / max(1, cfg.steps // 2) * len(caps)))
    allowed = [L for L in lengths if L <= caps[stage]]
    return allowed or [min(lengths)]


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA GPU is available (use --device cpu)")
    if name != "cpu" and not name.startswith("cuda"):
        raise UsageError(f"unknown device {name!r} (use auto, cpu or cuda)")
    return name


def validate(cfg: TrainConfig) -> Task:
    """Check everything a run needs before anything is written; raise UsageError if not."""
    check_method(cfg.method)
    if cfg.task not in TASKS:
        raise UsageError(f"unknown task {cfg.task!r}; valid tasks: {', '.join(TASKS)}")
    task = TASKS[cfg.task]
    device = resolve_device(cfg.device)
    if cfg.compile and not device.startswith("cuda"):
        raise UsageError("--compile needs a CUDA GPU; drop it on CPU")
    for what, lengths in (("train", cfg.train_lengths or task.train_lengths),
                          ("test", cfg.test_lengths or task.test_lengths)):
        if not lengths:
            raise UsageError(f"no {what} lengths given")
        for L in lengths:
            try:
                task.check_length(L, **cfg.task_opts)
            except ValueError as e:
                raise UsageError(f"{what} length: {e}") from None
    try:
        task.check_opts(cfg.task_opts)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if METHODS[cfg.method].causal_only and not task.causal:
        raise UsageError(f"method {cfg.method!r} is causal only; task {cfg.task!r} needs a bidirectional model")
    if cfg.model.d_model % cfg.model.n_heads:
        raise UsageError(f"d_model {cfg.model.d_model} is not a multiple of n_heads {cfg.model.n_heads}")
    try:  # a layer checks its own options (e.g. --method-opt values) and may check the task's batches
        layer = METHODS[cfg.method].attention(dataclasses.replace(cfg.model, causal=task.causal))
        if hasattr(layer, "check_context"):                # e.g. UPE: the task's slots against upe_slots
            rng = np.random.default_rng(0)
            for L in (max(cfg.train_lengths or task.train_lengths), max(cfg.test_lengths or task.test_lengths)):
                for vopts in (task.variants or {None: {}}).values():
                    batch = task.sample(16, L, rng, **{**cfg.task_opts, **vopts})
                    layer.check_context(batch_context(task, batch, "cpu"))
    except ValueError as e:
        raise UsageError(f"method {cfg.method!r}: {e}") from None
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.n_eval < 1:
        raise UsageError("steps, batch size and n_eval must be positive")
    return task


def check_method(method: str):
    if method in METHODS:
        return
    available = ", ".join(METHODS)
    if method in ALL_METHODS:
        raise UsageError(f"method {method!r} is not implemented in this checkout yet; "
                         f"available methods: {available}")
    raise UsageError(f"unknown method {method!r}; available methods: {available}")


def git_hash() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def save_atomic(obj, path: Path):
    """Write to a temporary file, then rename: a crash never leaves half a file. Strings are
    written as text, dicts to .json as JSON, anything else with torch.save."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(obj, str):
        tmp.write_text(obj)
    elif path.suffix == ".json":
        tmp.write_text(json.dumps(obj, indent=1))
    else:
        torch.save(obj, tmp)
    os.replace(tmp, path)


CKPT = "checkpoint.pt"
# Fields that must agree between a checkpoint and the run resuming it.
RESUME_KEYS = ["task", "method", "seed", "batch_size", "train_lengths", "task_opts", "curriculum", "model"]


def load_checkpoint(cfg: TrainConfig) -> dict:
    path = cfg.run_dir() / CKPT
    if not path.exists():
        raise UsageError(f"--resume: no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        saved = ckpt["config"]
        assert isinstance(saved, dict) and "model" in ckpt
    except Exception as e:  # any unreadable file is reported the same way
        raise UsageError(f"--resume: checkpoint {path} is corrupt or unreadable ({type(e).__name__})") from None
    mine = asdict(cfg)
    diff = [k for k in RESUME_KEYS if saved.get(k) != mine[k]]
    if diff:
        detail = "; ".join(f"{k}: checkpoint {saved.get(k)} vs now {mine[k]}" for k in diff)
        raise UsageError(f"--resume: checkpoint {path} belongs to a different run ({detail})")
    if ckpt["step"] > cfg.steps:
        raise UsageError(f"--resume: checkpoint is at step {ckpt['step']}, beyond --steps {cfg.steps}")
    return ckpt


class NaNLoss(Exception):
    pass


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def train(cfg: TrainConfig, resume: bool = False, log=print) -> dict:
    """Train one model, evaluate it, write metrics.json and model.pt; return the metrics."""
    task = validate(cfg)
    device = resolve_device(cfg.device)
    cfg.model.vocab_size, cfg.model.causal = len(task.vocab), task.causal
    ckpt = load_checkpoint(cfg) if resume else None
    train_lengths = cfg.train_lengths or task.train_lengths
    test_lengths = cfg.test_lengths or task.test_lengths

    torch.manual_seed(cfg.seed)
    model = Model(cfg.model).to(device)
    method = METHODS[cfg.method]
    groups = method.param_groups(model, cfg.lr) if method.param_groups else []
    grouped = {id(p) for g in groups for p in g["params"]}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in grouped]
    no_decay = [p for p in model.parameters() if p.dim() < 2 and id(p) not in grouped]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}] + groups, lr=cfg.lr,
                            fused=device.startswith("cuda"))
    for g in opt.param_groups:
        g["lr_scale"] = g.get("lr", cfg.lr) / cfg.lr  # extra groups keep their ratio to the base lr
    rng = np.random.default_rng(cfg.seed)
    step, losses, wall = 0, [], 0.0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        rng.bit_generator.state = ckpt["rng"]
        torch.set_rng_state(ckpt["torch_rng"])
        if device.startswith("cuda") and ckpt.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(ckpt["cuda_rng"])
        step, losses, wall = ckpt["step"], ckpt["losses"], ckpt["wall"]
        log(f"resumed {cfg.run_dir()} at step {step}")
    fwd = torch.compile(model) if cfg.compile else model

    n_params = sum(p.numel() for p in model.parameters())
    log(f"{cfg.task} / {cfg.method} / seed {cfg.seed}: {cfg.model.n_layers} layers, {cfg.model.n_heads} heads, "
        f"d={cfg.model.d_model}, {n_params / 1e6:.2f}M params, {cfg.steps} steps x {cfg.batch_size} on {device}")

    def checkpoint():
        save_atomic({"config": asdict(cfg), "model": model.state_dict(), "opt": opt.state_dict(),
                     "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
                     "cuda_rng": torch.cuda.get_rng_state() if device.startswith("cuda") else None,
                     "step": step, "losses": losses, "wall": wall}, cfg.run_dir() / CKPT)

    model.train()
    t0, last_log, log_step = time.time() - wall, time.time(), step
    pending = []  # losses still on the device: reading each one would stall the GPU every step

    def flush():
        """Move pending losses to the host; stop at the first non-finite one."""
        if not pending:
            return
        values = torch.stack(pending).tolist()
        first = step - len(values) + 1
        for k, v in enumerate(values):
            if not math.isfinite(v):
                last = losses[-1][1] if losses else None
                raise NaNLoss(f"loss is {v} at step {first + k - 1}; last finite loss "
                              f"{'none' if last is None else f'{last:.4g}'} "
                              f"(the last checkpoint in {cfg.run_dir()} is kept)")
            losses.append([first + k, v])
        pending.clear()

    while step < cfg.steps:
        lengths = curriculum_lengths(step, cfg, train_lengths) if cfg.curriculum else train_lengths
        batch = sample_mixed(task, cfg.batch_size, lengths, rng, **cfg.task_opts)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg) * g["lr_scale"]
        with autocast(device):
            logits = fwd(batch.x.to(device), batch_context(task, batch, device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.y.to(device).flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        pending.append(loss.detach())
        if device == "cpu" or len(pending) >= 50:
            flush()
        now = time.time()
        if now - last_log >= cfg.log_every or step == cfg.steps:
            flush()
            rate = (step - log_step) / (now - last_log)
            log(f"  step {step:>6}/{cfg.steps} | loss {losses[-1][1]:.4f} | lr {lr_at(step - 1, cfg):.2e} | "
                f"{rate:6.1f} steps/s | eta {fmt_time((cfg.steps - step) / max(rate, 1e-9))}")
            last_log, log_step = now, step
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            rows = evaluate(model, task, test_lengths, cfg.n_eval, cfg.seed, device, cfg.task_opts, max(train_lengths))
            log("  eval: " + summary_line(rows, max(train_lengths)))
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            flush()   # never checkpoint weights that a NaN step has touched
            wall = time.time() - t0
            checkpoint()
    wall = time.time() - t0

    rows = evaluate(model, task, test_lengths, cfg.n_eval, cfg.seed, device, cfg.task_opts, max(train_lengths))
    train_max = max(train_lengths)
    in_dist = [r["exact"] for r in rows if r["length"] <= train_max and r["variant"] in (None, "ID")]
    metrics = {
        "task": cfg.task, "method": cfg.method, "seed": cfg.seed, "config": asdict(cfg),
        "git": git_hash(), "device": device_name(device), "wall_s": round(wall, 1),
        "n_params": n_params, "train_max_length": train_max,
        "train_exact": float(np.mean(in_dist)) if in_dist else None,
        "eval": rows, "loss": losses[:: max(1, len(losses) // 500)],
    }
    out = cfg.run_dir()
    save_atomic(model.state_dict(), out / "model.pt")
    save_atomic(metrics, out / "metrics.json")
    log(results_table(rows, train_max))
    return metrics


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)"


# =============================================================================================
# Reporting: tables, summaries over seeds, plots
# =============================================================================================

def summary_line(rows, train_max) -> str:
    ind = [r for r in rows if r["length"] <= train_max]
    ood = [r for r in rows if r["length"] > train_max]
    part = lambda rs: f"{np.mean([r['exact'] for r in rs]):.3f}" if rs else "-"  # noqa: E731
    if rows and rows[0]["variant"]:
        return " ".join(f"{r['name']} err {100 * (1 - r['token']):.2f}%" for r in rows)
    return f"exact in-dist {part(ind)} | beyond train length {part(ood)}"


def results_table(rows, train_max) -> str:
    """Accuracy by length (buckets of lengths when there are many), marking the training range."""
    if rows and rows[0]["variant"]:
        lines = ["| eval | length | error % (read bits) | exact |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['name']} | {r['length']} | {100 * (1 - r['token']):.3f} | {r['exact']:.3f} |" for r in rows]
        return "\n".join(lines)
    lengths = sorted({r["length"] for r in rows})
    groups = [[L] for L in lengths]
    if len(lengths) > 24:
        width = math.ceil(len(lengths) / 12)
        groups = [lengths[i:i + width] for i in range(0, len(lengths), width)]
    lines = ["| length | exact | token | |", "| --- | --- | --- | --- |"]
    for g in groups:
        sel = [r for r in rows if r["length"] in g]
        label = str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}"
        mark = "train" if g[-1] <= train_max else ("" if g[0] > train_max else "train/test")
        lines.append(f"| {label} | {np.mean([r['exact'] for r in sel]):.3f} | "
                     f"{np.mean([r['token'] for r in sel]):.3f} | {mark} |")
    return "\n".join(lines)


def summarize(method_dir: Path) -> dict | None:
    """Combine every seed's metrics in runs/<task>/<method>/seed*/ into <method>/metrics.json:
    per evaluation point the mean, min and max over seeds, and the best seed (highest mean
    accuracy beyond the training length among seeds whose in-distribution accuracy >= 0.85)."""
    seeds = []
    for p in sorted(method_dir.glob("seed*/metrics.json")):
        try:
            seeds.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if not seeds:
        return None
    names = [r["name"] for r in seeds[0]["eval"]]
    points = []
    for i, name in enumerate(names):
        ex = [m["eval"][i]["exact"] for m in seeds if len(m["eval"]) > i]
        tok = [m["eval"][i]["token"] for m in seeds if len(m["eval"]) > i]
        r = seeds[0]["eval"][i]
        points.append({"name": name, "length": r["length"], "variant": r["variant"],
                       "exact": float(np.mean(ex)), "exact_min": min(ex), "exact_max": max(ex),
                       "token": float(np.mean(tok)), "token_min": min(tok), "token_max": max(tok)})
    train_max = seeds[0]["train_max_length"]

    def ood(m):
        rs = [r["exact"] for r in m["eval"] if r["length"] > train_max] or [r["exact"] for r in m["eval"]]
        return float(np.mean(rs))
    eligible = [m for m in seeds if (m["train_exact"] or 0) >= 0.85] or seeds
    best = max(eligible, key=ood)
    summary = {"task": seeds[0]["task"], "method": seeds[0]["method"], "label": method_dir.name,
               "seeds": [m["seed"] for m in seeds], "train_max_length": train_max,
               "device": seeds[0]["device"], "wall_s": [m["wall_s"] for m in seeds],
               "eval": points, "best_seed": best["seed"], "best_eval": best["eval"]}
    save_atomic(summary, method_dir / "metrics.json")
    return summary


def plot_task(task_dir: Path) -> Path | None:
    """runs/<task>/extrapolation.png: every method run on the task; mean over seeds with the
    min-max spread; a dashed line at the maximum training length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = []
    for d in sorted(task_dir.iterdir()):
        if d.is_dir() and (d / "metrics.json").exists():
            summaries.append(json.loads((d / "metrics.json").read_text()))
    if not summaries:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if len(summaries) > 10:  # the default cycle repeats after 10 colours
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    task = summaries[0]["task"]
    title = f"{task}: length extrapolation"
    if summaries[0]["eval"][0]["variant"]:  # flip-flop: error % per evaluation setting
        names = [p["name"] for p in summaries[0]["eval"]]
        width = 0.8 / len(summaries)
        for k, s in enumerate(summaries):
            err = [100 * (1 - p["token"]) for p in s["eval"]]
            lo = [100 * (1 - p["token_max"]) for p in s["eval"]]
            hi = [100 * (1 - p["token_min"]) for p in s["eval"]]
            xs = np.arange(len(names)) + k * width
            bars = ax.bar(xs, err, width, label=f"{s['label']} ({len(s['seeds'])} seeds)",
                          yerr=[np.subtract(err, lo), np.subtract(hi, err)])
            for x, e in zip(xs, err):
                if e == 0:  # an empty bar is easy to miss: say it is zero
                    ax.text(x, 0.005, "0", ha="center", va="bottom", color=bars.patches[0].get_facecolor())
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
        ax.set_ylabel("error % at read bits (lower is better)")
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set_ylim(0, 100)
        title = f"{task}: error by evaluation setting"
    else:
        for s in summaries:
            xs = [p["length"] for p in s["eval"]]
            line, = ax.plot(xs, [p["exact"] for p in s["eval"]], marker=".", label=f"{s['label']} ({len(s['seeds'])} seeds)")
            ax.fill_between(xs, [p["exact_min"] for p in s["eval"]], [p["exact_max"] for p in s["eval"]],
                            color=line.get_color(), alpha=0.15)
        ax.axvline(summaries[0]["train_max_length"], color="gray", linestyle="--", label="max train length")
        ax.set_xlabel("problem length")
        ax.set_ylabel("exact-match accuracy")
        ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = task_dir / "extrapolation.png"
    tmp = task_dir / "extrapolation.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


# =============================================================================================
# Headline experiments
# =============================================================================================

@dataclass
class Experiment:
    claim: str                   # the paper's result in words
    runs: list                   # dicts: task, method, optional tag and TrainConfig/ModelConfig overrides
    columns: list                # (label, selector, metric): selector = variant name or (lo, hi) lengths
    paper: dict                  # run label -> the paper's number per column (strings)
    scaled: str                  # what was scaled down from the paper to fit minutes
    seeds: list = field(default_factory=lambda: [0])
    sweep: tuple | None = None   # (x-axis label, column index): plot that column against the number in
                                 # each run's tag (e.g. L2 -> 2), one line per method


VIPE_METHODS = ("ape", "nope", "rope", "alibi", "t5", "fire", "vipe")


def _vipe_experiment(task: str) -> Experiment:
    """One task of the ViPE paper's Figure 6 / 12: seven encodings x 2 and 3 layers, one seed."""
    return Experiment(
        claim=f"{task}: train L=1..16, test 17..48, 1 head, d=128, 2 and 3 layers: ViPE keeps high accuracy "
              "to about 2x the training length while the other encodings collapse (paper Fig. 6 and 12)",
        runs=[dict(task=task, method=m, tag=f"L{n}", n_layers=n) for n in (2, 3) for m in VIPE_METHODS],
        columns=[("1-16", (1, 16), "exact"), ("17-24", (17, 24), "exact"), ("25-32", (25, 32), "exact"),
                 ("33-48", (33, 48), "exact")],
        paper={**{f"{m}-L{n}": ["≥ 0.85 (selection rule)", "collapses", "collapses", "collapses"]
                  for m in VIPE_METHODS[:-1] for n in (2, 3)},
               **{f"vipe-L{n}": ["≥ 0.85 (selection rule)", "high", "high (to ~2x)", "falls"] for n in (2, 3)}},
        scaled="4k steps x 256 fresh sequences (the paper: 2000 epochs over 32,768 sequences, i.e. 256k steps); "
               "one seed (the paper: best of 8 with in-distribution accuracy >= 0.85; add seeds with --seeds "
               "on single runs); one task per experiment so that each fits in about ten minutes")


EXPERIMENTS: dict[str, Experiment] = {
    "path-flipflop": Experiment(
        claim="Flip-flop LM, 1 layer, 2 heads, d=64: error % ID / sparse / dense",
        runs=[dict(task="flipflop", method=m, steps=5000) for m in ("rope", "fox", "path")],
        columns=[("ID err %", "ID", "error"), ("sparse err %", "sparse", "error"), ("dense err %", "dense", "error")],
        paper={"rope": ["6.9", "40.3", "0.01"], "fox": ["8.3", "36.3", "0"], "path": ["0", "0.0001", "0"]},
        scaled="5k steps x 64 sequences for every method (the paper does not state its budget); 256 eval "
               "sequences per setting, so the smallest measurable non-zero error is ~0.03 %",
        seeds=[0, 1, 2]),
    "path-a5": Experiment(
        claim="A5 word problem, sequences of 20: PaTH needs fewer layers than RoPE to solve it "
              "(solved = accuracy above 90 %; the paper: PaTH 2 layers, the others 4)",
        runs=[dict(task="a5", method=m, tag=f"L{n}", n_layers=n, steps=5000)
              for n in (2, 4) for m in ("rope", "path")],
        columns=[("length 20 token acc", (20, 20), "token"), ("length 20 exact", (20, 20), "exact"),
                 ("length 40 token acc", (40, 40), "token")],
        paper={"rope-L4": ["> 0.9", "", ""], "path-L2": ["> 0.9", "", ""]},
        scaled="2 and 4 layers only, 5k steps x 128 sequences of length 20, d=256, 4 heads, one seed per depth (a first "
               "try with 1-4 layers at 2k steps learned nothing beyond the first two positions for either method)",
        sweep=("layers", 0)),
    "path-mqrar": Experiment(
        claim="Multi-query repeated associative recall with N-back (MQRAR-N), 2 layers, d=256, 2 heads: "
              "PaTH holds its accuracy for N < 4, RoPE and FoX fall as N grows (paper Fig. 2)",
        runs=[dict(task="mqrar", method=m, tag=f"N{n}", task_opts={"n_back": n}, steps=2000)
              for n in (1, 2, 3, 4) for m in ("rope", "fox", "path")],
        columns=[("token acc", (384, 384), "token")],
        paper={},
        scaled="2k steps x 64 sequences of 384 assignments, one seed per setting (the paper trains to convergence)",
        sweep=("N (n-back)", 0)),
    "vipe-poly": _vipe_experiment("polynomial"),
    "vipe-parity": _vipe_experiment("parity"),
    "vipe-binary-copy": _vipe_experiment("binary_copy"),
    "vipe-scan": Experiment(
        claim="SCAN length split, 6 layers, 4 heads, d=256: exact match on the test split (paper Table 2)",
        runs=[dict(task="scan", method=m) for m in ("ape", "rope", "nope", "vipe")],
        columns=[("train lengths (<= 22 actions)", (1, 22), "exact"), ("unseen lengths (24-48)", (24, 48), "exact")],
        paper={"ape": ["", "0.000"], "rope": ["", "0.021"], "nope": ["", "0.132"], "vipe": ["", "0.150"]},
        scaled="6k steps x 128 commands; our columns average the exact match over the action counts of each "
               "range, the paper reports one number over the test split's commands"),
    "prism-copy": Experiment(
        claim="Copy, trained on lengths <= 10, tested to 100: PRISM stays near 100 % to 10x the training length; "
              "APE with a random position shift fails (paper Fig. 3)",
        runs=[dict(task="copy", method="prism", curriculum=True),
              dict(task="copy", method="ape", ape_shift=100, curriculum=True)],
        columns=[("1-10 (train)", (1, 10), "exact"), ("11-20", (11, 20), "exact"), ("21-50", (21, 50), "exact"),
                 ("51-100", (51, 100), "exact")],
        paper={"prism": ["~1.0", "~1.0", "~1.0", "~1.0"], "ape": ["", "fails", "fails", "fails"]},
        scaled="the GPU preset (2 layers, d=128, 4 heads, 3k steps x 64; the paper: 150k steps x 100) with the "
               "curriculum compressed into the first half of the steps"),
    "prism-add": Experiment(
        claim="Addition with chain of thought, trained on <= 10 digits, tested to 30: PRISM extrapolates to "
              "20-30 digits, APE fails (paper Fig. 4)",
        runs=[dict(task="add_cot", method="prism", curriculum=True),
              dict(task="add_cot", method="ape", ape_shift=100, curriculum=True)],
        columns=[("1-10 (train)", (1, 10), "exact"), ("11-20", (11, 20), "exact"), ("21-30", (21, 30), "exact")],
        paper={"prism": ["~1.0", "high", "high"], "ape": ["", "fails", "fails"]},
        scaled="the GPU preset (2 layers, d=128, 4 heads, 3k steps x 64; the paper: 150k steps x 100)"),
    "prism-more": Experiment(
        claim="Reverse, odds-first, stack (train <= 40, test to 150), dynamic string copy, multiplication "
              "with chain of thought (train <= 9), SCAN with chain of thought (paper Fig. 5-10)",
        runs=[dict(task="reverse", method="prism", curriculum=True, opts={"prism_bins": 512}),
              dict(task="odds_first", method="prism", curriculum=True, n_layers=4,
                   opts={"prism_blocks": [0, 3], "prism_bins": 512}),
              dict(task="stack", method="prism", curriculum=True, n_layers=4,
                   opts={"prism_blocks": [0, 3], "prism_bins": 512}),
              dict(task="dyn_str_cpy", method="prism", curriculum=True, opts={"prism_copy": True}),
              dict(task="mul_cot", method="prism", curriculum=True),
              dict(task="scan_cot", method="prism")],
        columns=[("up to the training length", "train", "exact"), ("beyond it", "beyond", "exact")],
        paper={},
        scaled="the GPU preset per task (3k steps; the paper: 150k); PRISM only (the figures' baselines are "
               "the other experiments' APE runs); odds_first and stack recompute positions before blocks 1 and 4; "
               "dyn_str_cpy uses the copy branch"),
    "upe-add": Experiment(
        claim="Padded addition (width 20), bidirectional encoder, train operands < 10^5: APE fails from 6 digits, "
              "RPE generalises (UPE paper section 3)",
        runs=[dict(task="add_padded", method=m) for m in ("ape", "rpe")],
        columns=[("k=5 (train)", (5, 5), "exact"), ("k=6-10", (6, 10), "exact"), ("k=11-15", (11, 15), "exact"),
                 ("k=16-20", (16, 20), "exact")],
        paper={"ape": ["", "fails", "fails", "fails"], "rpe": ["", "generalises", "generalises", "generalises"]},
        scaled="6 layers, d=256, 8 heads, 6k steps x 128 (the paper: a 6-9 layer, 768-wide BERT); RPE clip 64"),
    "upe-mul": Experiment(
        claim="Padded multiplication, 1- and 3-digit multipliers, train multiplicands < 10^5, test to 20 digits: "
              "with a 3-digit multiplier UPE keeps about 90 % at 16 digits, RPE degrades, APE fails",
        runs=[dict(task="mul_padded", method=m, tag=f"m{d}", task_opts={"multiplier_digits": d})
              for d in (1, 3) for m in ("ape", "rpe", "upe")],
        columns=[("k=5 (train)", (5, 5), "exact"), ("k=6-10", (6, 10), "exact"), ("k=11-15", (11, 15), "exact"),
                 ("k=16", (16, 16), "exact"), ("k=17-20", (17, 20), "exact")],
        paper={"upe-m3": ["", "", "", "~0.9", ""], "rpe-m3": ["", "", "", "degrades", ""],
               "ape-m3": ["", "fails", "fails", "fails", "fails"]},
        scaled="6 layers, d=256, 8 heads, 6k steps x 128 (the paper: a 6-9 layer, 768-wide BERT); RPE clip 64, "
               "3 uniform slots"),
}


def experiment_configs(exp: Experiment, device: str, out: str, preset_name: str) -> list[TrainConfig]:
    cfgs = []
    for run in exp.runs:
        for seed in exp.seeds:
            cfgs.append(make_config({**run, "seed": seed, "device": device, "out": out}, preset_name))
    return cfgs


def make_config(values: dict, preset_name: str) -> TrainConfig:
    """TrainConfig from a preset, overridden by `values` (TrainConfig or ModelConfig fields)."""
    merged = {**preset(preset_name, values["task"]), **{k: v for k, v in values.items() if v is not None}}
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(merged) - model_fields - train_fields
    if unknown:
        raise UsageError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    model = ModelConfig(**{k: v for k, v in merged.items() if k in model_fields})
    model.method = merged["method"]
    cfg = TrainConfig(**{k: v for k, v in merged.items() if k in train_fields and k != "model"}, model=model)
    cfg.preset = preset_name
    return cfg


def experiment_table(name: str, exp: Experiment, out: Path) -> str:
    """Markdown table "paper vs this repo" from the summaries written by the runs."""
    lines = [f"### {name}", "", exp.claim, "", f"Scaled: {exp.scaled}", ""]
    head = [c[0] for c in exp.columns]
    lines += ["| run | source | " + " | ".join(head) + " | seeds | device | wall |",
              "| --- | --- | " + " | ".join("---" for _ in head) + " | --- | --- | --- |"]
    seen = []
    for run in exp.runs:
        label = run["method"] + (f"-{run['tag']}" if run.get("tag") else "")
        key = (run["task"], label)
        if key in seen:
            continue
        seen.append(key)
        if label in exp.paper:
            lines.append(f"| {run['task']}/{label} | paper | " + " | ".join(exp.paper[label]) + " | | | |")
        path = out / run["task"] / label / "metrics.json"
        if not path.exists():
            lines.append(f"| {run['task']}/{label} | this repo | " + " | ".join("not run" for _ in head) + " | | | |")
            continue
        s = json.loads(path.read_text())
        cells = [column_value(s, sel, metric) for _, sel, metric in exp.columns]
        lines.append(f"| {run['task']}/{label} | this repo | " + " | ".join(cells)
                     + f" | {len(s['seeds'])} | {s['device']} | {fmt_time(float(np.mean(s['wall_s'])))} |")
    return "\n".join(lines)


def column_numbers(summary: dict, selector, metric: str):
    """(mean, lo, hi) over seeds of one column, or None; flip-flop errors in percent. selector:
    a variant name, a (lo, hi) length range, or "train" / "beyond" (up to / past the training length)."""
    if selector in ("train", "beyond"):
        top = summary["train_max_length"]
        pts = [p for p in summary["eval"] if (p["length"] <= top) == (selector == "train")]
    elif isinstance(selector, str):
        pts = [p for p in summary["eval"] if p["name"] == selector]
    else:
        pts = [p for p in summary["eval"] if selector[0] <= p["length"] <= selector[1]]
    if not pts:
        return None
    if metric == "error":
        f = lambda key: 100 * (1 - np.mean([p[key] for p in pts]))  # noqa: E731
        return f("token"), f("token_max"), f("token_min")
    f = lambda key: float(np.mean([p[key] for p in pts]))  # noqa: E731
    return f(metric), f(metric + "_min"), f(metric + "_max")


def column_value(summary: dict, selector, metric: str) -> str:
    """Mean over seeds (min-max) of one column, as text."""
    nums = column_numbers(summary, selector, metric)
    if nums is None:
        return "-"
    return f"{nums[0]:.2f} ({nums[1]:.2f}-{nums[2]:.2f})" if metric == "error" else \
        f"{nums[0]:.3f} ({nums[1]:.2f}-{nums[2]:.2f})"


def plot_sweep(name: str, exp: Experiment, out: Path) -> Path | None:
    """One column of an experiment against the number in each run's tag, one line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xlabel, col = exp.sweep
    label, selector, metric = exp.columns[col]
    lines: dict[str, list] = {}
    for run in exp.runs:
        path = out / run["task"] / f"{run['method']}-{run['tag']}" / "metrics.json"
        nums = column_numbers(json.loads(path.read_text()), selector, metric) if path.exists() else None
        if nums is not None:
            lines.setdefault(run["method"], []).append((int("".join(filter(str.isdigit, run["tag"]))), *nums))
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method, pts in lines.items():
        pts.sort()
        x, y, lo, hi = zip(*pts)
        ax.plot(x, y, marker="o", label=method)
        ax.fill_between(x, lo, hi, alpha=0.15)
    ax.set_xticks(sorted({p[0] for pts in lines.values() for p in pts}))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(label)
    ax.set_title(f"{name} ({exp.runs[0]['task']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "reproduce" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# =============================================================================================
# CLI
# =============================================================================================

def parse_list(text: str | None, kind=str) -> list | None:
    if text is None:
        return None
    try:
        out = []
        for part in text.split(","):
            part = part.strip()
            if kind is int and "-" in part[1:]:
                lo, hi = part.split("-")
                out += list(range(int(lo), int(hi) + 1))
            elif part:
                out.append(kind(part))
        return out
    except ValueError:
        raise UsageError(f"cannot read {text!r} as a comma-separated list of {kind.__name__}s (ranges like 1-16 allowed)") from None


def parse_opts(items: list[str], flag: str = "--task-opt") -> dict:
    opts = {}
    for item in items or []:
        if "=" not in item:
            raise UsageError(f"{flag} takes key=value, got {item!r}")
        k, v = item.split("=", 1)
        try:
            opts[k] = json.loads(v)
        except json.JSONDecodeError:
            opts[k] = v
    return opts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to run")
    g.add_argument("--task", help=f"one of: {', '.join(TASKS)}")
    g.add_argument("--method", help=f"one of: {', '.join(ALL_METHODS)}")
    g.add_argument("--methods", help="several methods, comma-separated")
    g.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    g.add_argument("--reproduce", metavar="NAME", help=f"a headline experiment: {', '.join(EXPERIMENTS)} or all")
    g.add_argument("--force", action="store_true", help="with --reproduce: rerun results already present")
    g.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    g.add_argument("--preset", choices=list(PRESETS), help="default: gpu on CUDA, cpu otherwise")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (CUDA only)")
    g.add_argument("--out", default="runs", help="output root (default runs/)")
    g.add_argument("--tag", default="", help="suffix of the run name: runs/<task>/<method>-<tag>")
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int)
    g.add_argument("--n-layers", type=int)
    g.add_argument("--n-heads", type=int)
    g.add_argument("--ape-shift", type=int, help="APE: random position offset in [0, N] during training")
    g.add_argument("--tie-weights", action="store_true", default=None)
    g.add_argument("--method-opt", action="append", metavar="KEY=VALUE",
                   help="method option (ModelConfig.opts), e.g. vipe_mode=value; combine with --tag")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--warmup", type=int)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--curriculum", action="store_true", default=None, help="grow the training length (PRISM)")
    g = p.add_argument_group("data and evaluation")
    g.add_argument("--train-lengths", help="e.g. 1-16 or 5,10,20")
    g.add_argument("--test-lengths", help="e.g. 1-48")
    g.add_argument("--task-opt", action="append", metavar="KEY=VALUE", help="task option, e.g. n_back=2")
    g.add_argument("--n-eval", type=int, help="evaluation examples per length")
    g.add_argument("--eval-every", type=int)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_cli(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NaNLoss as e:
        print(f"error: training stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; continue with the same command and --resume", file=sys.stderr)
        return 130


def run_cli(args) -> int:
    device = resolve_device(args.device)
    preset_name = args.preset or ("gpu" if device.startswith("cuda") else "cpu")
    if args.reproduce:
        return reproduce(args, device, preset_name)
    methods = parse_list(args.methods) or ([args.method] if args.method else None)
    if not methods or not args.task:
        raise UsageError("give --task and --method (or --methods, or --reproduce NAME); see --help")
    for m in methods:
        check_method(m)
    seeds = parse_list(args.seeds, int)
    values = dict(task=args.task, device=args.device, out=args.out, tag=args.tag, d_model=args.d_model,
                  n_layers=args.n_layers, n_heads=args.n_heads, ape_shift=args.ape_shift,
                  tie_weights=args.tie_weights, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                  warmup=args.warmup, weight_decay=args.weight_decay, curriculum=args.curriculum,
                  train_lengths=parse_list(args.train_lengths, int), test_lengths=parse_list(args.test_lengths, int),
                  task_opts=parse_opts(args.task_opt), n_eval=args.n_eval, eval_every=args.eval_every,
                  compile=args.compile or None, opts=parse_opts(args.method_opt, "--method-opt") or None)
    cfgs = [make_config({**values, "method": m, "seed": s}, preset_name) for m in methods for s in seeds]
    for cfg in cfgs:   # every run is checked before the first one starts
        validate(cfg)
    if preset_name == "cpu":
        print("Using the small CPU preset: it shows the mechanics in minutes, not the paper's numbers "
              "(run on a GPU for the paper's setting).")
    for cfg in cfgs:
        train(cfg, resume=args.resume)
        summarize(cfg.run_dir().parent)
    plot = plot_task(Path(args.out) / args.task)
    print(f"wrote {cfgs[0].run_dir().parent}/metrics.json and {plot}")
    return 0


def reproduce(args, device: str, preset_name: str) -> int:
    names = list(EXPERIMENTS) if args.reproduce == "all" else [args.reproduce]
    for name in names:
        if name not in EXPERIMENTS:
            raise UsageError(f"unknown experiment {name!r}; available: {', '.join(EXPERIMENTS)}, all")
    plans = {name: experiment_configs(EXPERIMENTS[name], args.device, args.out, preset_name) for name in names}
    for cfgs in plans.values():
        for cfg in cfgs:
            validate(cfg)
    if preset_name == "cpu":
        print("Using the small CPU preset: the table will not show the paper's numbers.")
    out = Path(args.out)
    tables = []
    for name, cfgs in plans.items():
        print(f"== {name}: {len(cfgs)} runs")
        for cfg in cfgs:
            if (cfg.run_dir() / "metrics.json").exists() and not args.force:
                print(f"skip {cfg.run_dir()} (already present; --force reruns it)")
            else:
                train(cfg)
            summarize(cfg.run_dir().parent)
        for task in sorted({c.task for c in cfgs}):
            plot_task(out / task)
        table = experiment_table(name, EXPERIMENTS[name], out)
        save_atomic(table + "\n", out / "reproduce" / f"{name}.md")
        if EXPERIMENTS[name].sweep:
            print(f"wrote {plot_sweep(name, EXPERIMENTS[name], out)}")
        print(table)
        tables.append(table)
    if args.reproduce == "all":   # one file, paper vs this repo for every experiment
        save_atomic("# Paper vs this repo\n\n" + "\n\n".join(tables) + "\n", out / "reproduce" / "all.md")
        print(f"wrote {out / 'reproduce' / 'all.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
