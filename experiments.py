"""What runs show: the table of one run, summaries over seeds, the extrapolation figure per task,
the papers' selection rules, and the headline experiments of the four papers with their "paper vs
this repo" tables.

    python train.py --reproduce path-flipflop     # cli.reproduce runs EXPERIMENTS["path-flipflop"]
    python train.py --reproduce all               # every experiment, and runs/reproduce/all.md

An `Experiment` records the paper's setting, what was scaled down to fit minutes, the paper's
numbers and the columns of its table. `cli.reproduce` trains every run that is not present yet,
then the functions here summarise each method over its seeds, redraw the task figures and write
runs/reproduce/<name>.md (and <name>.png for a sweep over layers or n-back): the paper's numbers,
the mean [90 % bootstrap interval] (min-max) over seeds at the last checkpoint, the paper's own
selection rule where it has one, and the verdict.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tasks import TASKS
from evaluation import glob_stored, read_metrics, read_stored, save_atomic, stored
from jobs import UsageError
from vipe import S_TEXT, ablation_label


# =============================================================================================
# Tables and figures of runs
# =============================================================================================

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
        s = sorted({r.get("s", 1.0) for r in sel})
        if s != [1.0]:         # ViPE's test-time s beyond the training lengths
            mark += (" " if mark else "") + "s = " + "-".join(dict.fromkeys(f"{x:g}" for x in (s[0], s[-1])))
        lines.append(f"| {label} | {np.mean([r['exact'] for r in sel]):.3f} | "
                     f"{np.mean([r['token'] for r in sel]):.3f} | {mark} |")
    return "\n".join(lines)


# =============================================================================================
# Summaries over seeds and the figure of a task
# =============================================================================================

def seed_metrics(method_dir: Path, only: list[int] | None = None,
                 keys=("seed", "eval", "train_max_length")) -> list[dict]:
    """The metrics of each seed's run in method_dir/seed*/ that are readable and hold `keys`, in seed
    folder order; those of the seeds in `only` alone, if given (an experiment's seeds, or --seeds)."""
    return [m for p in glob_stored(method_dir, "seed*/metrics.json")
            if (m := read_metrics(p, keys)) and (only is None or m["seed"] in only)]


def ablations(m: dict) -> dict:
    """A run's "eval_ablations" by name; older ViPE metrics key them by the rule ("per_length", "one")."""
    return {ablation_label(k) if k in S_TEXT else k: rows for k, rows in m.get("eval_ablations", {}).items()}


def summarize(method_dir: Path, only: list[int] | None = None) -> dict | None:
    """Combine every seed's metrics in runs/<task>/<method>/seed*/ (those of the seeds in `only`, if
    given) into the summary that cli.py writes to <method>/metrics.json (None without any): per
    evaluation point the mean, min and max over seeds, and the best seed (highest mean accuracy beyond
    the training length among seeds whose in-distribution accuracy exceeds 0.85)."""
    seeds = seed_metrics(method_dir, only, ("task", "method", "seed", "eval", "train_max_length", "device", "wall_s"))
    if not seeds:
        return None
    train_max = seeds[0]["train_max_length"]
    best = best_seed(seeds)
    summary = {"task": seeds[0]["task"], "method": seeds[0]["method"], "label": method_dir.name,
               "seeds": [m["seed"] for m in seeds], "train_max_length": train_max,
               "device": ", ".join(dict.fromkeys(m["device"] for m in seeds)), "wall_s": [m["wall_s"] for m in seeds],
               "eval": over_seeds([m["eval"] for m in seeds]), "best_seed": best["seed"], "best_eval": best["eval"]}
    named = [ablations(m) for m in seeds]
    if named[0] and all(set(a) == set(named[0]) for a in named):
        summary["ablations"] = {rule: over_seeds([a[rule] for a in named]) for rule in named[0]}
    return summary


def over_seeds(evals: list[list[dict]]) -> list[dict]:
    """Per evaluation point of the seeds' rows: mean, min and max of exact and token accuracy."""
    points = []
    for i, r in enumerate(evals[0]):
        ex = [rows[i]["exact"] for rows in evals if len(rows) > i]
        tok = [rows[i]["token"] for rows in evals if len(rows) > i]
        points.append({"name": r["name"], "length": r["length"], "variant": r["variant"], "n": r.get("n"),
                       "exact": float(np.mean(ex)), "exact_min": min(ex), "exact_max": max(ex),
                       "token": float(np.mean(tok)), "token_min": min(tok), "token_max": max(tok)})
    return points


# =============================================================================================
# The papers' selection rules, each from one seed's metrics (with --eval-every: its history)
# =============================================================================================

MIN_TRAIN = 0.85   # ViPE's bar: the paper keeps seeds whose training accuracy exceeds it


def fits(m: dict) -> bool:
    """Whether a seed passes ViPE's bar: in-distribution exact match above MIN_TRAIN (the paper:
    "exceeds")."""
    return (m["train_exact"] or 0) > MIN_TRAIN


def best_seed(seeds: list[dict]) -> dict:
    """ViPE's rule: among seeds that fit (above), the one with the best mean exact match beyond the
    training length; among all seeds when none fits. It selects on the test lengths, as the paper does."""
    def beyond(m):
        top = m["train_max_length"]
        rs = [r["exact"] for r in m["eval"] if r["length"] > top] or [r["exact"] for r in m["eval"]]
        return float(np.mean(rs))
    return max([m for m in seeds if fits(m)] or seeds, key=beyond)


def top_k_checkpoints(m: dict, selector, metric: str, k: int = 3) -> float | None:
    """PRISM's rule: the mean of the k best values of one column over the evaluations during
    training. It selects on the test set, as the paper does."""
    top = m["train_max_length"]
    values = [v for h in m.get("history", []) if (v := one_seed(h["eval"], top, selector, metric)) is not None]
    return float(np.mean(sorted(values)[-k:])) if values else None


def best_held_out(m: dict, selector) -> dict | None:
    """UPE's rule: the evaluation during training with the best exact match on the held-out examples
    (other sequences than the test set's, --held-out-lengths) in the lengths of `selector`, the earliest of
    equals (the paper gives no tie-break; a run that holds them all often scores 1.000 at many); returns
    its test rows."""
    top = m["train_max_length"]
    scored = [(one_seed(h["held_out"], top, selector, "exact"), h) for h in m.get("history", []) if "held_out" in h]
    scored = [(v, h) for v, h in scored if v is not None]
    return max(scored, key=lambda vh: vh[0])[1]["eval"] if scored else None


def one_seed(rows: list[dict], top: int, selector, metric: str) -> float | None:
    """One seed's value of a column from its rows; `top`: its longest training length."""
    nums = column_numbers({"eval": over_seeds([rows]), "train_max_length": top}, selector, metric)
    return None if nums is None else nums[0]


def plot_task(task_dir: Path, only: set[str] | None = None, path: Path | None = None) -> Path | None:
    """runs/<task>/extrapolation.png: every method run on the task (or the run folders named in `only`,
    drawn to `path`, with each run's other readings of ViPE's s as broken lines of its colour); mean over
    seeds with the min-max spread; a dashed grey line at the maximum training length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = []
    for d in sorted(task_dir.iterdir()):
        if d.is_dir() and stored(d / "metrics.json") and (only is None or d.name in only):
            summary = read_metrics(d / "metrics.json", ("task", "eval", "label", "seeds", "train_max_length"))
            summaries += [summary] if summary else []
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
    elif all(len(s["eval"]) == 1 for s in summaries):   # one test length (MQRAR): token accuracy, a bar a run
        acc = [s["eval"][0]["token"] for s in summaries]
        lo, hi = [s["eval"][0]["token_min"] for s in summaries], [s["eval"][0]["token_max"] for s in summaries]
        ax.bar(range(len(summaries)), acc, yerr=[np.subtract(acc, lo), np.subtract(hi, acc)],
               color=[plt.cm.tab20.colors[k % 20] for k in range(len(summaries))])
        ax.set_xticks(range(len(summaries)), [f"{s['label']} ({len(s['seeds'])})" for s in summaries],
                      rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(f"token accuracy at length {summaries[0]['eval'][0]['length']}")
        ax.set_ylim(0, 1.02)
        title = f"{task}: token accuracy by run (seeds in brackets)"
    else:
        for s in summaries:
            xs = [p["length"] for p in s["eval"]]
            line, = ax.plot(xs, [p["exact"] for p in s["eval"]], marker=".", label=f"{s['label']} ({len(s['seeds'])} seeds)")
            ax.fill_between(xs, [p["exact_min"] for p in s["eval"]], [p["exact_max"] for p in s["eval"]],
                            color=line.get_color(), alpha=0.15)
            for (rule, points), style in zip(s.get("ablations", {}).items() if only else [], ("--", ":", "-.")):
                ax.plot([p["length"] for p in points], [p["exact"] for p in points], linestyle=style,  # ViPE's
                        color=line.get_color(), label=f"{s['label']}, {rule}")                       # other readings
        ax.axvline(summaries[0]["train_max_length"], color="gray", linestyle="--", label="max train length")
        ax.set_xlabel("problem length")
        ax.set_ylabel("exact-match accuracy")
        ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    entries = len(ax.get_legend_handles_labels()[0])
    if entries > 12:                                         # beside the axes, where it hides no line
        fig.set_size_inches(10, 4.2)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    elif entries:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = path or task_dir / "extrapolation.png"
    save_atomic(fig, path, dpi=110)        # its own temporary name: two commands may draw one task at once
    plt.close(fig)
    return path


# =============================================================================================
# Headline experiments
# =============================================================================================

QUICK_SEEDS = [0, 1, 2, 3, 4]   # the quick budget's seeds: minutes a run, so five, for the verdict's intervals


@dataclass
class Experiment:
    claim: str                   # the paper's result in words
    runs: list                   # dicts: task, method, optional tag and TrainConfig/ModelConfig overrides
    columns: list                # (label, selector, metric): selector = variant name or (lo, hi) lengths
    paper: dict                  # run label -> the paper's number per column (strings)
    scaled: str                  # what was scaled down from the paper to fit minutes
    seeds: list = field(default_factory=lambda: [0])
    select: tuple | None = None  # the paper's selection rule, reported beside the last checkpoint:
                                 # ("best_seed",) | ("top3",) (needs eval_every) | ("held_out", (lo, hi))
    sweep: tuple | None = None   # (x-axis label, column index): plot that column against the number in
                                 # each run's tag (e.g. L2 -> 2), one line per method
    full: dict | None = None     # the paper's own setup (--budget full): its "runs", "seeds" and "scaled"
                                 # (what still differs from the paper), optionally its own "checks" and
                                 # "select"; None: not defined yet
    checks: list = field(default_factory=list)  # the claim as comparisons for `verdict`: (a, b, column
                                 # index), "a does better than b there"; a and b are runs ("task/label") or
                                 # numbers (a threshold the run's mean must beat, or stay below); b may be
                                 # Kept(fraction, lengths): that part of run a's own accuracy at those lengths


@dataclass(frozen=True)
class Kept:
    """The other side of a check that is relative to the run itself: `fraction` of its own value (same
    metric) over the lengths `of`, seed by seed ("maintains 90 % of its original accuracy": Kept(0.9, (1, 5)))."""
    fraction: float
    of: tuple


BUDGETS = ("quick", "full")


def run_label(run: dict) -> str:
    """A run's folder name under its task: "vipe-L3-full" for method vipe, tag "L3-full"."""
    return run["method"] + (f"-{run['tag']}" if run.get("tag") else "")


def run_of(name: str, task: str) -> dict:
    """The settings of experiment `name`'s (first) run on `task`, as its `runs` list gives them."""
    return next(run for run in EXPERIMENTS[name].runs if run["task"] == task)


def at_budget(exp: Experiment, budget: str) -> Experiment:
    """The experiment as run at a budget: quick as it stands, full with the paper's setup, its runs
    tagged "full" so that they never share a folder with the quick ones."""
    if budget == "quick":
        return exp
    if exp.full is None:
        raise ValueError("has no full setup yet")
    runs = [{**run, "tag": "-".join(t for t in (run.get("tag", ""), "full") if t)} for run in exp.full["runs"]]
    paper = {f"{label}-full": cells for label, cells in exp.paper.items()}
    checks = [tuple(f"{x}-full" if isinstance(x, str) else x for x in (a, b)) + (col,)
              for a, b, col in exp.full.get("checks", exp.checks)]
    return replace(exp, runs=runs, seeds=exp.full["seeds"], scaled=exp.full["scaled"], paper=paper, full=None,
                   checks=checks, select=exp.full.get("select", exp.select))


VIPE_METHODS = ("ape", "nope", "rope", "alibi", "t5", "fire", "vipe")
# ViPE's settings in its experiments. The fresh fine-tuning optimiser is named although it is the default: runs made
# before it was (the run's Adam state continued, the 1-16 rows read on the model as trained) read as another setup.
VIPE_FINETUNE = {"vipe": {"opts": {"vipe_finetune": 200, "vipe_ft_optim": "fresh"}}}
VIPE_SEEDS = [0, 42, 123, 2025, 7811, 9527, 13579, 23343]    # the paper's eight
# The paper's training (appendix): Adam at a constant 3e-4, batch 256, 2000 epochs of a fixed set of
# 32,768 sequences (256k steps); 65,536 test sequences, 2,048 per length. Adam's eps is not the paper's:
# at zero loss its second moment collapses far below eps, and one batch with 100x the plateau's gradient
# then set off a jump of the loss with the loop's 1e-6, not with 1e-4 (docs/perf/plateau_replay.py).
VIPE_PAPER = dict(steps=256_000, batch_size=256, lr=3e-4, min_lr_ratio=1.0, weight_decay=0.0, train_set=32_768,
                  n_eval=2048, adam_eps=1e-4)


HIGH = 0.5   # "high", "generalises", "extrapolates" where a paper gives no number: exact match above this


def _vipe_checks(task: str, baselines) -> list:
    """ViPE beats each baseline of its depth at 17-24 (1.5x the training length), and is high there."""
    return [(f"{task}/vipe-L{n}", f"{task}/{m}-L{n}", 1) for n in (2, 3) for m in baselines] + \
        [(f"{task}/vipe-L{n}", HIGH, 1) for n in (2, 3)]


def _vipe_experiment(task: str) -> Experiment:
    """One task of the ViPE paper's Figure 6 / 12: seven encodings x 2 and 3 layers, five seeds; ViPE
    tested with the paper's fixed s after a short fine-tuning with it, and the other rules beside."""
    return Experiment(
        claim=f"{task}: train L=1..16, test 17..48, 1 head, d=128, 2 and 3 layers: ViPE keeps high accuracy "
              "to about 2x the training length while the other encodings collapse (paper Fig. 6 and 12; it does "
              "not say whether its accuracy is exact match or per token: both are shown, the checks read exact "
              "match)",
        runs=[dict(task=task, method=m, tag=f"L{n}", n_layers=n, **VIPE_FINETUNE.get(m, {}))
              for n in (2, 3) for m in VIPE_METHODS],
        columns=[("1-16", (1, 16), "exact"), ("17-24", (17, 24), "exact"), ("25-32", (25, 32), "exact"),
                 ("33-48", (33, 48), "exact"), ("17-24 token", (17, 24), "token"), ("25-32 token", (25, 32), "token")],
        paper={**{f"{m}-L{n}": ["> 0.85 (selection rule)", "collapses", "collapses", "collapses", "collapses",
                                "collapses"] for m in VIPE_METHODS[:-1] for n in (2, 3)},
               **{f"vipe-L{n}": ["> 0.85 (selection rule)", "high", "high (to ~2x)", "falls", "high", "high (to ~2x)"]
                  for n in (2, 3)}},
        scaled="4k steps x 256 fresh sequences (the paper: 2000 epochs over 32,768 sequences, i.e. 256k steps), "
               "then 200 steps of fine-tuning with s = 48 / 16 for ViPE; 5 seeds (the paper: best of 8 with "
               "in-distribution accuracy > 0.85); one task per experiment so that each fits in about ten minutes; "
               "ViPE-L2/L3 and NoPE-L3 at 16k steps: docs/results/vipe-budget",
        seeds=QUICK_SEEDS, select=("best_seed",), checks=_vipe_checks(task, VIPE_METHODS[:-1]),
        full=dict(runs=[dict(task=task, method=m, tag=f"L{n}", n_layers=n, **VIPE_PAPER, **VIPE_FINETUNE.get(m, {}))
                        for n in (2, 3) for m in ("nope", "vipe")],
                  seeds=VIPE_SEEDS, checks=_vipe_checks(task, ["nope"]),
                  scaled="the paper's setup (Adam at a constant lr 3e-4, batch 256, 256k steps over a fixed set of "
                         "32,768 sequences, 2,048 test sequences per length, its 8 seeds), d = 128; only NoPE (the "
                         "strongest baseline of the quick runs) and ViPE; AdamW's eps 1e-4 (with 1e-8 or 1e-6, runs "
                         "leave zero loss: docs/perf/vipe.md), the loop's 100 warm-up steps, ViPE fine-tuned 200 "
                         "steps with the fixed s (the paper: briefly)"))


# PRISM's gate head starting with every cursor counting tokens (see _PRISM_RUNS).
COUNT = {"prism_count_bias": 1.0}


def _prism_vs_ape(task: str) -> list[dict]:
    """PRISM and its baseline, APE with a random position shift: 10k steps with the length curriculum,
    evaluations every 1000 steps (for the paper's rule, the mean of the top 3). PRISM's gate head
    starts with biases reset -1, increment +1 (prism_count_bias; the paper does not give this
    initialisation). Also PRISM with its gate GRU's input weights fixed at their random start and
    random gate biases (an ablation, not the paper's model)."""
    return [dict(task=task, method="prism", opts={**COUNT}, curriculum=True, steps=10000,
                 eval_every=1000),
            dict(task=task, method="prism", tag="fixed-gru-input", opts={"prism_fixed_gru_input": True},
                 curriculum=True, steps=10000, eval_every=1000),
            dict(task=task, method="ape", ape_shift=100, curriculum=True, steps=10000, eval_every=1000)]


_PRISM_RUNS = ("PRISM's gate head starts with biases reset -1, increment +1 (prism_count_bias=1; the paper does "
               "not give this initialisation; chosen from 0, 1 and 3 on copy seeds 0-2 evaluated at the test "
               "lengths, then checked on seeds 3-8); prism-fixed-gru-input: the ablation with the gate GRU's "
               "input weights fixed at their random start and random gate biases")


# The PRISM paper's setup (its section 6.4 and appendix): 5 layers; 140 cursors as 35 heads of 4 (the model
# needs the width divisible by the heads: 210 for the paper's 192); superposition width 340; AdamW
# (0.9, 0.98) at a peak 9e-5 (the cursors' alphas in their own group, prism.param_groups), batch 100, the
# curriculum on its schedule; evaluated every 1k steps once the loss is below 0.1, reported as the mean of the 3
# best. The paper evaluates on "a held-out test set of 1,000 examples": so do the evaluations during training
# here (paper_test_set: as many per length as make 1,000 over the test lengths), which are all that the top-3 rule
# reads; the final one takes 1,000 at each test length (n_eval), so that each length's point in the tables is as
# precise as the paper's whole set (SCAN reads its whole test split either way).
# Its 150k steps: PRISM_FIT_STEPS here for copy and add_cot (trained to 10), what was estimated to fit the 9
# minutes a run may take (PRISM_FIT: what they took); the curriculum reaches their longest length at 5k steps.
PRISM_PAPER = dict(n_layers=5, d_model=210, n_heads=35, lr=9e-5, beta2=0.98, batch_size=100, curriculum=True,
                   curriculum_steps=5000, eval_every=1000, eval_from_loss=0.1, n_eval=1000)
PRISM_FIT_STEPS = {"copy": 45_000, "add_cot": 18_000}
PRISM_PAPER_STEPS = 150_000
PRISM_OPTS = {"prism_cursors": 4, "prism_dim": 340, **COUNT}


def paper_test_set(task: str, test_lengths: list[int] | None = None, total: int = 1000) -> int:
    """Examples per test length that make the paper's test set of `total` over the test lengths
    (the task's own unless given)."""
    return -(-total // len(test_lengths or TASKS[task].test_lengths))


# Its baseline: 5 layers, 8 heads, width 512, tied embeddings, randomly shifted sinusoidal APE.
PRISM_APE = dict(PRISM_PAPER, d_model=512, n_heads=8, tie_weights=True, ape_shift=100)
PRISM_FULL = ("the paper's setup (PRISM_PAPER: 5 layers, 35 heads x 4 cursors, superposition width 340, AdamW "
              "(0.9, 0.98) at 9e-5, batch 100, its curriculum schedule, the mean of the 3 best evaluations, "
              "every 1k steps once the loss is below 0.1, on the paper's test set of 1,000 examples in all); "
              "1,000 examples at each test length in the final evaluation; a width of 210 for its 192 (35 heads "
              "must divide it); the gate head starting to count as in the quick runs (the paper gives no "
              "initialisation); {more}; {steps}")
PRISM_FIT = ("copy 45k and add_cot 18k of its 150k steps (30 % and 12 %). Copy's, measured compiled (--compile), each "
             "run alone on one H100: a copy run trains for 7.7 minutes (107 steps/s, its 44 evaluations during "
             "training counted; 8.7 from its command's start to its end; commit 0ecafe2, "
             "docs/results/jobs-4gpu-prism-paper-eval). add_cot's 18k were chosen from its step with the one-warp scan"
             " and TF32 products (--compile --tf32): 46.2 steps/s alone on an H200 (commit 3c65cc7, "
             "docs/results/full-budget-speed, p37; before them 33.6 on an H200, 29.9 on an H100, where 14k steps took "
             "8.2-8.7 minutes a run: docs/results/jobs-2gpu-prism-add-static). Measured (commit 1870fd8, each run "
             "alone on an H200 of a host of two, docs/results/jobs-2gpu-prism-add-18k): 6.8-7.3 minutes from its "
             "command's start to its end (405-437 s; training 47.8-49.2 steps/s with its evaluations, final evaluation"
             " 12-14 s); on an H100 not run, about 8.2 minutes by the earlier step's rates there and on an H200 (29.9 "
             "and 33.6 steps/s); the curriculum reaches 10 at 5k steps")


def _prism_vs_ape_full(task: str, tags: tuple = ("",)) -> dict:
    """The full setup of a task trained to 10: PRISM and the paper's APE baseline at PRISM_FIT's steps
    (tag ""), and at the paper's 150k steps (tag "150k"), each a run of its own."""
    runs = []
    for tag in tags:
        fit = dict(steps=PRISM_PAPER_STEPS if tag == "150k" else PRISM_FIT_STEPS[task],
                   n_eval_during=paper_test_set(task), **({"tag": tag} if tag else {}))
        runs += [dict(task=task, method="prism", opts=PRISM_OPTS, **PRISM_PAPER, **fit),
                 dict(task=task, method="ape", **PRISM_APE, **fit)]
    return dict(runs=runs, seeds=[0, 1, 2],
                scaled=PRISM_FULL.format(more="APE as the paper's baseline (5 layers, 8 heads, width 512, tied "
                                              "embeddings, shift 100)", steps=PRISM_FIT)
                + ("" if tags == ("",) else "; 150k: the paper's 150k steps, its peak rate on the cosine schedule "
                                           "over them (the paper names a peak, not the decay), a run spanning "
                                           "several sittings through its checkpoint (docs/perf/training.md)"))


# The length-40 tasks reach their last curriculum stage at 30k steps on the paper's schedule, which does not fit 9
# minutes. Dynamic string copy (trained to 10, as copy) and SCAN (no curriculum) take the steps estimated to fit
# (PRISM_MORE_FIT: how, and what they took); so do reverse, stack and odds-first (PRISM_MORE_SCALED), with the
# curriculum scaled to those steps as in the quick runs (its stages in equal parts of the first half) and 100
# examples per length in the final evaluation (their 150 test lengths at 1,000 each took 3 minutes); mul_cot stays
# at 40k, not run (PRISM_MORE_NOT_RUN).
PRISM_MORE_STEPS = 40_000
PRISM_MORE_SCALED = {"reverse": 12_000, "stack": 12_000, "odds_first": 12_000}
PRISM_MORE_FIT_STEPS = {"dyn_str_cpy": 40_000, "scan_cot": 12_000, **PRISM_MORE_SCALED}
PRISM_MORE_FIT = ("dynamic string copy 40k and SCAN 12k of the paper's 150k steps (27 % and 8 %). Dynamic copy's 40k "
                  "were estimated from copy's runs to take about 8 minutes (its step as fast: 109.2 against 124.1 "
                  "steps/s; copy made 107 steps/s with its evaluations on 1,000 in all, commit 0ecafe2); measured "
                  "(compiled, each run alone on a GPU of a host of two, commit 3d3983c, "
                  "docs/results/jobs-2gpu-dyn-copy-alone): 9.0 minutes from its command's start to its end on an "
                  "H100 (542 s, 2 s over the 9 minutes; training 94.2 steps/s with its evaluations, final evaluation "
                  "47.5 s), 8.5 on an H200 (510 s). "
                  "SCAN's 12k: compiled, alone on one H100 (commit e0d6633), 26.2 steps/s at 22 actions and 4.4 s "
                  "an evaluation of its whole test split, at most 8.6 minutes (docs/perf/step_profile.py; "
                  "docs/results/prism-more-full); dyn_str_cpy's curriculum reaches 10 at 5k steps. Reverse, stack and "
                  "odds_first 12k (8 %), their curriculum scaled to them (40 from step 4.8k; the paper's schedule "
                  "reaches 40 at 30k), 100 examples at each test length in the final evaluation, all three tested "
                  "to 150: estimated from their 9k runs (compiled, --tf32, each run alone on an H200; stack and "
                  "odds_first: commit 36164d5, docs/results/jobs-h200-prism-more-9k, 4.7-5.8 minutes from its "
                  "command's start to its end, training 33.2-36.7 steps/s with its evaluations; reverse, tested to "
                  "100: commit 44f938d, docs/results/jobs-h200-prism-more-reverse-lr, 3.7-4.8 minutes, 42.1-49.5 "
                  "steps/s), so at most 6.7 minutes on an H200 and, as dynamic copy's H100 run took 1.06 times its "
                  "H200 run, about 7.1 on an H100; measured (compiled, --tf32, each run on its own H200 of a host "
                  "of four, four at once, commit f80773c, docs/results/jobs-h200-prism-more-12k): 6.5-8.3 minutes "
                  "from its command's start to its end (training 34.4-36.9 steps/s for stack and odds_first, "
                  "42.4-42.5 for reverse, with its evaluations; final evaluation 11.8-15.4 s), the rest, 95-107 s, "
                  "outside both on a machine compiling them for the first time, 49 s on one that had before; on "
                  "an H100 not run (its training loop at 1.06 times: at most 8.7 minutes); their 9k runs: "
                  "docs/results/prism-more-9k")
PRISM_MORE_NOT_RUN = ("40k of its 150k steps (27 %); not run: compiled, on one H200 (commit 2daeea8), it trains at "
                      "4.5 steps/s with 42 GiB and its first evaluation of 1,000 examples at each length had not "
                      "ended when a 300 s limit stopped the profile (docs/perf/training.md, \"The full budget's runs "
                      "alone\")")


_PRISM_MORE = [dict(task="reverse", method="prism", curriculum=True, n_layers=5, train_lengths=list(range(1, 41)),
                    test_lengths=list(range(1, 151)), steps=2000, n_eval=128,
                    opts={"prism_bins": 512, "prism_copy": True, **COUNT}),
               dict(task="odds_first", method="prism", curriculum=True, n_layers=5,
                    opts={"prism_blocks": [0, 3], "prism_bins": 512, **COUNT}),
               dict(task="stack", method="prism", curriculum=True, n_layers=5,
                    opts={"prism_blocks": [0, 3], "prism_bins": 512, **COUNT}),
               dict(task="dyn_str_cpy", method="prism", curriculum=True, n_layers=5,
                    opts={"prism_copy": True, **COUNT}),
               dict(task="mul_cot", method="prism", curriculum=True, n_layers=5, steps=2000,
                    opts={"prism_bins": 1280, **COUNT}),
               dict(task="scan_cot", method="prism", n_layers=5, steps=2000, opts={"prism_copy": True, **COUNT})]


def _prism_more_full(run: dict) -> dict:
    """A prism-more run in the paper's setup: its task, lengths and options, PRISM_PAPER for the rest."""
    full = {**PRISM_PAPER, "task": run["task"], "method": "prism", "opts": {**run.get("opts", {}), **PRISM_OPTS},
            "steps": PRISM_MORE_FIT_STEPS.get(run["task"], PRISM_MORE_STEPS)}
    if run["task"] in PRISM_MORE_SCALED:               # the curriculum scaled to the steps, as in the quick runs
        full.update(curriculum_steps=0, n_eval=100)
    if run["task"] != "scan_cot":                      # SCAN evaluates its whole test split, whatever n
        full["n_eval_during"] = paper_test_set(run["task"], run.get("test_lengths"))
    for lengths in ("train_lengths", "test_lengths"):
        if lengths in run:
            full[lengths] = run[lengths]
    if not run.get("curriculum"):                     # SCAN: no curriculum, as in the quick run
        full.update(curriculum=False, curriculum_steps=0)
    return full


# The UPE paper's BERT (its appendix B) without its layer count, which differs per experiment.
UPE_BERT = dict(d_model=768, n_heads=8, dropout=0.1, lr=1e-4, weight_decay=1e-4, batch_size=64)
# the 3-digit multiplier at the full budget: long enough to fit the training range, at the peak rate throughout
UPE_MUL3_LONG = dict(steps=100_000, min_lr_ratio=1.0, eval_every=10_000)


# The PaTH paper (section 4.1) gives the models of its synthetic tasks but no optimiser, budget or seeds:
# the full setups keep the quick runs' optimiser (the GPU preset), train longer and test on more examples.
PATH_FULL = ("the paper's model (section 4.1), which is all the paper states for these tasks: no optimiser, "
             "steps or seeds, so the GPU preset's optimiser, seeds 0-2 and {steps} steps x {batch}; {eval}; {ran}")
PATH_ALONE = ("alone on one H100 a flip-flop run takes 1-2 minutes, an MQRAR run at N = 4 1.5 (RoPE) to 3.1 (PaTH, "
              "steps only) (docs/perf/training.md, \"The full budget's runs alone\")")


EXPERIMENTS: dict[str, Experiment] = {
    "path-flipflop": Experiment(
        claim="Flip-flop LM, 1 layer, 2 heads, d=64: error % ID / sparse / dense",
        runs=[dict(task="flipflop", method=m, steps=5000) for m in ("rope", "fox", "path")],
        columns=[("ID err %", "ID", "error"), ("sparse err %", "sparse", "error"), ("dense err %", "dense", "error")],
        paper={"rope": ["6.9", "40.3", "0.01"], "fox": ["8.3", "36.3", "0"], "path": ["0", "0.0001", "0"]},
        scaled="5k steps x 64 sequences for every method (the paper does not state its budget); 256 eval "
               "sequences per setting, so the smallest measurable non-zero error is ~0.03 %",
        seeds=QUICK_SEEDS, checks=[("flipflop/path", f"flipflop/{m}", c) for m in ("rope", "fox") for c in (0, 1)],
        full=dict(runs=[dict(task="flipflop", method=m, steps=50_000, n_eval=16_384) for m in ("rope", "fox", "path")],
                  seeds=[0, 1, 2], scaled=PATH_FULL.format(steps="50k", batch=64, eval="16,384 test sequences per "
                                                           "setting (smallest non-zero error ~0.0005 %)",
                                                           ran=PATH_ALONE + "; these runs: nine at once on one H100, "
                                                           "then beside MQRAR's on four (wall: each run's share)"))),
    "path-a5": Experiment(
        claim="A5 word problem over the generators (1 2 3), (1 2 4), (1 2 5) and their inverses, sequences "
              "of 20: PaTH needs fewer layers than RoPE to solve it (solved = accuracy above 90 %; the paper: "
              "PaTH 2 layers, the others 4)",
        runs=[dict(task="a5", method=m, tag=f"L{n}", n_layers=n, steps=24_000, min_lr_ratio=1.0)
              for n, m in ((2, "rope"), (2, "path"), (3, "rope"), (4, "rope"))],
        columns=[("length 20 token acc", (20, 20), "token"), ("length 20 exact", (20, 20), "exact"),
                 ("length 40 token acc", (40, 40), "token")],
        paper={"rope-L4": ["> 0.9", "", ""], "path-L2": ["> 0.9", "", ""]},
        scaled="24k steps x 128 sequences of length 20 at a constant learning rate after warm-up, d=256, 4 heads, "
               "5 seeds; only the configs the claim compares (PaTH 2 layers, RoPE 2-4), so that twice the steps of "
               "the earlier 12k-step setup over 1-4 layers fit 10 minutes (its runs, with RoPE-L4's loss still "
               "falling: docs/results/a5/quick-12k). Constant, because under a cosine decay to 0.1 over the 24k "
               "steps 4 of 11 PaTH-L2 runs had not made by the end the sudden drop in loss with which a run "
               "learns A5, and every run that made it did so by step 11.6k (docs/results/a5/quick-24k-cosine); "
               "at the constant rate 2 of 8 had not, and two made it later, at 13.8k and 22.3k "
               "(docs/results/a5/quick-constant-seeds)",
        seeds=QUICK_SEEDS, sweep=("layers", 0),
        checks=[("a5/path-L2", 0.9, 0), (0.9, "a5/rope-L2", 0), (0.9, "a5/rope-L3", 0), ("a5/rope-L4", 0.9, 0)],
        full=dict(runs=[dict(task="a5", method=m, tag=f"L{n}", n_layers=n, steps=40_000, n_eval=2048)
                        for n in (1, 2, 3, 4) for m in ("rope", "path")],
                  seeds=[0, 1, 2], scaled=PATH_FULL.format(steps="40k", batch=128, eval="2,048 test sequences per "
                                                           "length; 1-4 layers, d = 256, 4 heads", ran="run on one H200, "
                                                           "3 to 12 runs at once under MPS (wall: each run's share), "
                                                           "not timed alone"))),
    "path-mqrar": Experiment(
        claim="Multi-query repeated associative recall with N-back (MQRAR-N), 2 layers, d=256, 2 heads: "
              "PaTH holds its accuracy for N < 4, RoPE and FoX fall as N grows (paper Fig. 2)",
        runs=[dict(task="mqrar", method=m, tag=f"N{n}", task_opts={"n_back": n}, steps=2000)
              for n in (1, 2, 3, 4) for m in ("rope", "fox", "path")],
        columns=[("token acc", (384, 384), "token"), ("exact (per sequence)", (384, 384), "exact")],
        paper={},
        scaled="2k steps x 64 sequences of 384 assignments, 5 seeds (seed 0 run first; the paper trains to "
               "convergence)",
        seeds=QUICK_SEEDS, sweep=("N (n-back)", 0),
        checks=[(f"mqrar/path-N{n}", f"mqrar/{m}-N{n}", 0) for n in (2, 3) for m in ("rope", "fox")]
        + [("mqrar/path-N3", 0.9, 0)],
        full=dict(runs=[dict(task="mqrar", method=m, tag=f"N{n}", task_opts={"n_back": n}, steps=12_000, n_eval=1024)
                        for n in (1, 2, 3, 4) for m in ("rope", "fox", "path")],
                  seeds=[0, 1, 2], scaled=PATH_FULL.format(steps="12k", batch=64, eval="1,024 test sequences; 32 "
                                                           "keys, 384 assignments (768 tokens), as in the paper",
                                                  ran=PATH_ALONE + "; these runs: 36 at once on four H100s, "
                                                  "nine a GPU (wall: each run's share)"))),
    "vipe-poly": _vipe_experiment("polynomial"),
    "vipe-parity": _vipe_experiment("parity"),
    "vipe-binary-copy": _vipe_experiment("binary_copy"),
    "vipe-scan": Experiment(
        claim="SCAN length split, 6 layers, 4 heads, d=256: exact match on the test split (paper Table 2)",
        runs=[dict(task="scan", method=m, **VIPE_FINETUNE.get(m, {})) for m in ("ape", "rope", "nope", "vipe")],
        columns=[("train split (<= 22 actions)", (1, 22), "exact"), ("test split (24-48 actions)", (24, 48), "exact")],
        paper={"ape": ["", "0.000"], "rope": ["", "0.021"], "nope": ["", "0.132"], "vipe": ["", "0.150"]},
        scaled="6k steps x 128 commands drawn from the train split as they are (the paper: an "
               "encoder-decoder setting); exact match over every command of each split (3,920 in the test split); "
               "a causal decoder over `command = actions` (no prefix-LM mask: the causal kernels take none); "
               "ViPE fine-tuned 200 steps with s = 48 / 22; 8 seeds, the paper's count for its synthetic tasks",
        seeds=list(range(8)), select=("best_seed",),
        checks=[("scan/vipe", "scan/nope", 1), ("scan/nope", "scan/rope", 1), ("scan/rope", "scan/ape", 1)]),
    "prism-copy": Experiment(
        claim="Copy, trained on lengths <= 10, tested to 100: PRISM stays near 100 % to 10x the training length; "
              "APE with a random position shift fails (paper Fig. 6)",
        runs=_prism_vs_ape("copy"),
        columns=[("1-10 (train)", (1, 10), "exact"), ("11-20", (11, 20), "exact"), ("21-50", (21, 50), "exact"),
                 ("51-100", (51, 100), "exact")],
        paper={"prism": ["~1.0", "~1.0", "~1.0", "~1.0"], "ape": ["", "fails", "fails", "fails"]},
        scaled="2 layers, d=128, 4 heads, 10k steps x 64 (the paper: 150k steps x 100) with the curriculum "
               "compressed into the first half of the steps; 5 seeds, evaluated every 1000 steps for the paper's "
               "rule (mean of the top 3 evaluations); " + _PRISM_RUNS,
        seeds=QUICK_SEEDS, select=("top3",),
        checks=[("copy/prism", "copy/ape", c) for c in (1, 2, 3)] + [("copy/prism", 0.9, 3)],
        full=_prism_vs_ape_full("copy")),
    "prism-add": Experiment(
        claim="Addition with chain of thought, trained on <= 10 digits, tested to 30: PRISM extrapolates to "
              "20-30 digits, APE fails (paper Fig. 1)",
        runs=_prism_vs_ape("add_cot"),
        columns=[("1-10 (train)", (1, 10), "exact"), ("11-20", (11, 20), "exact"), ("21-30", (21, 30), "exact")],
        paper={f"{m}{tag}": cells for tag in ("", "-150k") for m, cells in
               (("prism", ["~1.0", "high", "high"]), ("ape", ["", "fails", "fails"]))},
        scaled="2 layers, d=128, 4 heads, 10k steps x 64 (the paper: 150k steps x 100) with the curriculum; 5 "
               "seeds, evaluated every 1000 steps for the paper's rule (mean of the top 3); " + _PRISM_RUNS
               + "; with the paper's 5 layers: docs/results/prism-add-depth",
        seeds=QUICK_SEEDS, select=("top3",),
        checks=[("add_cot/prism", "add_cot/ape", c) for c in (1, 2)] + [("add_cot/prism", HIGH, c) for c in (1, 2)],
        full={**_prism_vs_ape_full("add_cot", ("", "150k")),
              "checks": [(f"add_cot/{p}", f"add_cot/{a}" if a else HIGH, c) for p, a in
                         (("prism", "ape"), ("prism", ""), ("prism-150k", "ape-150k"), ("prism-150k", ""))
                         for c in (1, 2)]}),
    "prism-more": Experiment(
        claim="Reverse, odds-first, stack (train <= 40, test to 150), dynamic string copy, multiplication "
              "with chain of thought (train <= 9), SCAN with chain of thought (paper Fig. 5, 8, 10, 3, 9 and 4, "
              "in that order)",
        runs=_PRISM_MORE,
        columns=[("up to the training length", "train", "exact"), ("beyond it", "beyond", "exact")],
        paper={},
        scaled="the GPU preset per task (3k steps; reverse, mul_cot and scan_cot 2k; the paper: 150k; 5 seeds, "
               "seed 0 run first; reverse evaluated on 128 examples per length) with the paper's 5 layers, at "
               "least as many bins as positions, and the copy branch for reverse (trained to 40, tested to 150; "
               "tested to 100 before: docs/results/prism-more-9k), dynamic string copy and SCAN; "
               "PRISM only (the figures' baselines are the other experiments' APE runs); odds_first and stack "
               "recompute positions before blocks 1 and 4; the gate head starts counting (prism_count_bias=1, as "
               "in prism-copy; earlier runs with random gate biases: docs/results/before-count-bias; "
               "2x and 4x the steps: docs/results/prism-more-budget)",
        full=dict(runs=[_prism_more_full(run) for run in _PRISM_MORE], seeds=[0, 1, 2], select=("top3",),
                  scaled=PRISM_FULL.format(more="the copy branch on one query cursor of each head (the paper: one "
                                                "in five); bins and blocks as in the quick runs",
                                         steps=PRISM_MORE_FIT + "; mul_cot: "
                                         + PRISM_MORE_NOT_RUN)),
        seeds=QUICK_SEEDS,
        checks=[(f"{run['task']}/prism", HIGH, 1) for run in _PRISM_MORE]),
    "upe-add": Experiment(
        claim="Padded addition (width 50), bidirectional encoder, train operands < 10^5: APE fails from 6 digits, "
              "RPE generalises to 49-digit sums, with high fluctuations (UPE paper Fig. 2)",
        runs=[dict(task="add_padded", method=m, task_opts={"width": 50}, test_lengths=list(range(1, 51)),
                   steps=3000, eval_every=1000, held_out_lengths=[6, 7, 8], **UPE_BERT) for m in ("ape", "rpe")],
        columns=[("k=5 (train)", (5, 5), "exact"), ("k=6-10", (6, 10), "exact"), ("k=11-20", (11, 20), "exact"),
                 ("k=21-30", (21, 30), "exact"), ("k=31-49", (31, 49), "exact"), ("k=50", (50, 50), "exact")],
        paper={"ape": ["", "fails", "fails", "fails", "fails", "fails"],
               "rpe": ["", "generalises", "generalises", "generalises", "generalises", "falls (input format)"]},
        scaled="the paper's model (6 layers, d=768, 8 heads, dropout 0.1, AdamW lr 1e-4, weight decay 1e-4, "
               "batch 64) for 3k steps of fresh sums (192k samples; the paper: 100k samples); RPE clip 64; evaluated every "
               "1000 steps for the paper's rule (best checkpoint on held-out 6-8 digit sums); 5 seeds (seeds 0 and 1 "
               "run first); RPE at 14k steps: docs/results/upe-add-budget",
        seeds=QUICK_SEEDS, select=("held_out", (6, 8)),
        checks=[("add_padded/rpe", "add_padded/ape", c) for c in (1, 2, 3, 4)] + [("add_padded/rpe", HIGH, 4)],
        full=dict(runs=[dict(task="add_padded", method=m, task_opts={"width": 50}, test_lengths=list(range(1, 51)),
                             steps=30_000, train_set=100_000, eval_every=1000, held_out_lengths=[6, 7, 8],
                             **UPE_BERT)
                        for m in ("ape", "rpe")], seeds=list(range(8)),
                  scaled="the paper's model and optimiser (appendix B) and its fixed set of 100k sums; 30k steps "
                         "x 64 (19.2 epochs; the paper trains without stating how long; 15k steps: "
                         "docs/results/upe-add-full-15k); 8 seeds, since how far RPE holds differs from seed to seed "
                         "(the paper: high fluctuations)")),
    "upe-mul": Experiment(
        claim="Padded multiplication, 1- and 3-digit multipliers, train multiplicands < 10^5, test to 20 digits: "
              "with a 3-digit multiplier UPE keeps about 90 % at 16 digits, RPE degrades, APE fails (UPE paper Fig. 4 "
              "and 5)",
        runs=[dict(task="mul_padded", method=m, tag=f"m{d}", task_opts={"multiplier_digits": d},
                   n_layers=6 if d == 1 else 9) for d in (1, 3) for m in ("ape", "rpe", "upe")],
        columns=[("k=5 (train)", (5, 5), "exact"), ("k=6-10", (6, 10), "exact"), ("k=11-15", (11, 15), "exact"),
                 ("k=16", (16, 16), "exact"), ("k=17-20", (17, 20), "exact")],
        paper={f"{m}-{tag}": cells for tag in ("m3", "m3low") for m, cells in (
            ("upe", ["", "", "", "~90 % of its accuracy in training", ""]), ("rpe", ["", "", "", "degrades", ""]),
            ("ape", ["", "fails", "fails", "fails", "fails"]))},
        scaled="d=256, 8 heads, 6k steps x 128 (768k samples; the paper: 500k); 5 seeds (seed 0 run first); "
               "6 layers for the 1-digit multiplier and the paper's 9 for the 3-digit one (the paper: 768 wide, "
               "`UPE_BERT`; with it, 8k steps x 64 leave the 3-digit runs at a training loss of 0.41-0.50, docs/results/mul_padded-bert); "
               "RPE clip 64, 3 uniform slots; the 3-digit runs at 20k steps: docs/results/upe-mul-budget",
        seeds=QUICK_SEEDS,
        checks=[("mul_padded/upe-m3", "mul_padded/rpe-m3", 3), ("mul_padded/upe-m3", "mul_padded/ape-m3", 3),
                ("mul_padded/upe-m3", Kept(0.9, (1, 5)), 3)],   # "maintains 90 % of its original accuracy"
        full=dict(runs=[dict(task="mul_padded", method=m, tag=f"m{d}", task_opts={"multiplier_digits": d},
                             n_layers=6 if d == 1 else 9, train_set=100_000 if d == 1 else 500_000, **UPE_BERT,
                             **(dict(steps=15_000) if d == 1 else UPE_MUL3_LONG))
                        for d in (1, 3) for m in ("ape", "rpe", "upe")]
                  + [dict(task="mul_padded", method=m, tag="m3low", n_layers=9, train_set=500_000,
                          task_opts={"multiplier_digits": 3, "multiplier_low": 1}, **UPE_BERT, **UPE_MUL3_LONG)
                     for m in ("ape", "rpe", "upe")],
                  seeds=[0, 1, 2],
                  checks=[(f"mul_padded/upe-{tag}", other, 3) for tag in ("m3", "m3low")
                          for other in (f"mul_padded/rpe-{tag}", f"mul_padded/ape-{tag}", Kept(0.9, (1, 5)))],
                  scaled="the paper's model and optimiser (appendix B: 768 wide, 8 heads, 6 layers, 9 for the "
                         "3-digit multiplier) and its fixed sets (100k samples; 500k for the 3-digit multiplier); "
                         "the 1-digit multiplier 15k steps x 64 with the cosine schedule, the 3-digit one 100k "
                         "steps x 64 at a constant 1e-4 after the warm-up, evaluated every 10k steps (the paper "
                         "does not say how long or with which schedule; at 20k steps with the cosine no 3-digit run "
                         "fits its training range: docs/results/upe-mul-full-20k); the 1-digit runs ran 9 at once "
                         "beside 6 vipe-parity runs under MPS on one H200 (wall: each run's share); m3low: the "
                         "3-digit runs with the multiplier drawn from 1-999 (1 to 3 digits, in training and "
                         "in the tests), a reading of \"3-digit multipliers\" that the paper leaves open, with "
                         "which UPE fits its training range far faster (docs/results/upe-mul-suspects)")),
}


# =============================================================================================
# The verdict: does the claim hold in these runs?
# =============================================================================================

MIN_SEEDS = 3     # fewer seeds on a side: the check is inconclusive whatever its interval says
LEVEL = 0.90      # the verdict's intervals: 90 % percentile bootstrap
N_BOOT = 10_000   # bootstrap resamples (from a fixed generator: a verdict is a function of the seeds' values)
Z = 1.645         # the normal quantile of LEVEL (two-sided), for the seeds a spread suggests


def seed_values(out: Path, run: str, selector, metric: str, only: list[int] | None = None) -> dict[int, float]:
    """One column's value for each seed of a run ("task/label"), from out/task/label/seed*/metrics.json
    (the seeds in `only` alone, if given)."""
    return {m["seed"]: v for m in seed_metrics(out / run, only)
            if (v := one_seed(m["eval"], m["train_max_length"], selector, metric)) is not None}


def bootstrap(a, b=None, level: float = LEVEL, n: int = N_BOOT) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(a), or of mean(a) - mean(b) with each side's seeds resampled
    on their own."""
    rng = np.random.default_rng(0)
    draw = lambda x: np.asarray(x, float)[rng.integers(0, len(x), (n, len(x)))].mean(1)  # noqa: E731
    stat = draw(a) - (draw(b) if b is not None else 0.0)
    lo, hi = np.quantile(stat, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def check_outcome(a: list | float, b: list | float, lower: bool = False) -> tuple[str, tuple, str]:
    """One check of a claim, "a does better than b", a and b each a run's seed values or a number (a
    threshold): the interval of mean(a) - mean(b) and "holds" when it excludes zero in the claim's direction
    (better = higher, or lower for errors), "fails" when it excludes zero the other way, else "inconclusive";
    the third item says, for an inconclusive check, how many seeds a side the observed spread suggests."""
    runs = [x for x in (a, b) if not isinstance(x, (int, float))]
    if len(runs) == 2:
        lo, hi = bootstrap(a, b)
    else:
        run, sign = (a, 1.0) if runs[0] is a else (b, -1.0)
        c = b if runs[0] is a else a
        lo, hi = sorted(sign * (x - c) for x in bootstrap(run))
    d = float(np.mean(a) - np.mean(b)) * (-1 if lower else 1)           # in the claim's direction
    there = sorted(-x for x in (lo, hi)) if lower else [lo, hi]
    n = min(len(r) for r in runs)
    if n >= MIN_SEEDS and there[0] > 0:
        return "holds", (lo, hi), ""
    if n >= MIN_SEEDS and there[1] < 0:
        return "fails", (lo, hi), ""
    var = sum(float(np.var(r, ddof=1)) if len(r) > 1 else float("nan") for r in runs)
    if d <= 0 or not np.isfinite(var):
        need = "the means do not favour the claim" if d <= 0 else "one seed shows no spread"
    else:
        need = f"about {max(MIN_SEEDS, math.ceil(Z * Z * var / (d * d)))} seeds a run would decide it at this spread"
    return "inconclusive", (lo, hi), need


def verdict(exp: Experiment, out: Path) -> tuple[str, list[str]]:
    """The verdict on an experiment's claim (exp.checks), from a 90 % percentile-bootstrap interval over seeds
    per check (check_outcome; a comparison over the seeds both runs ran): "yes" when every check holds,
    "partly" when some do, "no" when none holds and one fails, "inconclusive" when none holds and none fails;
    no verdict with a run missing. A check on fewer than MIN_SEEDS seeds a run is inconclusive. Returns it
    and one line per check."""
    if not exp.checks:
        return "no verdict (the claim has no checks)", []
    lines, outcomes, missing, fewest = [], [], False, math.inf
    for a, b, col in exp.checks:
        name, selector, metric = exp.columns[col]
        lower = metric == "error"                             # lower is better for errors only
        runs = {x: seed_values(out, x, selector, metric, exp.seeds) for x in (a, b) if isinstance(x, str)}
        if any(not v for v in runs.values()):
            lines.append(f"{a} vs {b} in {name}: " + ", ".join(f"{x} not run" for x, v in runs.items() if not v))
            missing = True
            continue
        if isinstance(b, Kept):                # per seed: the column's value against the fraction of its own
            own = seed_values(out, a, b.of, metric, exp.seeds)
            runs = {a: {k: v for k, v in runs[a].items() if k in own}}
            base = [b.fraction * own[k] for k in runs[a]]
        if len(runs) == 2:                     # like with like: the seeds both ran
            both = sorted(set(runs[a]) & set(runs[b]))
            runs = {x: {k: v[k] for k in both} for x, v in runs.items()}
        vals = {x: list(v.values()) for x, v in runs.items()}
        if isinstance(b, Kept):
            outcome, (lo, hi), need = check_outcome([v - c for v, c in zip(vals[a], base)], 0.0, lower)
        else:
            outcome, (lo, hi), need = check_outcome(vals.get(a, a), vals.get(b, b), lower)
        mean = {x: float(np.mean(v)) for x, v in vals.items()}
        va, vb = mean.get(a, a), float(np.mean(base)) if isinstance(b, Kept) else mean.get(b, b)
        d = 3                                  # more digits where three would print a difference as a tie
        while d < 6 and va != vb and f"{va:.{d}f}" == f"{vb:.{d}f}":
            d += 1
        word = "below" if lower else "above"
        if isinstance(b, Kept):
            say = (f"{a} {word} {b.fraction:g} x its own {b.of[0]}-{b.of[1]} in {name}: mean {va:.{d}f} vs "
                   f"{vb:.{d}f}, difference")
        elif isinstance(a, str) and isinstance(b, str):
            say = f"{a} {word} {b} in {name}: mean {va:.{d}f} vs {vb:.{d}f}, difference"
        elif isinstance(a, str):
            say = f"{a} {word} {b:g} in {name}: mean {va:.3f}, minus {b:g}"
        else:
            say = f"{b} {'above' if lower else 'below'} {a:g} in {name}: mean {vb:.3f}, {a:g} minus it"
        n_seeds = min(len(v) for v in vals.values())
        fewest = min(fewest, n_seeds)
        outcomes.append(outcome)
        lines.append(f"{say} [{int(100 * LEVEL)} %: {lo:+.{d}f} to {hi:+.{d}f}]; {n_seeds} seeds -- {outcome}"
                     + (f" ({need})" if need else ""))
    if missing:
        return f"no verdict (a run missing): {outcomes.count('holds')} of {len(exp.checks)} checks hold", lines
    held, failed = outcomes.count("holds"), outcomes.count("fails")
    word = "yes" if held == len(outcomes) else "partly" if held else "no" if failed else "inconclusive"
    open_ = len(outcomes) - held - failed
    return (f"{word}: {held} of {len(outcomes)} checks hold"
            + (f", {open_} inconclusive ({fewest} seeds)" if open_ else "")), lines


def experiment_table(name: str, exp: Experiment, out: Path) -> str:
    """Markdown table "paper vs this repo" from the summaries written by the runs."""
    lines = [f"### {name}", "", exp.claim, "", f"Scaled: {exp.scaled}", ""]
    head = [c[0] for c in exp.columns]
    lines += ["| run | source | " + " | ".join(head) + " | seeds | device | wall |",
              "| --- | --- | " + " | ".join("---" for _ in head) + " | --- | --- | --- |"]
    seen = []
    for run in exp.runs:
        label = run_label(run)
        key = (run["task"], label)
        if key in seen:
            continue
        seen.append(key)
        if label in exp.paper:
            lines.append(f"| {run['task']}/{label} | paper | " + " | ".join(exp.paper[label]) + " | | | |")
        path = out / run["task"] / label / "metrics.json"
        if not stored(path):
            lines.append(f"| {run['task']}/{label} | this repo | " + " | ".join("not run" for _ in head) + " | | | |")
            continue
        s = json.loads(read_stored(path))
        top, runs = s["train_max_length"], seed_metrics(path.parent, s["seeds"])
        cells = [column_value([m["eval"] for m in runs], top, sel, metric) for _, sel, metric in exp.columns]
        lines.append(f"| {run['task']}/{label} | this repo, last checkpoint, mean [90 % interval] (min-max) over seeds"
                     + examples_note(s["eval"]) + " | " + " | ".join(cells)
                     + f" | {len(s['seeds'])} | {s['device']} | {np.mean(s['wall_s']) / 60:.1f} min |")
        for rule in s.get("ablations", {}):
            rows = [ablations(m)[rule] for m in runs]
            cells = [column_value(rows, top, sel, metric) for _, sel, metric in exp.columns]
            lines.append(f"| {run['task']}/{label} | this repo, {rule} | "
                         + " | ".join(cells) + f" | {len(s['seeds'])} | | |")
        if exp.select:
            source, cells = paper_rule(exp, runs)
            lines.append(f"| {run['task']}/{label} | this repo, {source} | " + " | ".join(cells)
                         + f" | {len(runs)} | | |")
    if not exp.checks:
        return "\n".join(lines)
    word, checks = verdict(exp, out)
    lines += ["", f"Verdict (last checkpoints; a check holds when the {int(100 * LEVEL)} % bootstrap interval over "
                  "seeds of the difference, or of the mean minus a threshold, excludes zero in the claim's direction, "
                  f"and fails when it excludes zero the other way): **{word}**", ""] + [f"- {c}" for c in checks]
    return "\n".join(lines)


def paper_rule(exp: Experiment, seeds: list[dict]) -> tuple[str, list[str]]:
    """(what the row is, its cells) under the experiment's selection rule."""
    rule, top = exp.select[0], seeds[0]["train_max_length"]
    if rule == "best_seed":
        b = best_seed(seeds)
        among = (f"with in-distribution exact match > {MIN_TRAIN}" if any(fits(m) for m in seeds)
                 else f"(none exceeds in-distribution exact match {MIN_TRAIN})")
        return (f"the paper's rule: best of {len(seeds)} seeds {among} (seed {b['seed']}; selects on the test "
                "lengths, as the paper does)",
                [column_value([b["eval"]], top, sel, metric) for _, sel, metric in exp.columns])
    if rule == "top3":
        cells = []
        for _, sel, metric in exp.columns:
            vals = [v for m in seeds if (v := top_k_checkpoints(m, sel, metric)) is not None]
            some = f"; {len(vals)} of {len(seeds)} seeds" if len(vals) < len(seeds) else ""
            cells.append(f"{np.mean(vals):.3f} ({min(vals):.2f}-{max(vals):.2f}{some})" if vals else "-")
        ns = sorted({p["n"] for m in seeds for h in m.get("history", []) for p in h["eval"] if p.get("n")})
        each = f", {ns[0]} examples per length" if len(ns) == 1 else ""
        return (f"the paper's rule: mean of the 3 best evaluations during training{each}, mean (min-max) over "
                "seeds (selects on the test set, as the paper does)", cells)
    chosen = [rows for m in seeds if (rows := best_held_out(m, exp.select[1])) is not None]
    lo, hi = exp.select[1]
    if not chosen:
        return f"the paper's rule: best checkpoint on held-out lengths {lo}-{hi} (no evaluations during training)", \
            ["-" for _ in exp.columns]
    label = (f"the paper's rule: the checkpoint with the best exact match on held-out sequences of lengths {lo}-{hi} "
             "(the earliest of equals), mean [90 % interval] (min-max) over seeds")
    return label, [column_value(chosen, top, sel, metric) for _, sel, metric in exp.columns]


def column_numbers(summary: dict, selector, metric: str):
    """(mean, lo, hi) over seeds of one column, or None; flip-flop errors in percent. selector:
    a variant name, a (lo, hi) length range, or "train" / "beyond" (up to / past the training length).
    Lengths count by their number of examples, so a range's value is over examples (equal weights
    where every length has n of them; SCAN's lengths have as many as the split has commands)."""
    if selector in ("train", "beyond"):
        top = summary["train_max_length"]
        pts = [p for p in summary["eval"] if (p["length"] <= top) == (selector == "train")]
    elif isinstance(selector, str):
        pts = [p for p in summary["eval"] if p["name"] == selector]
    else:
        pts = [p for p in summary["eval"] if selector[0] <= p["length"] <= selector[1]]
    if not pts:
        return None
    weights = [p.get("n") or 1 for p in pts]
    mean = lambda key: float(np.average([p[key] for p in pts], weights=weights))  # noqa: E731
    if metric == "error":
        return 100 * (1 - mean("token")), 100 * (1 - mean("token_max")), 100 * (1 - mean("token_min"))
    return mean(metric), mean(metric + "_min"), mean(metric + "_max")


def examples_note(points: list[dict]) -> str:
    """How many examples each evaluated point holds: one number, or the range where the lengths
    differ (SCAN evaluates every command of the split, 6 to several hundred per action count)."""
    ns = [p["n"] for p in points if p.get("n")]     # (absent from runs made before it was recorded)
    if not ns:
        return ""
    if min(ns) == max(ns):
        return f", {ns[0]} examples per point"
    return f", {sum(ns)} examples, {min(ns)}-{max(ns)} per length"


def seed_spread(evals: list[list[dict]], top: int, selector, metric: str, values: bool = False):
    """(mean, lowest, highest) over seeds of one column, from each seed's rows (its evaluation points): each
    seed's value over the column's points first, so the range is the seeds' own lowest and highest value (the
    per-point lowest and highest, averaged over a range of lengths, would be wider than any seed); or None.
    values=True: the seeds' values instead."""
    vals = [one_seed(rows, top, selector, metric) for rows in evals]
    if not vals or None in vals:
        return None
    return vals if values else (float(np.mean(vals)), min(vals), max(vals))


def column_value(evals: list[list[dict]], top: int, selector, metric: str) -> str:
    """Mean over seeds [its 90 % bootstrap interval] (min-max) of one column, as text (seed_spread); the
    interval from 2 seeds on."""
    vals = seed_spread(evals, top, selector, metric, values=True)
    if vals is None:
        return "-"
    f = ".2f" if metric == "error" else ".3f"
    mean, interval = float(np.mean(vals)), (bootstrap(vals) if len(vals) > 1 else None)
    return f"{mean:{f}}" + (f" [{interval[0]:.2f}-{interval[1]:.2f}]" if interval else "") + \
        f" ({min(vals):.2f}-{max(vals):.2f})"


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
        runs = seed_metrics(path.parent, json.loads(read_stored(path))["seeds"]) if stored(path) else []
        nums = seed_spread([m["eval"] for m in runs], runs[0]["train_max_length"], selector, metric) if runs else None
        if nums is not None:
            lines.setdefault(run["method"], []).append((int("".join(filter(str.isdigit, run["tag"]))), *nums))
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method, pts in lines.items():
        pts.sort()
        x, y, lo, hi = zip(*pts)          # the mean, and a bar from the lowest seed to the highest
        bars = np.clip([np.subtract(y, lo), np.subtract(hi, y)], 0, None)    # >= 0 through rounding too
        ax.errorbar(x, y, yerr=bars, marker="o", capsize=3, label=method)
    ax.set_xticks(sorted({p[0] for pts in lines.values() for p in pts}))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(label)
    ax.set_title(f"{name} ({exp.runs[0]['task']})")
    ax.grid(alpha=0.3)
    ax.legend(title="mean; bars: seeds' min-max", title_fontsize="small")
    fig.tight_layout()
    path = out / "reproduce" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(fig, path, dpi=100)
    plt.close(fig)
    return path


# =============================================================================================
# --reproduce (cli.reproduce): the experiments and runs a command names, and their tables once run
# =============================================================================================

def chosen(name: str, budget: str, seeds: list[int] | None, labels: list[str] | None) -> dict[str, Experiment]:
    """--reproduce NAME (or all) at --budget: {name: the experiment on the seeds of --seeds and the runs of
    --labels (all of its own where not given)}."""
    if name != "all" and name not in EXPERIMENTS:
        raise UsageError(f"unknown experiment {name!r}; available: {', '.join(EXPERIMENTS)}, all")
    defined = [n for n, exp in EXPERIMENTS.items() if budget == "quick" or exp.full]
    if name not in defined + ["all"]:
        raise UsageError(f"experiment {name} has no {budget} setup yet; --budget {budget} is defined for: "
                         f"{', '.join(defined) or 'none'}")
    return {n: on_labels(on_seeds(at_budget(EXPERIMENTS[n], budget), seeds), n, labels)
            for n in (defined if name == "all" else [name])}


def on_seeds(exp: Experiment, chosen: list[int] | None) -> Experiment:
    """The experiment on the seeds of --seeds (all of its own if None): its own in its order, or any others
    (to check a verdict on seeds it did not choose), the table then saying which are not its own."""
    if chosen is not None and len(set(chosen)) < len(chosen):
        raise UsageError(f"--seeds with --reproduce takes distinct seeds, got {', '.join(map(str, chosen))}")
    if chosen is None or set(chosen) == set(exp.seeds):
        return exp
    own = [s for s in exp.seeds if s in chosen]
    new = [s for s in chosen if s not in exp.seeds]
    say = f"; this table: seeds {', '.join(map(str, own + new))}"
    say += f" ({', '.join(map(str, new))} not the experiment's own: " if new else " ("
    say += f"its seeds are {', '.join(map(str, exp.seeds))})"
    return replace(exp, seeds=own + new, scaled=exp.scaled + say)


def seeds_suffix(text: str | None) -> str:
    """The name a table of --seeds gets beside the experiment's own: "-seeds100-104" (the text as given)."""
    kept = "".join(c if c.isdigit() or c in "-," else "" for c in text or "")
    return "" if text is None else "-seeds" + kept.replace(",", "_")


def on_labels(exp: Experiment, name: str, items: list[str] | None) -> Experiment:
    """The experiment on the runs of --labels only (all of them if None): each item a run's folder name
    ("vipe-L3"; the budget's "-full" may be left out) or task/folder for one task's. Its checks keep the
    comparisons between chosen runs alone, so that its verdict stands on them."""
    if items is None:
        return exp
    keys = [(run["task"], run_label(run)) for run in exp.runs]

    def picks(item, key):
        task, _, label = item.rpartition("/")
        return task in ("", key[0]) and label in (key[1], key[1].removesuffix("-full"))
    unknown = [item for item in items if not any(picks(item, key) for key in keys)]
    if unknown or len(set(items)) < len(items):
        known = ", ".join(dict.fromkeys(f"{t}/{label}" for t, label in keys))
        raise UsageError(f"--labels takes distinct runs of the experiment's own ({name}: {known}), "
                         f"got {','.join(items)!r}")
    picked = [k for k, key in enumerate(keys) if any(picks(item, key) for item in items)]
    if len(picked) == len(keys):
        return exp
    runs = {"/".join(keys[k]) for k in picked}
    checks = [c for c in exp.checks if all(x in runs for x in c[:2] if isinstance(x, str))]
    return replace(exp, runs=[exp.runs[k] for k in picked], checks=checks,
                   scaled=f"{exp.scaled}; this table: the runs {', '.join(sorted(runs))} alone")


def write_summary(method_dir: Path, only: list[int] | None = None):
    """<method>/metrics.json: the summary over the seeds in method_dir, or over those in `only` (summarize)."""
    summary = summarize(method_dir, only)
    if summary:
        save_atomic(summary, method_dir / "metrics.json")


def write_summaries(cfgs, own_seeds: bool = False):
    """Each method folder of the configs `cfgs` once, in order: over every seed present, or (own_seeds, as
    --reproduce does) over the seeds of cfgs alone, so that a table stands on its seeds or those of --seeds."""
    folders = {}
    for cfg in cfgs:
        folders.setdefault(cfg.run_dir().parent, []).append(cfg.seed)
    for method_dir, seeds in folders.items():
        write_summary(method_dir, seeds if own_seeds else None)


def write_tables(exps: dict[str, Experiment], plans: dict, out: Path, ran: set, partial: bool, suffix: str,
                 every: str | None = None, other: dict | None = None) -> None:
    """After the runs of --reproduce: per experiment, its summaries, figures and table (reproduce/NAME<suffix>.md),
    once all its runs are present (`plans`: name -> its configs; `ran`: ids of the configs this command
    trained; with `partial`, from the runs present); with `every` (the budget of --reproduce all), all of them
    in reproduce/all<suffix>.md. An experiment with a run present of another setup (`other`, ids of configs:
    jobs.other_setup) is not tabled: its table stays as it was (in all<suffix>.md too, marked), and the command
    says so."""
    tables = []
    for name, cfgs in plans.items():
        print(f"== {name}: {len(cfgs)} runs")
        stale = [cfg for cfg in cfgs if id(cfg) in (other or {})]
        if stale:
            print(f"error: {name}: not tabled, its table left as it was: {len(stale)} of its runs present were made "
                  f"with other options than its setup now (the plan says which; e.g. {stale[0].run_dir()}): "
                  "--force reruns them, or move them aside", file=sys.stderr)
            kept = out / "reproduce" / f"{name}{suffix}.md"
            if kept.exists():
                tables.append(f"{kept.read_text().rstrip()}\n\n(This table was left as it was: {len(stale)} of its "
                              "runs present were made with other options than its setup now.)")
            continue
        waiting = [cfg for cfg in cfgs if id(cfg) not in ran and not stored(cfg.run_dir() / "metrics.json")]
        exp = exps[name]
        if waiting and partial:
            exp = replace(exp, scaled=f"{exp.scaled}; this table: the {len(cfgs) - len(waiting)} runs present of "
                                      f"its {len(cfgs)}, each over its seeds present (--partial)")
        elif waiting:                        # a failed run of this shard reads "not run"; others' runs are waited for
            print(f"{name}: {len(waiting)} of its {len(cfgs)} runs are not in this command and not present yet: "
                  "its table waits for them (run --reproduce again, without --shard or --runs, once they are; "
                  "--partial builds it from those present)")
            continue
        write_summaries(cfgs, own_seeds=True)
        for task in sorted({c.task for c in cfgs}):      # the task's every run, then this experiment's alone
            plot_task(out / task)
            folders = {c.run_dir().parent.name for c in cfgs if c.task == task}
            print(f"wrote {plot_task(out / task, folders, out / 'reproduce' / f'{name}{suffix}-{task}.png')}")
        table = experiment_table(name, exp, out)
        save_atomic(table + "\n", out / "reproduce" / f"{name}{suffix}.md")
        if exp.sweep:
            print(f"wrote {plot_sweep(name + suffix, exp, out)}")
        print(table)
        tables.append(table)
    if every and len(tables) == len(plans):   # one file, paper vs this repo for every experiment
        save_atomic(f"# Paper vs this repo ({every} budget)\n\n" + "\n\n".join(tables) + "\n",
                    out / "reproduce" / f"all{suffix}.md")
        print(f"wrote {out / 'reproduce' / f'all{suffix}.md'}")
