"""Training, evaluation, checkpoints, the method registry and the command line.

    python train.py --method rope --task flipflop          # one model, table + plot in runs/
    python train.py --methods nope,rope,alibi --task polynomial --seeds 0,1,2
    python train.py --reproduce vipe-poly                  # a paper's headline experiment

One run trains the shared Transformer of model.py on data generated on the fly, evaluates
exact-match and token accuracy at every test length in one teacher-forced pass per batch (for a
causal model this equals greedy decoding, see `greedy_decode`), prints a table, and writes
runs/<task>/<method>/seed<S>/{metrics.json, model.pt}, a summary over seeds in
runs/<task>/<method>/metrics.json, and runs/<task>/extrapolation.png overlaying every method run
on the task (experiments.py). On a GPU the defaults follow the paper's setting (scaled to
minutes); on a CPU a small preset shows the mechanics.

Shapes: B batch, T time, V vocabulary.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import path_attention
import prism
import upe
import vipe
from examples import relative_bias
from model import SinusoidalAPE, Method, Model, ModelConfig, baseline, batch_context
from tasks import IGNORE, TASKS, Batch, Task, collate, sample_mixed

# Every position encoding by name: one line each. A new encoding is a Method in its own file
# (see examples/relative_bias.py) and one line here.
METHODS: dict[str, Method] = {
    "nope": baseline("nope"),
    "ape": baseline("nope", hooks=SinusoidalAPE),
    "rope": baseline("rope"),
    "alibi": baseline("alibi"),
    "t5": baseline("t5"),
    "fire": baseline("fire"),
    "fox": path_attention.FOX,
    "path": path_attention.PATH,
    "path-fox": path_attention.PATH_FOX,
    "vipe": vipe.VIPE,
    "rpe": upe.RPE,
    "upe": upe.UPE,
    "prism": prism.PRISM,
    "relbias": relative_bias.RELBIAS,
}


def build_model(cfg: ModelConfig) -> Model:
    """The model of a config, with the encoding named by cfg.method."""
    return Model(cfg, METHODS[cfg.method])


class UsageError(Exception):
    """Bad input: printed as one line by the CLI, which then exits with status 2."""


# =============================================================================================
# Evaluation
# =============================================================================================

def score(logits, y):
    """Per sequence: exact match (every supervised position right), right and supervised tokens, (B,) each."""
    pred = logits.argmax(-1)
    sup = y != IGNORE
    right = (pred == y) & sup
    return (right | ~sup).all(dim=1), right.sum(1), sup.sum(1)


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


S_RULES = ("fixed", "per_length", "one")


def compression(rule: str, L: int, train_max: int, test_max: int) -> float:
    """ViPE's test-time factor s (SPEC 7.3): "fixed" s = test_max / train_max for every length (the
    paper's eq. 7, after a short fine-tuning with it), "per_length" s = max(1, L / train_max),
    "one" s = 1. Encodings other than ViPE do not read s."""
    return {"fixed": max(1.0, test_max / train_max), "per_length": max(1.0, L / train_max), "one": 1.0}[rule]


@torch.no_grad()
def evaluate(model, task: Task, lengths, n: int, seed: int, device, task_opts=None,
             train_max: int | None = None, batch_size: int = 256, s_rule: str = "per_length",
             stream: int = 1, tokens_per_batch: int = 2 ** 17) -> list[dict]:
    """Exact-match and token accuracy at every test length (and every task variant). Uses its
    own generator (`stream` 1: the test set; 2: the held-out set of evaluations during training),
    so evaluating never changes the training data stream. A task with a finite test set (SCAN)
    gives every example of a length once instead (the row's n is then their number). Examples of
    several lengths share one forward pass, right-padded (exact, as in `Step`), up to
    tokens_per_batch tokens."""
    model.eval()
    rng = np.random.default_rng([seed, stream])
    every = {L: task.every_example(L, **(task_opts or {})) for L in lengths}
    rows = [{"name": vname or str(L), "length": L, "variant": vname, "n": n if every[L] is None else len(every[L].x)}
            for L in lengths for vname in (task.variants or {None: {}})]
    counts = np.zeros((len(rows), 3))                      # per row: exact, right tokens, supervised

    def pieces():                                          # (row, s, batch), in the order drawn
        for k, r in enumerate(rows):
            opts = {**(task_opts or {}), **task.variants.get(r["variant"], {})}
            s = compression(s_rule, r["length"], train_max, max(lengths)) if train_max else 1.0
            for start in range(0, r["n"], batch_size):
                if every[r["length"]] is None:
                    yield k, s, task.sample(min(batch_size, n - start), r["length"], rng, **opts)
                else:
                    b = every[r["length"]]
                    yield k, s, Batch(*(None if v is None else v[start:start + batch_size]
                                        for v in (b.x, b.y, b.length, b.slot)))

    def run(group):
        batch = collate([b for _, _, b in group], task.pad_id)
        with autocast(device):
            logits = model(batch.x.to(device), batch_context(task, batch, device, group[0][1]))
        per_seq = torch.stack(score(logits.float(), batch.y.to(device)), 1).cpu().numpy()     # (B, 3)
        first = 0
        for k, _, b in group:
            counts[k] += per_seq[first:first + len(b.x)].sum(0)
            first += len(b.x)

    group = []
    for piece in pieces():
        size = sum(len(b.x) for _, _, b in group) + len(piece[2].x)
        width = max([b.x.shape[1] for _, _, b in group] + [piece[2].x.shape[1]])
        if group and (piece[1] != group[0][1] or size * width > tokens_per_batch):
            run(group)
            group = []
        group.append(piece)
    if group:
        run(group)
    for r, (exact, right, sup) in zip(rows, counts):
        r.update(exact=exact / r["n"], token=right / max(sup, 1))
    model.train()
    return rows


def autocast(device):
    """bf16 on CUDA (without the weight-cast cache, which a CUDA graph cannot hold), off on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False) if str(device).startswith("cuda") \
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
    held_out_lengths: list | None = None  # also evaluated then, on other examples (the UPE paper's rule)
    s_rule: str = "fixed"             # ViPE's test-time s: fixed | per_length | one (see `compression`)
    finetune_steps: int = 0           # ViPE: steps trained with the fixed s before the final evaluation
    ckpt_every: int = 500             # write a checkpoint every this many steps
    log_every: float = 5.0            # seconds between progress lines
    device: str = "auto"              # auto | cpu | cuda
    workers: int = 0                  # processes that make training batches ahead of the step (0: in the loop)
    graphs: bool = False              # replay each step from a CUDA graph per padded length (CUDA only)
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
    if cfg.graphs and not device.startswith("cuda"):
        raise UsageError("CUDA graphs need a CUDA GPU")
    for what, lengths in (("train", cfg.train_lengths or task.train_lengths),
                          ("test", cfg.test_lengths or task.test_lengths), ("held-out", cfg.held_out_lengths or [])):
        if not lengths and what != "held-out":
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
    for flag, value, ok, need in numeric_checks(cfg):
        if not ok:
            raise UsageError(f"{flag} must be {need}, got {value}")
    check_writable(Path(cfg.out))
    unknown = sorted(set(cfg.model.opts) - set(METHODS[cfg.method].options))
    if unknown:
        valid = ", ".join(METHODS[cfg.method].options) or "none"
        raise UsageError(f"method {cfg.method!r} has no option {unknown[0]!r} (--method-opt); its options: {valid} "
                         f"(--help-method {cfg.method})")
    if METHODS[cfg.method].causal_only and not task.causal:
        raise UsageError(f"method {cfg.method!r} is causal only; task {cfg.task!r} needs a bidirectional model")
    if cfg.model.d_model % cfg.model.n_heads:
        raise UsageError(f"d_model {cfg.model.d_model} is not a multiple of n_heads {cfg.model.n_heads}")
    rng, samples = np.random.default_rng(0), []    # the task's options in use: a few examples
    for L in (max(cfg.train_lengths or task.train_lengths), max(cfg.test_lengths or task.test_lengths)):
        for vopts in [{}] + list(task.variants.values()):            # training, then each evaluation
            try:
                samples.append(task.sample(16, L, rng, **{**cfg.task_opts, **vopts}))
            except (ValueError, TypeError) as e:
                raise UsageError(f"task {cfg.task!r} with {cfg.task_opts}: {e}") from None
    try:  # a layer checks its own options (e.g. --method-opt values) and may check the task's batches
        layer = METHODS[cfg.method].attention(dataclasses.replace(cfg.model, causal=task.causal))
        for batch in samples if hasattr(layer, "check_context") else []:   # UPE: slots; PRISM: bins
            layer.check_context({**batch_context(task, batch, "cpu"), "tokens": batch.x})
    except (ValueError, TypeError) as e:
        raise UsageError(f"method {cfg.method!r}: {e}") from None
    return task


def check_writable(out: Path):
    """The output folder, or its nearest existing parent, takes a file (tried with a temporary one),
    so that a run never trains to lose its results."""
    top = out.resolve()
    while not top.exists():
        top = top.parent
    try:
        if not top.is_dir():
            raise NotADirectoryError(f"{top} is not a folder")
        tempfile.TemporaryFile(dir=top).close()
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write there ({e})") from None


def numeric_checks(cfg: TrainConfig):
    """(flag, value, within range, the range in words) for every number a run reads."""
    m = cfg.model
    return [("--steps", cfg.steps, cfg.steps >= 1, ">= 1"), ("--batch-size", cfg.batch_size, cfg.batch_size >= 1, ">= 1"),
            ("--lr", cfg.lr, cfg.lr > 0, "> 0"), ("--warmup", cfg.warmup, cfg.warmup >= 0, ">= 0"),
            ("--weight-decay", cfg.weight_decay, cfg.weight_decay >= 0, ">= 0"),
            ("min_lr_ratio", cfg.min_lr_ratio, 0 <= cfg.min_lr_ratio <= 1, "in [0, 1]"),
            ("grad_clip", cfg.grad_clip, cfg.grad_clip > 0, "> 0"), ("--n-eval", cfg.n_eval, cfg.n_eval >= 1, ">= 1"),
            ("--eval-every", cfg.eval_every, cfg.eval_every >= 0, ">= 0"),
            ("--finetune-steps", cfg.finetune_steps, cfg.finetune_steps >= 0, ">= 0"),
            ("--s-rule", cfg.s_rule, cfg.s_rule in S_RULES, f"one of {', '.join(S_RULES)}"),
            ("--workers", cfg.workers, cfg.workers >= 0, ">= 0"), ("ckpt_every", cfg.ckpt_every, cfg.ckpt_every >= 1, ">= 1"),
            ("--d-model", m.d_model, m.d_model >= 1, ">= 1"), ("--n-layers", m.n_layers, m.n_layers >= 1, ">= 1"),
            ("--n-heads", m.n_heads, m.n_heads >= 1, ">= 1"), ("--ape-shift", m.ape_shift, m.ape_shift >= 0, ">= 0")]


def check_method(method: str):
    if method not in METHODS:
        raise UsageError(f"unknown method {method!r}; available methods: {', '.join(METHODS)}")


def git_hash() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def save_atomic(obj, path: Path):
    """Write to a temporary file, then rename: a crash never leaves half a file. Strings are
    written as text, dicts to .json as JSON, anything else with torch.save."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")  # one per writer
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(obj, str):
                f.write(obj.encode())
            elif path.suffix == ".json":
                f.write(json.dumps(obj, indent=1).encode())
            else:
                torch.save(obj, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def lock_run(run_dir: Path) -> Path:
    """Take <run>/run.lock (holding this process's pid) or refuse: another live process trains this
    run. A lock left by a process that is gone is taken over."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / "run.lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text() or 0)
                if pid <= 0:
                    raise ValueError("no pid")
                os.kill(pid, 0)                       # raises if no such process
            except (ValueError, ProcessLookupError, FileNotFoundError):
                lock.unlink(missing_ok=True)          # stale
                continue
            except PermissionError:                   # alive, owned by another user
                pass
            raise UsageError(f"{run_dir} is in use by process {pid} (remove {lock} if that is wrong)") from None
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return lock
    raise UsageError(f"cannot take {lock}")


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
    diff = config_diff(saved, asdict(cfg), RESUME_KEYS)
    if diff:
        raise UsageError(f"--resume: checkpoint {path} belongs to a different run ({diff})")
    if ckpt["step"] > cfg.steps:
        raise UsageError(f"--resume: checkpoint is at step {ckpt['step']}, beyond --steps {cfg.steps}")
    return ckpt


def config_diff(old: dict, new: dict, keys) -> str:
    """'model.d_model: 32 -> 64; seed: 0 -> 1' for the fields (and model sub-fields) that differ."""
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{k}.{s}: {a.get(s)} -> {b.get(s)}" for s in sorted(set(a) | set(b)) if a.get(s) != b.get(s)]
        elif a != b:
            out.append(f"{k}: {a} -> {b}")
    return "; ".join(out)


class NaNLoss(Exception):
    pass


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class TrainBatches(torch.utils.data.Dataset):
    """Step s's training batch is a pure function of (seed, s): worker processes can make batches
    ahead of the loop in any order, and a resumed run continues the same stream."""

    def __init__(self, cfg: TrainConfig, task: Task, lengths: list[int]):
        self.cfg, self.task, self.lengths = cfg, task, lengths

    def __len__(self):
        return self.cfg.steps

    def __getitem__(self, step: int) -> Batch:
        cfg = self.cfg
        lengths = curriculum_lengths(step, cfg, self.lengths) if cfg.curriculum else self.lengths
        return sample_mixed(self.task, cfg.batch_size, lengths, np.random.default_rng([cfg.seed, 0, step]),
                            **cfg.task_opts)


def batches(cfg: TrainConfig, task: Task, lengths: list[int], start: int, end: int | None = None):
    """The batches of steps start .. end - 1 (default cfg.steps - 1), in order; with cfg.workers > 0 made by that many
    processes, up to 4 batches each ahead of the step. Workers send numpy arrays: one pickled
    message per batch, where torch tensors would each pass a shared-memory file descriptor."""
    loader = torch.utils.data.DataLoader(
        TrainBatches(cfg, task, lengths), batch_size=None, sampler=range(start, end or cfg.steps),
        num_workers=cfg.workers, prefetch_factor=4 if cfg.workers else None, collate_fn=to_numpy,
        generator=torch.Generator())  # its own: the global generator (APE's shifts) stays the model's
    return (Batch(*(None if a is None else torch.from_numpy(a) for a in arrays)) for arrays in loader)


def to_numpy(batch: Batch) -> tuple:
    return tuple(None if t is None else t.numpy() for t in (batch.x, batch.y, batch.length, batch.slot))


class Step:
    """One optimiser step: forward, loss, backward, gradient clip, AdamW; returns the loss on the device.

    With cfg.graphs (CUDA), a batch is right-padded to a multiple of BUCKET tokens; the first batch
    of each padded length runs eagerly (a real step), then that step is captured as a CUDA graph
    which the later batches of the length replay: one launch instead of hundreds for a tiny model.
    Padding changes no result: pads come after every real token (causal models never read them),
    are never supervised, and bidirectional models mask them as keys."""

    BUCKET = 32

    def __init__(self, model, fwd, opt, cfg: TrainConfig, task: Task, device: str, s: float = 1.0):
        self.model, self.fwd, self.opt, self.cfg, self.task, self.device = model, fwd, opt, cfg, task, device
        self.s = s                              # ViPE's compression: 1 in training, the fixed s in fine-tuning
        self.pad = cfg.graphs or cfg.compile    # compiled models: a few shapes, so a few compilations
        self.buffers, self.graphs = {}, {}      # padded length -> static (x, y, slot); -> (graph, loss)

    def body(self, x, y, ctx):
        """x, y: (B, T) on the device -> the loss (0-dim). Padded inputs get their key mask here,
        from x, so that a CUDA graph recomputes it for every batch."""
        if self.pad and not self.task.causal:
            ctx = {**ctx, "key_mask": x != self.task.pad_id}
        with autocast(self.device):
            logits = self.fwd(x, ctx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        return loss.detach()

    def __call__(self, batch: Batch):
        if not self.pad:
            self.opt.zero_grad(set_to_none=True)
            return self.body(batch.x.to(self.device, non_blocking=True), batch.y.to(self.device, non_blocking=True),
                             batch_context(self.task, batch, self.device, self.s))
        T = -(-batch.x.shape[1] // self.BUCKET) * self.BUCKET
        if T not in self.buffers:
            self.buffers[T] = [None if t is None else torch.empty(len(t), T, dtype=torch.long, device=self.device)
                               for t in (batch.x, batch.y, batch.slot)]
        x, y, slot = self.buffers[T]
        for dst, src, pad in zip((x, y, slot), (batch.x, batch.y, batch.slot), (self.task.pad_id, IGNORE, -1)):
            if src is not None:
                dst[:, src.shape[1]:] = pad
                dst[:, :src.shape[1]].copy_(src, non_blocking=True)
        if T in self.graphs:
            graph, loss = self.graphs[T]
            graph.replay()
            return loss.clone()
        ctx = {"s": self.s} if slot is None else {"s": self.s, "slot": slot, "slot_max": int(batch.slot.max())}
        self.opt.zero_grad(set_to_none=True)
        if not self.cfg.graphs:
            return self.body(x, y, ctx)
        side = torch.cuda.Stream()                       # the eager step before a capture runs on a
        side.wait_stream(torch.cuda.current_stream())    # side stream, as torch.cuda.graph asks
        with torch.cuda.stream(side):
            first = self.body(x, y, ctx)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)             # the graph's backward allocates the gradients
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            loss = self.body(x, y, ctx)
        self.graphs[T] = (graph, loss)
        return first


def make_optimizer(model, cfg: TrainConfig, device: str):
    """AdamW: weight decay on matrices only, the method's extra groups (PRISM's alpha) at their own
    ratio to the base learning rate. On CUDA fused, with tensor learning rates a CUDA graph reads."""
    method = METHODS[cfg.method]
    groups = method.param_groups(model, cfg.lr) if method.param_groups else []
    grouped = {id(p) for g in groups for p in g["params"]}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in grouped]
    no_decay = [p for p in model.parameters() if p.dim() < 2 and id(p) not in grouped]
    cuda = device.startswith("cuda")
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}] + groups, lr=cfg.lr,
                            fused=cuda, capturable=cuda)
    for g in opt.param_groups:
        g["lr_scale"] = g.get("lr", cfg.lr) / cfg.lr  # extra groups keep their ratio to the base lr
        if cuda:
            g["lr"] = torch.tensor(float(g["lr"]), device=device)
    return opt


def set_lr(opt, lr: float):
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr * g["lr_scale"])
        else:
            g["lr"] = lr * g["lr_scale"]


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a run between two steps, after it wrote its checkpoint."""


@contextlib.contextmanager
def stop_signals():
    """Within: SIGINT and SIGTERM set flag["stop"] (the loop stops at the next step boundary)
    instead of interrupting wherever Python happens to be (only the main thread gets signals)."""
    flag = {"stop": None}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    old = {s: signal.signal(s, lambda num, frame: flag.update(stop=num)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def check_run_folder(cfg: TrainConfig, resume: bool):
    """A run folder that holds a run with other task or method options is refused (--tag keeps both)."""
    for name in ("metrics.json", CKPT):
        path = cfg.run_dir() / name
        if resume or not path.exists():
            continue
        try:
            saved = json.loads(path.read_text())["config"] if name.endswith(".json") else \
                torch.load(path, map_location="cpu", weights_only=False)["config"]
        except Exception:   # an unreadable old file is overwritten, as before
            continue
        diff = config_diff({"task_opts": saved.get("task_opts"), "opts": saved.get("model", {}).get("opts")},
                           {"task_opts": cfg.task_opts, "opts": cfg.model.opts}, ["task_opts", "opts"])
        if diff:
            raise UsageError(f"{cfg.run_dir()} holds a run with other options ({diff}); give --tag to keep both")
        return


def train(cfg: TrainConfig, resume: bool = False, log=print) -> dict:
    """Train one model, evaluate it, write metrics.json and model.pt; return the metrics. The run's
    folder is locked while it trains."""
    task = validate(cfg)
    check_run_folder(cfg, resume)
    lock = lock_run(cfg.run_dir())
    try:
        with stop_signals() as flag:
            return fit(cfg, task, resume, log, flag)
    finally:
        lock.unlink(missing_ok=True)


def fit(cfg: TrainConfig, task: Task, resume: bool, log, flag: dict) -> dict:
    device = resolve_device(cfg.device)
    cfg.model.vocab_size, cfg.model.causal = len(task.vocab), task.causal
    ckpt = load_checkpoint(cfg) if resume else None
    train_lengths = cfg.train_lengths or task.train_lengths
    test_lengths = cfg.test_lengths or task.test_lengths

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model).to(device)
    opt = make_optimizer(model, cfg, device)
    step, losses, wall = 0, [], 0.0
    history = []    # evaluations during training: {"step", "eval" (test set), "held_out" (other examples)}
    sets = [("eval", 1, test_lengths)] + ([("held_out", 2, cfg.held_out_lengths)] if cfg.held_out_lengths else [])
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        torch.set_rng_state(ckpt["torch_rng"])
        if device.startswith("cuda") and ckpt.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(ckpt["cuda_rng"])
        step, losses, wall, history = ckpt["step"], ckpt["losses"], ckpt["wall"], ckpt.get("history", [])
        log(f"resumed {cfg.run_dir()} at step {step}")
    fwd = torch.compile(model) if cfg.compile else model
    train_step = Step(model, fwd, opt, cfg, task, device)

    n_params = sum(p.numel() for p in model.parameters())
    log(f"{cfg.task} / {cfg.method} / seed {cfg.seed}: {cfg.model.n_layers} layers, {cfg.model.n_heads} heads, "
        f"d={cfg.model.d_model}, {n_params / 1e6:.2f}M params, {cfg.steps} steps x {cfg.batch_size} on {device}"
        + (f", {cfg.workers} data workers" if cfg.workers else "") + (", CUDA graphs" if cfg.graphs else ""))

    def checkpoint():
        save_atomic({"config": asdict(cfg), "model": model.state_dict(), "opt": opt.state_dict(),
                     "torch_rng": torch.get_rng_state(),
                     "cuda_rng": torch.cuda.get_rng_state() if device.startswith("cuda") else None,
                     "step": step, "losses": losses, "wall": wall, "history": history}, cfg.run_dir() / CKPT)

    model.train()
    t0, last_log, log_step = time.time() - wall, time.time(), step
    waited, log_waited = 0.0, 0.0               # seconds spent waiting for data: in all, at the last log
    warm = step + min(50, (cfg.steps - step) // 5)   # steps/s and data wait in the metrics: after these
    mark = (step, time.time(), 0.0)             # steps (compiles, graph captures, workers starting)
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
                kept = (cfg.run_dir() / CKPT).exists()
                raise NaNLoss(f"loss is {v} at step {first + k} (counted as in the progress lines); last finite "
                              f"loss {'none' if last is None else f'{last:.4g}'} ("
                              + (f"the last checkpoint in {cfg.run_dir()} is kept)" if kept else "no checkpoint written)"))
            losses.append([first + k, v])
        pending.clear()

    stream = batches(cfg, task, train_lengths, step)
    while step < cfg.steps:
        if flag["stop"]:
            flush()
            wall = time.time() - t0
            checkpoint()
            raise Interrupted(f"stopped by signal {flag['stop']} after step {step}, checkpoint written: "
                              "continue with the same command and --resume")
        if step == warm:
            flush()
            mark = (step, time.time(), waited)
        tic = time.time()
        batch = next(stream)
        waited += time.time() - tic
        set_lr(opt, lr_at(step, cfg))
        pending.append(train_step(batch))
        step += 1
        if device == "cpu" or len(pending) >= 50:
            flush()
        now = time.time()
        if now - last_log >= cfg.log_every or step == cfg.steps:
            flush()
            rate = (step - log_step) / (now - last_log)
            log(f"  step {step:>6}/{cfg.steps} | loss {losses[-1][1]:.4f} | lr {lr_at(step - 1, cfg):.2e} | "
                f"{rate:6.1f} steps/s | data wait {100 * (waited - log_waited) / (now - last_log):.0f}% | "
                f"eta {fmt_time((cfg.steps - step) / max(rate, 1e-9))}")
            last_log, log_step, log_waited = now, step, waited
        if cfg.eval_every and step % cfg.eval_every == 0:
            history.append({"step": step, **{key: evaluate(model, task, lengths, cfg.n_eval, cfg.seed, device,
                                                           cfg.task_opts, max(train_lengths), s_rule=cfg.s_rule,
                                                           stream=stream_id)
                                             for key, stream_id, lengths in sets}})
            log("  eval: " + summary_line(history[-1]["eval"], max(train_lengths)))
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            flush()   # never checkpoint weights that a NaN step has touched
            wall = time.time() - t0
            checkpoint()
    wall, loop = time.time() - t0, time.time() - mark[1]
    del stream                                   # stops the data workers

    train_max = max(train_lengths)
    ablations = {}                               # ViPE: the other rules for s, before any fine-tuning
    if METHODS[cfg.method].test_time_s:
        ablations = {rule: evaluate(model, task, test_lengths, cfg.n_eval, cfg.seed, device, cfg.task_opts,
                                    train_max, s_rule=rule) for rule in S_RULES if rule != cfg.s_rule}
        if cfg.s_rule == "fixed" and cfg.finetune_steps:
            finetune(model, fwd, opt, cfg, task, train_lengths, device, flag,
                     compression("fixed", train_max, train_max, max(test_lengths)))
            log(f"  fine-tuned {cfg.finetune_steps} steps with s = {max(test_lengths)} / {train_max}")
    rows = evaluate(model, task, test_lengths, cfg.n_eval, cfg.seed, device, cfg.task_opts, train_max,
                    s_rule=cfg.s_rule)
    in_dist = [r["exact"] for r in rows if r["length"] <= train_max and r["variant"] in (None, "ID")]
    metrics = {
        "task": cfg.task, "method": cfg.method, "seed": cfg.seed, "config": asdict(cfg),
        "git": git_hash(), "device": device_name(device), "wall_s": round(wall, 1),
        "steps_per_s": round((step - mark[0]) / max(loop, 1e-9), 2),
        "data_wait": round((waited - mark[2]) / max(loop, 1e-9), 3),
        "n_params": n_params, "train_max_length": train_max,
        "train_exact": float(np.mean(in_dist)) if in_dist else None,
        "eval": rows, "loss": losses[:: max(1, len(losses) // 500)],
    }
    if ablations:
        metrics["eval_ablations"] = ablations
    if history:
        metrics["history"] = history
    out = cfg.run_dir()
    save_atomic(model.state_dict(), out / "model.pt")
    save_atomic(metrics, out / "metrics.json")
    log(results_table(rows, train_max))
    return metrics


def finetune(model, fwd, opt, cfg: TrainConfig, task: Task, lengths, device: str, flag: dict, s: float):
    """ViPE's fine-tuning with compressed distances (the paper's eq. 7): cfg.finetune_steps more
    steps of the same data stream at the final learning rate, every attention call with s."""
    step = Step(model, fwd, opt, cfg, task, device, s=s)
    set_lr(opt, cfg.lr * cfg.min_lr_ratio)
    losses = []
    for k, batch in enumerate(batches(cfg, task, lengths, cfg.steps, cfg.steps + cfg.finetune_steps)):
        if flag["stop"]:
            raise Interrupted(f"stopped by signal {flag['stop']} while fine-tuning: --resume continues from the "
                              f"checkpoint at step {cfg.steps} and fine-tunes again")
        losses.append(step(batch))
    last = torch.stack(losses).tolist()[-1] if losses else 0.0
    if not math.isfinite(last):
        raise NaNLoss(f"loss is {last} at the end of fine-tuning (the checkpoint at step {cfg.steps} is kept)")


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)"


# =============================================================================================
# Reporting one run
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


# =============================================================================================
# CLI
# =============================================================================================

def parse_list(text: str | None, kind=str, flag: str = "") -> list | None:
    """'1-4,8' -> [1, 2, 3, 4, 8]; None stays None (the default); an empty list is an error."""
    if text is None:
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            if kind is int and "-" in part[1:]:
                lo, hi = (int(x) for x in part.split("-"))
                if lo > hi:
                    raise UsageError(f"{flag}: the range {part} runs backwards (write {hi}-{lo})")
                out += list(range(lo, hi + 1))
            elif part:
                out.append(kind(part))
        except ValueError:
            raise UsageError(f"{flag}: cannot read {text!r} as a comma-separated list of {kind.__name__}s "
                             "(ranges like 1-16 allowed)") from None
    if not out:
        raise UsageError(f"{flag}: the list is empty")
    return out


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
    g.add_argument("--method", help=f"one of: {', '.join(METHODS)}")
    g.add_argument("--methods", help="several methods, comma-separated")
    g.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    g.add_argument("--reproduce", metavar="NAME", help="a headline experiment of experiments.py, or all")
    g.add_argument("--help-method", metavar="NAME", help="a method's --method-opt options, then exit")
    g.add_argument("--help-task", metavar="NAME", help="a task's description and --task-opt options, then exit")
    g.add_argument("--force", action="store_true", help="with --reproduce: rerun results already present")
    g.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    g.add_argument("--preset", choices=list(PRESETS), help="default: gpu on CUDA, cpu otherwise")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (CUDA only)")
    g.add_argument("--jobs", type=int, help="runs trained at once, each in its own process (default: "
                   "1 on CPU; on CUDA one per 8 GB of GPU memory, at most 8 and the number of runs)")
    g.add_argument("--workers", type=int, help="processes making training batches per run (default: "
                   "0 on CPU; on CUDA the CPU cores per job less one, 1 to 8)")
    g.add_argument("--no-graphs", action="store_true", help="CUDA: run each step eagerly, not from CUDA graphs")
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
    g.add_argument("--eval-every", type=int, help="also evaluate every N steps on the test set (the history "
                   "feeds the papers' selection rules)")
    g.add_argument("--held-out-lengths", help="with --eval-every: also on other examples of these lengths")
    g.add_argument("--s-rule", choices=S_RULES, help="ViPE's test-time s (default fixed: L_test_max / L_train_max)")
    g.add_argument("--finetune-steps", type=int, help="ViPE: steps fine-tuned with the fixed s before the test")
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
    except Interrupted as e:
        print(f"\n{e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("\ninterrupted; --resume continues from the run's last checkpoint, if it wrote one", file=sys.stderr)
        return 130


def speed(args, device: str, n_runs: int) -> dict:
    """How runs are executed, never what they compute: sets args.jobs and each run's data workers
    and CUDA graphs (see --help)."""
    cuda = device.startswith("cuda")
    if args.jobs is None:
        memory = torch.cuda.get_device_properties(0).total_memory if cuda else 0
        args.jobs = max(1, min(8, n_runs, memory // 2**33)) if cuda else 1
    if args.jobs < 1 or (args.workers or 0) < 0:
        raise UsageError("--jobs must be at least 1 and --workers at least 0")
    workers = default_workers(args.jobs) if cuda else 0
    return {"workers": workers if args.workers is None else args.workers, "graphs": cuda and not args.no_graphs}


def default_workers(jobs: int) -> int:
    """Data workers per run when `jobs` runs share the machine: the CPU cores per run less one, 1 to 8."""
    return max(1, min(8, (os.cpu_count() or 1) // jobs - 1))


def describe(args) -> str:
    """The text of --help-method / --help-task."""
    if args.help_method:
        check_method(args.help_method)
        opts = METHODS[args.help_method].options
        return f"method {args.help_method}: --method-opt KEY=VALUE with KEY one of\n" + \
            "\n".join(f"  {k:16s} {v}" for k, v in opts.items()) if opts else f"method {args.help_method}: no options"
    if args.help_task not in TASKS:
        raise UsageError(f"unknown task {args.help_task!r}; valid tasks: {', '.join(TASKS)}")
    task = TASKS[args.help_task]
    params = inspect.signature(task._sample).parameters
    opts = "\n".join(f"  {k}={params[k].default!r}" for k in task.options()) or "  none"
    return f"{inspect.getdoc(task)}\n\n--task-opt options (defaults):\n{opts}"


def run_cli(args) -> int:
    if args.help_method or args.help_task:
        print(describe(args))
        return 0
    device = resolve_device(args.device)
    preset_name = args.preset or ("gpu" if device.startswith("cuda") else "cpu")
    import experiments   # imports this module: at call time, so that the import runs one way
    if args.reproduce:
        return experiments.reproduce(args, device, preset_name)
    methods = parse_list(args.methods, str, "--methods") or ([args.method] if args.method else None)
    if not methods or not args.task:
        raise UsageError("give --task and --method (or --methods, or --reproduce NAME); see --help")
    for m in methods:
        check_method(m)
    seeds = parse_list(args.seeds, int, "--seeds")
    values = dict(task=args.task, device=args.device, out=args.out, tag=args.tag, d_model=args.d_model,
                  n_layers=args.n_layers, n_heads=args.n_heads, ape_shift=args.ape_shift,
                  tie_weights=args.tie_weights, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                  warmup=args.warmup, weight_decay=args.weight_decay, curriculum=args.curriculum,
                  train_lengths=parse_list(args.train_lengths, int, "--train-lengths"),
                  test_lengths=parse_list(args.test_lengths, int, "--test-lengths"),
                  task_opts=parse_opts(args.task_opt), n_eval=args.n_eval, eval_every=args.eval_every,
                  held_out_lengths=parse_list(args.held_out_lengths, int, "--held-out-lengths"),
                  s_rule=args.s_rule, finetune_steps=args.finetune_steps,
                  compile=args.compile or None, opts=parse_opts(args.method_opt, "--method-opt") or None)
    cfgs = [make_config({**values, **speed(args, device, len(methods) * len(seeds)), "method": m, "seed": s},
                        preset_name) for m in methods for s in seeds]
    for cfg in cfgs:   # every run is checked before the first one starts
        validate(cfg)
    if preset_name == "cpu":
        print("Using the small CPU preset: it shows the mechanics in minutes, not the paper's numbers "
              "(run on a GPU for the paper's setting).")
    experiments.run_many(cfgs, args.jobs, args.resume)
    for cfg in cfgs:
        experiments.summarize(cfg.run_dir().parent)
    plot = experiments.plot_task(Path(args.out) / args.task)
    print(f"wrote {cfgs[0].run_dir().parent}/metrics.json and {plot}")
    return 0


if __name__ == "__main__":   # run the CLI of the module `train`, the one experiments.py imports
    sys.exit(__import__("train").main())
