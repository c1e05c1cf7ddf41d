"""The command line: presets and flags -> configs, the checks of a config before anything is written,
and the --reproduce front (which runs, which are present, their commands). `python train.py ...` is
this module's `main`.

    python train.py --method rope --task flipflop          # one model, table + plot in runs/
    python train.py --methods nope,rope,alibi --task polynomial --seeds 0,1,2 --jobs 3
    python train.py --reproduce vipe-poly                  # a paper's headline experiment
    python train.py --help-method upe                      # a method's --method-opt options

`run(cfg)` is one run with every check: `validate`, then jobs.run_in_folder (a folder in use or holding
other options refused, SIGINT/SIGTERM turned into a checkpoint), then the table. jobs.py also runs many
(`run_many`) and times them (`print_plan`); experiments.py picks an experiment's runs and writes its tables.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import inspect
import json
import math
import os
import shlex
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import torch

import experiments   # experiments.EXPERIMENTS read at call time (tests replace it)
from experiments import Experiment, plot_task, results_table, seeds_suffix, write_summaries
from evaluation import stored
from tasks import TASKS, Task, curriculum_lengths
from model import ModelConfig, batch_context
from train import METHODS, Interrupted, NaNLoss, TrainConfig
from jobs import (RUN_KEYS, RunsFailed, UsageError, check_failures, check_resume, check_run_folder, other_setup,
                  print_plan, run_in_folder, run_many, speed)


# =============================================================================================
# Configs: a preset, overridden by flags
# =============================================================================================

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
        "flipflop": dict(d_model=64, n_layers=1, n_heads=2, steps=1600, batch_size=16, lr=3e-3, n_eval=128),
        "mqrar": dict(d_model=64, n_layers=2, n_heads=2, steps=300, batch_size=16, lr=2e-3, n_eval=32),
    },
}


def preset(name: str, task: str) -> dict:
    p = PRESETS[name]
    return {**p["default"], **p.get(task, {})}


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


def experiment_configs(exp: Experiment, device: str, out: str, preset_name: str, how=None) -> list[TrainConfig]:
    """The configs of every run and seed; `how`: settings of execution (workers, graphs) for all."""
    return [make_config({**run, **(how or {}), "seed": seed, "device": device, "out": out}, preset_name)
            for run in exp.runs for seed in exp.seeds]


# =============================================================================================
# Checks before a run, and one run checked
# =============================================================================================

def validate(cfg: TrainConfig, planning: bool = False) -> Task:
    """Check everything a run needs before anything is written; raise UsageError if not. `planning`
    (--plan): the device need not be on this machine."""
    check_method(cfg.method)
    if cfg.task not in TASKS:
        raise UsageError(f"unknown task {cfg.task!r}; valid tasks: {', '.join(TASKS)}")
    task = TASKS[cfg.task]
    device = resolve_device(cfg.device, present=not planning)
    if cfg.compile and not device.startswith("cuda"):
        raise UsageError("--compile needs a CUDA GPU; drop it on CPU")
    if cfg.graphs and not device.startswith("cuda"):
        raise UsageError("CUDA graphs need a CUDA GPU")
    if cfg.tf32 and not device.startswith("cuda"):
        raise UsageError("--tf32 is for CUDA GPUs (the CPU multiplies in float32); drop it on CPU")
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
    if cfg.curriculum_steps and not cfg.curriculum:
        raise UsageError("--curriculum-steps sets the schedule of --curriculum: give both")
    if cfg.train_set and cfg.curriculum:
        raise UsageError("--train-set and --curriculum do not go together (a fixed set has fixed lengths)")
    check_paths(cfg)
    check_writable(Path(cfg.out))
    options = METHODS[cfg.method].options
    unknown = sorted(set(cfg.model.opts) - set(options))
    if unknown:
        valid = ", ".join(options) or "none"
        raise UsageError(f"method {cfg.method!r} has no option {unknown[0]!r} (--method-opt); its options: {valid} "
                         f"(--help-method {cfg.method})")
    try:   # each option as its kind: "false" is False, 2.7 is no int (the run records the parsed values)
        cfg.model.opts = {k: options[k].parse(k, v) for k, v in cfg.model.opts.items()}
    except ValueError as e:
        raise UsageError(f"--method-opt {e}") from None
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
        model_cfg = dataclasses.replace(cfg.model, causal=task.causal, vocab_size=len(task.vocab))
        if METHODS[cfg.method].hooks:
            METHODS[cfg.method].hooks(model_cfg)
        layer = METHODS[cfg.method].attention(model_cfg)
        for batch in samples if hasattr(layer, "check_context") else []:   # UPE: slots; PRISM: bins
            layer.check_context({**batch_context(task, batch, "cpu"), "tokens": batch.x})
    except (ValueError, TypeError) as e:
        raise UsageError(f"method {cfg.method!r}: {e}") from None
    return task


def resolve_device(name: str, present: bool = True) -> str:
    """The device a run asks for; `present`: it must be on this machine (not so for --plan, which only
    lists the runs and their times, e.g. a GPU experiment planned on a laptop)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and present and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA GPU is available (use --device cpu)")
    if name != "cpu" and not name.startswith("cuda"):
        raise UsageError(f"unknown device {name!r} (use auto, cpu or cuda)")
    return name


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


SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_paths(cfg: TrainConfig):
    """--out names a folder; --tag is one path component of safe characters, so that a run's folder
    lies where the figures and tables look for it (runs/<task>/<method>-<tag>/seed<S>)."""
    if not str(cfg.out).strip():
        raise UsageError("--out is empty; give a folder (default runs)")
    if cfg.tag and (set(cfg.tag) - SAFE or cfg.tag.startswith(".")):
        raise UsageError(f"--tag {cfg.tag!r}: use letters, digits, '.', '_' and '-' only, not starting with '.'")


def numeric_checks(cfg: TrainConfig):
    """(flag, value, within range, the range in words) for every number a run reads; every float is
    also finite (inf and nan compare false, so each range below excludes them)."""
    m = cfg.model
    return [("--seeds", cfg.seed, 0 <= cfg.seed < 2 ** 32, "between 0 and 2^32 - 1"),
            ("--steps", cfg.steps, cfg.steps >= 1, ">= 1"),
            ("--batch-size", cfg.batch_size, cfg.batch_size >= 1, ">= 1"),
            ("--lr", cfg.lr, 0 < cfg.lr < math.inf, "> 0 and finite"),
            ("--warmup", cfg.warmup, cfg.warmup >= 0, ">= 0"),
            ("--weight-decay", cfg.weight_decay, 0 <= cfg.weight_decay < math.inf, ">= 0 and finite"),
            ("--beta2", cfg.beta2, 0 <= cfg.beta2 < 1, "in [0, 1)"),
            ("--adam-eps", cfg.adam_eps, 0 < cfg.adam_eps < math.inf, "> 0 and finite"),
            ("--precision", cfg.precision, cfg.precision in ("bf16", "fp32"), "bf16 or fp32"),
            ("--dropout", m.dropout, 0 <= m.dropout < 1, "in [0, 1)"),
            ("--min-lr-ratio", cfg.min_lr_ratio, 0 <= cfg.min_lr_ratio <= 1, "in [0, 1]"),
            ("grad_clip", cfg.grad_clip, 0 < cfg.grad_clip < math.inf, "> 0 and finite"),
            ("--n-eval", cfg.n_eval, cfg.n_eval >= 1, ">= 1"),
            ("--eval-every", cfg.eval_every, cfg.eval_every >= 0, ">= 0"),
            ("--n-eval-during", cfg.n_eval_during, cfg.n_eval_during >= 0, ">= 0"),
            ("--eval-from-loss", cfg.eval_from_loss, 0 <= cfg.eval_from_loss < math.inf, ">= 0 and finite"),
            ("--curriculum-steps", cfg.curriculum_steps, cfg.curriculum_steps >= 0, ">= 0"),
            ("--train-set", cfg.train_set, cfg.train_set == 0 or cfg.train_set >= cfg.batch_size,
             "0 or at least the batch size"),
            ("--workers", cfg.workers, cfg.workers >= 0, ">= 0"), ("ckpt_every", cfg.ckpt_every, cfg.ckpt_every >= 1, ">= 1"),
            ("--bucket", cfg.bucket, cfg.bucket >= 1, ">= 1"),
            ("--norm", m.norm, m.norm in ("pre", "post"), "pre or post"),
            ("--d-model", m.d_model, m.d_model >= 1, ">= 1"), ("--n-layers", m.n_layers, m.n_layers >= 1, ">= 1"),
            ("--n-heads", m.n_heads, m.n_heads >= 1, ">= 1"), ("--ape-shift", m.ape_shift, m.ape_shift >= 0, ">= 0")]


def check_method(method: str):
    if method not in METHODS:
        raise UsageError(f"unknown method {method!r}; available methods: {', '.join(METHODS)}")


def run(cfg: TrainConfig, resume: bool | str = False, log=print, force: bool = False) -> dict:
    """Check the config (validate) and train it in its folder (jobs.run_in_folder: the folder's options and
    lock, SIGINT or SIGTERM -> a checkpoint); log the table of results and return the metrics. resume: True,
    False, or "auto" (continue from the run's checkpoint where it has one: --reproduce)."""
    validate(cfg)
    metrics = run_in_folder(cfg, resume, log, force)
    log(results_table(metrics["eval"], metrics["train_max_length"]))
    return metrics


# A run's setup on the command line: each field's flag is its name with dashes, apart from these three.
SETUP_KEYS = [k for k in RUN_KEYS if k != "model"] + [f.name for f in dataclasses.fields(ModelConfig)
                                                      if f.name != "method"]
FLAG_OF = {"seed": "--seeds", "task_opts": "--task-opt", "opts": "--method-opt"}


def flag_of(key: str) -> str:
    return FLAG_OF.get(key, "--" + key.replace("_", "-"))


def setup_flags_given(args) -> list[str]:
    """The flags on the command line that set what a run computes (the seed apart)."""
    keys = [k for k in SETUP_KEYS if k != "seed"] + ["methods"]
    return [flag_of(k) for k in keys if vars(args).get(flag_of(k)[2:].replace("-", "_")) not in (None, False, "", [])]


def command_of(cfg: TrainConfig, extra: list[str] | None = None) -> str:
    """The train.py command that trains the run `cfg` as it is: its task, method and preset, then each setting
    that differs from the preset's; `extra`: options of how it runs (--compile, --out ...)."""
    base = make_config({"task": cfg.task, "method": cfg.method}, cfg.preset)
    known = build_parser()._option_string_actions
    words = ["python", "train.py", "--task", cfg.task, "--method", cfg.method, "--preset", cfg.preset]
    for key in SETUP_KEYS:
        value, default = ((getattr(cfg, key), getattr(base, key)) if hasattr(cfg, key)
                          else (getattr(cfg.model, key), getattr(base.model, key)))
        flag = flag_of(key)
        if key in ("task", "method") or value == default:
            continue
        if flag not in known or value is False:
            raise UsageError(f"{cfg.run_dir()}: {key}={value!r} has no command-line option")
        if value is True:
            words.append(flag)
        elif isinstance(value, dict):
            for k, v in value.items():
                words += [flag, f"{k}={opt_text(v)}"]
        elif isinstance(value, list):
            words += [flag, ranges(value)]
        else:
            words += [flag, repr(value) if isinstance(value, float) else str(value)]
    return " ".join(shlex.quote(w) for w in words + (extra or []))


def opt_text(value) -> str:
    """A --method-opt / --task-opt value as parse_opts reads it back: JSON, a plain string as it is."""
    if isinstance(value, str):
        try:
            json.loads(value)          # a string that reads as JSON ("1", "true") keeps its quotes
        except json.JSONDecodeError:
            return value
    return json.dumps(value, separators=(",", ":"))


def ranges(values: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3,5', as parse_list reads it back."""
    parts, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(f"{values[i]}-{values[j]}" if j > i else str(values[i]))
        i = j + 1
    return ",".join(parts)


# =============================================================================================
# The command line
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
        if k in opts:
            raise UsageError(f"{flag} sets {k} twice")
        try:
            opts[k] = json.loads(v)
        except json.JSONDecodeError:
            opts[k] = v
    return opts


ABOUT = """Train a small Transformer with one position encoding on one task, evaluate it at every
test length (past the training lengths too), print a table of accuracy by length, and write
runs/<task>/<method>[-<tag>]/seed<S>/metrics.json with runs/<task>/extrapolation.png, a plot of
every method run on that task so far. On a GPU the defaults follow each paper's model (preset
gpu); on a CPU a small preset shows the mechanics in minutes."""


def epilog() -> str:
    """Examples, the experiments, and the presets the defaults come from (read from the code)."""
    def values(d):
        return ", ".join(f"{k}={v}" for k, v in d.items())
    lines = ["examples:",
             "  python train.py --method path --task flipflop                 one run",
             "  python train.py --methods nope,rope,vipe --task parity --seeds 0,1,2 --jobs 3",
             "  python train.py --method rope --task copy --steps 5000 --tag long --resume   after Ctrl-C",
             "  python train.py --reproduce path-flipflop                     a paper's headline experiment",
             "  python train.py --reproduce vipe-parity --budget full --shard 0/4   the paper's setup, a quarter",
             "  python train.py --reproduce prism-more --budget full --runs 3 --commands   run 3's command, to change",
             "  python train.py --help-method prism                           a method's --method-opt options",
             "", "experiments (--reproduce NAME, or all):",
             *textwrap.wrap(", ".join(experiments.EXPERIMENTS), 96, initial_indent="  ", subsequent_indent="  "),
             "", "presets (a flag overrides them; the other defaults: train.TrainConfig):"]
    for name, tasks in PRESETS.items():
        lines.append(f"  {name}: {values(tasks['default'])}")
        lines += [f"    {task}: {values(d)}" for task, d in tasks.items() if task != "default"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=ABOUT, epilog=epilog(), allow_abbrev=False,   # --step is no --steps
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to run")
    g.add_argument("--task", help=f"one of: {', '.join(TASKS)}")
    g.add_argument("--method", help=f"one of: {', '.join(METHODS)}")
    g.add_argument("--methods", help="several methods, comma-separated")
    g.add_argument("--seeds", help="comma-separated seeds, ranges allowed (default 0); with --reproduce: the "
                   "experiment on these seeds, its own or any others (its table, reproduce/NAME-seedsS.md, then "
                   "stands on them and says which are not the experiment's)")
    g.add_argument("--labels", metavar="RUN,...", help="with --reproduce: only these of the experiment's runs, by "
                   "folder name (e.g. vipe-L3,nope-L3; task/name for one task's); its table and verdict stand on them")
    g.add_argument("--reproduce", metavar="NAME", help="a headline experiment of experiments.py, or all")
    g.add_argument("--budget", choices=experiments.BUDGETS, help="with --reproduce: quick (default; minutes, "
                   "the papers' ordering) or full (the paper's own setup, where experiments.py defines it)")
    g.add_argument("--plan", action="store_true", help="with --reproduce: print its runs, which are present and "
                   "the time of the others, then stop (--device cuda: also on a machine without a GPU)")
    g.add_argument("--shard", metavar="I/N", help="with --reproduce: train only runs I, I+N, I+2N, ... of its "
                   "fixed run list (e.g. one Slurm array task each); tables once every run is present")
    g.add_argument("--runs", metavar="K,...", help="with --reproduce: only these of its runs (--plan numbers them)")
    g.add_argument("--commands", action="store_true", help="with --reproduce: print the train.py command of each of "
                   "its runs (--runs, --shard), to change and run by hand (an ablation: a value, a --tag); then stop")
    g.add_argument("--partial", action="store_true", help="with --reproduce: train nothing, table the runs present "
                   "(each over its seeds; the plan lists the missing; one of another setup: its table kept, exit 1)")
    g.add_argument("--help-method", metavar="NAME", help="a method's --method-opt options, then exit")
    g.add_argument("--help-task", metavar="NAME", help="a task's description and --task-opt options, then exit")
    g.add_argument("--force", action="store_true", help="with --reproduce: rerun results already present; "
                   "otherwise: overwrite a finished run that had other options")
    g.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    g.add_argument("--preset", choices=list(PRESETS), help="default: gpu on CUDA, cpu otherwise")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (CUDA only)")
    g.add_argument("--tf32", action="store_true", help="CUDA: TF32 float32 matrix products (PRISM's position scores)")
    g.add_argument("--bucket", type=int, help="CUDA: pad each batch to a multiple of this many tokens (default 32; "
                   "less padding, more shapes to capture and compile)")
    g.add_argument("--jobs", type=int, help="runs trained at once, each in its own process (default: "
                   "1 on CPU; on CUDA one per 8 GB of free GPU memory, at most 8, per visible GPU, and the number of "
                   "runs); with several GPUs the jobs spread evenly over them")
    g.add_argument("--workers", type=int, help="processes making training batches per run (default: "
                   "0 on CPU; on CUDA the CPU cores per job less one, 1 to 8)")
    g.add_argument("--no-graphs", action="store_true", help="CUDA: run each step eagerly, not from CUDA graphs")
    g.add_argument("--no-mps", action="store_true", help="CUDA: do not start an MPS daemon for jobs that share a "
                   "GPU (by default one runs for the command's duration, where the machine allows)")
    g.add_argument("--out", default="runs", help="output root (default runs/)")
    g.add_argument("--tag", default="", help="suffix of the run name: runs/<task>/<method>-<tag>")
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int)
    g.add_argument("--n-layers", type=int)
    g.add_argument("--n-heads", type=int)
    g.add_argument("--ape-shift", type=int, help="APE: random position offset in [0, N] during training")
    g.add_argument("--tie-weights", action="store_true", default=None)
    g.add_argument("--norm", choices=("pre", "post"), help="pre-norm blocks (default) or post-norm, as in BERT")
    g.add_argument("--dropout", type=float, help="on the embeddings and each residual branch (default 0)")
    g.add_argument("--method-opt", action="append", metavar="KEY=VALUE",
                   help="method option (ModelConfig.opts), e.g. vipe_mode=value; combine with --tag")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--warmup", type=int)
    g.add_argument("--min-lr-ratio", type=float, help="the learning rate at the end of the cosine decay, as a "
                   "fraction of the peak (default 0.1; 1: constant after the warm-up)")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--beta2", type=float, help="AdamW's second-moment decay (default 0.999)")
    g.add_argument("--adam-eps", type=float, help="AdamW's epsilon (default 1e-6)")
    g.add_argument("--precision", choices=("bf16", "fp32"), help="CUDA: bf16 autocast (default) or float32 "
                   "throughout; the CPU always runs float32")
    g.add_argument("--curriculum", action="store_true", default=None, help="grow the training length (PRISM)")
    g.add_argument("--curriculum-steps", type=int, metavar="N", help="with --curriculum, the PRISM paper's schedule: "
                   "length 5 for N steps, 10 for N, then 10 more every 2N (the paper: 5000); default: the stages "
                   "spread over the first half of the steps")
    g.add_argument("--train-set", type=int, help="train on a fixed set of N problems, a new order each epoch "
                   "(the ViPE paper: 32768); default: fresh problems every step")
    g = p.add_argument_group("data and evaluation")
    g.add_argument("--train-lengths", help="e.g. 1-16 or 5,10,20")
    g.add_argument("--test-lengths", help="e.g. 1-48")
    g.add_argument("--task-opt", action="append", metavar="KEY=VALUE", help="task option, e.g. n_back=2")
    g.add_argument("--n-eval", type=int, help="evaluation examples per length")
    g.add_argument("--eval-every", type=int, help="also evaluate every N steps on the test set (the history "
                   "feeds the papers' selection rules)")
    g.add_argument("--n-eval-during", type=int, help="with --eval-every: examples per length in those "
                   "evaluations (default: --n-eval's)")
    g.add_argument("--eval-from-loss", type=float, help="with --eval-every: start those evaluations once the "
                   "mean training loss of the last N steps is below this (PRISM's paper: 0.1)")
    g.add_argument("--held-out-lengths", help="with --eval-every: also on other examples of these lengths")
    return p


def main(argv=None) -> int:
    faulthandler.enable(sys.__stderr__)   # a crash in C code (a segfault, an abort) prints where Python was
    args = build_parser().parse_args(argv)
    try:
        return run_cli(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:   # the reader of the output stopped (| head): nothing of the command's failed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:   # a folder that cannot be written, a full disk: save_atomic left no half file
        print(f"error: cannot write the results: {e}", file=sys.stderr)
        return 2
    except (NaNLoss, RunsFailed) as e:
        print(f"error: {'training stopped: ' if isinstance(e, NaNLoss) else ''}{e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"\n{e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("\ninterrupted; --resume continues from the run's last checkpoint, if it wrote one", file=sys.stderr)
        return 130


def describe(args) -> str:
    """The text of --help-method / --help-task."""
    if args.help_method:
        check_method(args.help_method)
        opts = METHODS[args.help_method].options
        return f"method {args.help_method}: --method-opt KEY=VALUE with KEY one of\n" + \
            "\n".join(f"  {k:22s} {v.describe()}: {v.help}" for k, v in opts.items()) if opts \
            else f"method {args.help_method}: no options"
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
    if (args.jobs is not None and args.jobs < 1) or (args.workers or 0) < 0:
        raise UsageError("--jobs must be at least 1 and --workers at least 0")
    device = resolve_device(args.device, present=not (args.reproduce and (args.plan or args.commands)))
    preset_name = args.preset or ("gpu" if device.startswith("cuda") else "cpu")
    if args.reproduce:
        return reproduce(args, device, preset_name)
    given = [f"--{k}" for k in ("shard", "runs", "budget", "plan", "labels", "partial", "commands") if vars(args)[k]]
    if given:
        raise UsageError(f"{given[0]} applies with --reproduce NAME only")
    return run_commandline_runs(args, configs_of(args, device, preset_name), preset_name)


def configs_of(args, device: str, preset_name: str) -> list[TrainConfig]:
    """The runs of a command without --reproduce: one per method and seed."""
    if args.methods and args.method:
        raise UsageError("give --method or --methods, not both")
    methods = parse_list(args.methods, str, "--methods") or ([args.method] if args.method else None)
    if not methods or not args.task:
        raise UsageError("give --task and --method (or --methods, or --reproduce NAME); see --help")
    for m in methods:
        check_method(m)
    seeds = parse_list("0" if args.seeds is None else args.seeds, int, "--seeds")
    for flag, items in (("--methods", methods), ("--seeds", seeds)):
        if len(set(items)) < len(items):
            raise UsageError(f"{flag} names {sorted(x for x in set(items) if items.count(x) > 1)[0]} twice")
    check_applies(args, methods)
    values = dict(task=args.task, device=args.device, out=args.out, tag=args.tag, d_model=args.d_model,
                  n_layers=args.n_layers, n_heads=args.n_heads, ape_shift=args.ape_shift, norm=args.norm,
                  tie_weights=args.tie_weights, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                  warmup=args.warmup, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
                  beta2=args.beta2, dropout=args.dropout, adam_eps=args.adam_eps, precision=args.precision,
                  curriculum=args.curriculum, curriculum_steps=args.curriculum_steps, train_set=args.train_set,
                  train_lengths=parse_list(args.train_lengths, int, "--train-lengths"),
                  test_lengths=parse_list(args.test_lengths, int, "--test-lengths"),
                  task_opts=parse_opts(args.task_opt), n_eval=args.n_eval, eval_every=args.eval_every,
                  eval_from_loss=args.eval_from_loss, n_eval_during=args.n_eval_during,
                  held_out_lengths=parse_list(args.held_out_lengths, int, "--held-out-lengths"),
                  opts=parse_opts(args.method_opt, "--method-opt") or None)
    return [make_config({**values, **speed(args, device, len(methods) * len(seeds)), "method": m, "seed": s},
                        preset_name) for m in methods for s in seeds]


def run_commandline_runs(args, cfgs: list[TrainConfig], preset_name: str) -> int:
    """Train the runs of a command without --reproduce, each checked before the first one starts."""
    for cfg in cfgs:
        validate(cfg)
        if args.resume:
            check_resume(cfg)
        check_run_folder(cfg, args.resume, args.force)
    if preset_name == "cpu":
        print("Using the small CPU preset: it shows the mechanics in minutes, not the paper's numbers "
              "(run on a GPU for the paper's setting).")
    if len(cfgs) == 1:
        run(cfgs[0], resume=args.resume, force=args.force)   # one run: its own error, e.g. a NaN loss, as it is
        failed = []
    else:
        failed = run_many(cfgs, run, args.jobs, args.resume, args.force, mps=not args.no_mps)
    write_summaries(cfgs)
    plot = plot_task(Path(args.out) / args.task)
    print(f"wrote {cfgs[0].run_dir().parent}/metrics.json and {plot}")
    check_failures(failed, len(cfgs))
    return 0


def check_applies(args, methods: list[str]):
    """Options given on the command line that mean nothing for these methods or this task."""
    not_ape = [m for m in methods if m != "ape"]
    if args.ape_shift is not None and not_ape:
        raise UsageError(f"--ape-shift applies to APE (--method ape) only, not to {', '.join(not_ape)}")
    for flag, value in (("--held-out-lengths", args.held_out_lengths), ("--eval-from-loss", args.eval_from_loss),
                        ("--n-eval-during", args.n_eval_during)):
        if value and not args.eval_every:
            raise UsageError(f"{flag} applies with --eval-every N only (the evaluations during training)")
    if args.curriculum and args.task in TASKS:
        lengths = parse_list(args.train_lengths, int, "--train-lengths") or TASKS[args.task].train_lengths
        if len({tuple(curriculum_lengths(step, 100, lengths)) for step in range(100)}) < 2:
            raise UsageError(f"--curriculum grows the training length from 5 up to the longest; the training "
                             f"lengths of {args.task} ({min(lengths)}-{max(lengths)}) leave nothing to grow")


def reproduce(args, device: str, preset_name: str) -> int:
    """--reproduce NAME | all: train the runs not present yet, then the tables and figures of each experiment."""
    budget = args.budget or "quick"
    setup = setup_flags_given(args)
    if setup:
        raise UsageError(f"{setup[0]} is part of a run's setup, and --reproduce trains each run as its experiment "
                         "sets it: drop it (to train one of its runs with another value: --commands prints each "
                         "run's train.py command, to change and run with a --tag of its own)")
    EXPERIMENTS = experiments.chosen(args.reproduce, budget, parse_list(args.seeds, int, "--seeds"),
                                     parse_list(args.labels, str, "--labels"))
    suffix = ("" if budget == "quick" else f"-{budget}") + seeds_suffix(args.seeds)
    if args.partial and (args.shard or args.runs or args.force or args.plan or args.commands):
        raise UsageError("--partial trains nothing and builds the tables: give it without --shard, --runs, --force, "
                         "--plan and --commands")
    if args.commands and args.plan:
        raise UsageError("--plan and --commands each print the runs and stop: give one of them")
    shard, n_shards = parse_shard(args.shard)
    n_runs = sum(len(e.runs) * len(e.seeds) for e in EXPERIMENTS.values())
    picked = parse_runs(args.runs, n_runs, args.shard)
    how = speed(args, device, len(picked) if picked else -(-n_runs // n_shards))
    plans = {name: experiment_configs(exp, args.device, args.out, preset_name, how)
             for name, exp in EXPERIMENTS.items()}
    for cfgs in plans.values():
        for cfg in cfgs:
            validate(cfg, planning=args.plan or args.commands)
    if preset_name == "cpu":
        print("Using the small CPU preset: the table will not show the paper's numbers.")
    everything = [cfg for cfgs in plans.values() for cfg in cfgs]       # the fixed run list, numbered from 0
    mine = {id(cfg) for k, cfg in enumerate(everything)
            if not args.partial and (k in picked if picked else k % n_shards == shard)}
    present = {id(cfg) for cfg in everything if stored(cfg.run_dir() / "metrics.json")}
    todo = {id(cfg) for cfg in everything if id(cfg) in mine and (args.force or id(cfg) not in present)}
    # which part of the list this command takes, as the plan's first line says it; the state of a run outside it
    scope, outside = ((f", shard {args.shard}: {len(mine)} of them", "other shard") if args.shard
                      else (f", --runs {args.runs}: {len(mine)} of them", "not picked") if args.runs
                      else (f", {len(present)} present (--partial trains nothing)", "missing") if args.partial
                      else ("", "not picked"))
    if args.commands:
        extra = [flag for flag, on in (("--compile", args.compile), ("--tf32", args.tf32)) if on]
        extra += ["--bucket", str(args.bucket)] if args.bucket else []
        extra += [word for flag, value, default in (("--device", args.device, "auto"), ("--out", args.out, "runs"))
                  if value != default for word in (flag, value)]
        for k, cfg in enumerate(everything):
            if id(cfg) in mine:
                print(f"# run {k}: {cfg.run_dir()}\n{command_of(cfg, extra)}")
        return 0
    presets = {preset_name: everything}                  # the run list under each preset a present run was made with

    def like(k, name):
        if name not in presets:
            presets[name] = [cfg for exp in EXPERIMENTS.values()
                             for cfg in experiment_configs(exp, args.device, args.out, name, how)]
        return presets[name][k]
    other = {k: v for k, v in other_setup(everything, like, present).items()
             if k not in todo}                            # --force retrains todo's
    times = print_plan(everything, todo, present, args.jobs, other, scope, outside)
    again = [k for k, cfg in enumerate(everything) if picked and id(cfg) in mine and id(cfg) not in todo]
    if again:                                             # asked for by number, yet not trained: say so
        print(f"--runs: run(s) {', '.join(map(str, again))} present already, not trained again (--force reruns them)")
    if args.plan:
        return 0
    if other and not args.partial:                        # --partial: tables the experiments free of them
        first = next(cfg for cfg in everything if id(cfg) in other)
        raise UsageError(f"{len(other)} run(s) present were made with other options than the setup now (the plan "
                         f"says which; {first.run_dir()}: {other[id(first)]}), so a table would take them for the "
                         "new setup: --force reruns them (with --runs or --shard picking them), or move them aside")
    # one queue for the runs of every experiment, so that a job (a GPU) done with one experiment's runs takes
    # the next one's; the longest first (those of unknown time before them), so that the last to end are short
    queue = sorted((cfg for cfg in everything if id(cfg) in todo),
                   key=lambda cfg: -math.inf if times[id(cfg)] is None else -times[id(cfg)])
    failed = run_many(queue, run, args.jobs, resume=not args.force and "auto", force=args.force, mps=not args.no_mps)
    experiments.write_tables(EXPERIMENTS, plans, Path(args.out), mine, args.partial, suffix,
                             budget if args.reproduce == "all" else None, other)
    check_failures(failed, len(todo))
    return 1 if other else 0


def parse_shard(text: str | None) -> tuple[int, int]:
    """--shard I/N -> (I, N); none given: (0, 1), every run."""
    if text is None:
        return 0, 1
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise UsageError(f"--shard takes I/N with 0 <= I < N (e.g. 0/8), got {text!r}")
    return int(i), int(n)


def parse_runs(text: str | None, n_runs: int, shard: str | None) -> set[int]:
    """--runs K,... -> the run numbers (0 <= K < n_runs); none given: the empty set (every run, or the shard's)."""
    if text is None:
        return set()
    if shard:
        raise UsageError("give --shard or --runs, not both")
    picked = parse_list(text, int, "--runs")
    bad = [k for k in picked if not 0 <= k < n_runs]
    if bad or len(set(picked)) < len(picked):
        raise UsageError(f"--runs takes distinct run numbers from 0 to {n_runs - 1} (as --plan prints them), "
                         f"got {text!r}")
    return set(picked)


if __name__ == "__main__":
    sys.exit(main())
