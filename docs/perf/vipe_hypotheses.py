"""ViPE's protocol, hypothesis by hypothesis: the runs, and one table of what each reading gives.

    python docs/perf/vipe_hypotheses.py --commands            # the train.py command of each variant
    python docs/perf/vipe_hypotheses.py runs/parity            # the tables, from the run folders present
    python docs/perf/vipe_hypotheses.py --rescore docs/results # stored runs by sequence, token and final answer
    python docs/perf/vipe_hypotheses.py --full --commands      # the paper's setup with s = 3 and s = 2 (below)
    python docs/perf/vipe_hypotheses.py --full --ramp --commands   # the same, s rising from 1 over 1000 steps
    python docs/perf/vipe_hypotheses.py --readings DIR         # every reading of the runs in DIR/vipe-L*

Each variant is the quick vipe-parity run of ViPE-L2 (`--reproduce vipe-parity --commands`: the gpu preset,
4k steps x 256, then 200 fine-tuning steps with the fixed s) with the one change its name says; base and cont
also evaluate every 1k steps, each evaluation making the paper's reading on a copy of the model (fine-tuned 200
steps with the fixed s, then every length at it):

    base     the protocol as vipe.py defines it (a fresh optimiser for the fine-tuning, at the final rate)
    cont     the fine-tuning continues the run's Adam moments (vipe_ft_optim=continued)
    tanh     a bounded code: tanh of the distance over 16 s (vipe_code=tanh)
    over_n   a bounded code: the distance over the query position (vipe_code=over_n)
    affine   the logit factor g(s) = a s + b, learned per head (vipe_g=affine)
    s2.83    the fixed s from token counts, (2 x 48 + 3) / (2 x 16 + 3) (vipe_s_fixed=2.83)
    s2       the fixed s = 2 (vipe_s_fixed=2)

The table, per variant: exact match of the paper's reading (the fine-tuned model at the fixed s) at 1-16,
17-24 and 25-32, mean (min-max) over seeds; at 17-24 also per token and on the final answer (y_L); the model
as trained at s per length and s = 1; and the checkpoint the paper's "best test accuracy" may mean: the
evaluation during training (or the last) with the best 17-24 of the paper's reading, chosen on the test
lengths as such a rule does.

The best of these at the paper's own setup (`--full`): ViPE-L2 as `--reproduce vipe-parity --budget full` runs it
(256k steps, constant rate, the paper's fixed set of 32,768 sequences), seeds 0, 42 and 123, with
vipe_s_also=2: the paper's fine-tuning and test with s = 3, and with s = 2 on a copy of the same trained model.
With `--ramp` the two fine-tunings take 1000 steps with s rising linearly from 1 to 3 (and to 2 on the copy)
instead of the paper's 200 at the fixed s (vipe_ramp). `--readings` tables each reading of such runs: the
paper's, the one with the second s, and the three rules on the model as trained.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments import seed_metrics  # noqa: E402

VARIANTS = {   # name -> (depths, --method-opt items beyond vipe_finetune=200); base and cont evaluate during training
    "base": ((2,), []),
    "cont": ((2,), ["vipe_ft_optim=continued"]),
    "tanh": ((2,), ["vipe_code=tanh"]),
    "over_n": ((2,), ["vipe_code=over_n"]),
    "affine": ((2,), ["vipe_g=affine"]),
    "s2.83": ((2,), ["vipe_s_fixed=2.83"]),
    "s2": ((2,), ["vipe_s_fixed=2"]),
}


DURING = ("base", "cont")


def commands(task: str, seeds: str, out: str) -> list[str]:
    return [f"python train.py --task {task} --method vipe --preset gpu --n-layers {n} --tag L{n}-{name} "
            f"--seeds {seeds} --jobs {len(seeds.split(','))} " + ("--eval-every 1000 " if name in DURING else "")
            + "--method-opt vipe_finetune=200 "
            + "".join(f"--method-opt {o} " for o in opts) + f"--out {out} --device cuda"
            for name, (depths, opts) in VARIANTS.items() for n in depths]


FULL = ("python train.py --task {task} --method vipe --preset gpu --seeds {seeds} --jobs {jobs} --steps 256000 "
        "--weight-decay 0.0 --adam-eps 0.0001 --min-lr-ratio 1.0 --train-set 32768 --n-eval 2048 --tag L2-full-{tag} "
        "{finetune} --method-opt vipe_s_also=2 --compile --workers 4 --out {out} --device cuda")
FINETUNE = {"s2also": "--method-opt vipe_finetune=200",                              # the paper's 200 steps
            "ramp": "--method-opt vipe_finetune=1000 --method-opt vipe_ramp=true"}   # s rising from 1 over 1000


def value(rows, lo, hi, key="exact"):
    pts = [r for r in rows if lo <= r["length"] <= hi]
    return float(np.mean([r[key] for r in pts])) if pts and all(key in r for r in pts) else None


def spread(vals) -> str:
    vals = [v for v in vals if v is not None]
    return f"{np.mean(vals):.3f} ({min(vals):.2f}-{max(vals):.2f})" if vals else "-"


def best_checkpoint(m: dict):
    """(step, rows) of the paper's reading with the best exact match at 17-24 over the evaluations during
    training and the end (the later of equals; at the last step, the run's own rows)."""
    points = [(m["config"]["steps"], m["eval"])] + [(h["step"], h["final"]) for h in m.get("history", []) if "final" in h]
    return max(points, key=lambda p: (value(p[1], 17, 24), p[0]))


def table(task_dir: Path) -> str:
    lines = ["| run | seeds | 1-16 | 17-24 | 25-32 | 17-24 token | 17-24 final answer | as trained, s per length, "
             "17-24 | as trained, s = 1, 17-24 | best checkpoint by 17-24 (chosen on the test lengths): 1-16 / "
             "17-24, its steps |", "| --- |" + " --- |" * 9]
    for folder in sorted(task_dir.glob("vipe-L*-*")):
        ms = seed_metrics(folder)
        if not ms:
            continue
        ab = [m.get("eval_ablations", {}) for m in ms]
        per = [a.get("s = L / L_train_max per length, no fine-tuning") for a in ab]
        one = [a.get("s = 1, no fine-tuning") for a in ab]
        best = [best_checkpoint(m) for m in ms]
        lines.append(f"| {folder.name} | {len(ms)} | " + " | ".join([
            spread(value(m["eval"], 1, 16) for m in ms), spread(value(m["eval"], 17, 24) for m in ms),
            spread(value(m["eval"], 25, 32) for m in ms), spread(value(m["eval"], 17, 24, "token") for m in ms),
            spread(value(m["eval"], 17, 24, "last") for m in ms),
            spread(value(r, 17, 24) for r in per if r), spread(value(r, 17, 24) for r in one if r),
            f"{spread(value(rows, 1, 16) for _, rows in best)} / {spread(value(rows, 17, 24) for _, rows in best)}, "
            + ", ".join(str(step) for step, _ in best)]) + " |")
    return "\n".join(lines)


def how_tuned(metrics: dict) -> str:
    """How a run's own reading was fine-tuned: the paper's fixed s, or ramped to it (vipe_ramp)."""
    opts = metrics["config"]["model"].get("opts") or {}
    return (f"fine-tuned {opts.get('vipe_finetune')} steps with s ramped from 1 to the fixed s" if opts.get("vipe_ramp")
            else "fine-tuned with the fixed s")


def readings(task_dir: Path) -> str:
    """Per run folder, each reading of its seeds: the run's own (the paper's protocol) and every eval_ablations
    entry, exact match at 1-16 / 17-24 / 25-32, and at 17-24 per token and on the final answer."""
    lines = ["| run | reading | seeds | 1-16 | 17-24 | 25-32 | 17-24 token | 17-24 final answer |",
             "| --- |" + " --- |" * 7]
    for folder in sorted(task_dir.glob("vipe-L*")):
        ms = seed_metrics(folder)
        names = [f"the paper's reading: {how_tuned(ms[0])}"] + list(ms[0].get("eval_ablations", {}))
        for name in names if ms else []:
            got = [m["eval"] for m in ms] if name == names[0] else [m.get("eval_ablations", {}).get(name) for m in ms]
            got = [rows for rows in got if rows]
            s_used = sorted({r["s"] for rows in got for r in rows if 17 <= r["length"] <= 24})
            at = f"{s_used[0]:g}" + (f"-{s_used[-1]:g}" if len(s_used) > 1 else "")
            lines.append(f"| {folder.name} | {name} (s at 17-24: {at}) | {len(got)} | "
                         + " | ".join(spread(value(rows, lo, hi, key) for rows in got) for lo, hi, key in
                                      ((1, 16, "exact"), (17, 24, "exact"), (25, 32, "exact"), (17, 24, "token"),
                                       (17, 24, "last"))) + " |")
    return "\n".join(lines)


def plot_readings(task_dir: Path, path: Path) -> Path:
    """Exact match by length of each reading (`readings`) of the runs in task_dir/vipe-L*: the mean over seeds
    and the seeds' min-max, one panel per run folder."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from evaluation import save_atomic

    folders = [f for f in sorted(task_dir.glob("vipe-L*")) if seed_metrics(f)]
    fig, axes = plt.subplots(1, len(folders), figsize=(7 * len(folders), 4), squeeze=False)
    for ax, folder in zip(axes[0], folders):
        ms = seed_metrics(folder)
        named = {f"the paper's: {how_tuned(ms[0])}": [m["eval"] for m in ms]}
        named.update({name: [m["eval_ablations"][name] for m in ms] for name in ms[0].get("eval_ablations", {})})
        for name, runs in named.items():
            lengths = [r["length"] for r in runs[0]]
            acc = np.array([[r["exact"] for r in rows] for rows in runs])           # (seeds, lengths)
            line, = ax.plot(lengths, acc.mean(0), marker=".", label=name)
            ax.fill_between(lengths, acc.min(0), acc.max(0), color=line.get_color(), alpha=0.15)
        ax.axvline(ms[0]["train_max_length"], color="grey", linestyle="--", label="longest training length")
        ax.set(title=f"{folder.name} ({len(ms)} seeds; band: min-max)", xlabel="length", ylabel="exact match",
               ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_atomic(fig, path, dpi=90)
    plt.close(fig)
    return path


def rescore(results: Path) -> str:
    """The stored runs of ViPE and NoPE on the three synthetic tasks read three ways at 17-24 and 25-32: exact
    match per sequence, accuracy per token, and the final answer where the run recorded it (its rows' "last")."""
    lines = ["| task | run | seeds | 17-24 exact | 17-24 token | 17-24 final answer | 25-32 exact | 25-32 token | "
             "25-32 final answer |", "| --- |" + " --- |" * 8]
    for task in ("parity", "binary_copy", "polynomial"):
        for folder in sorted((results / task).glob("*")):
            ms = seed_metrics(folder)
            if not ms or not folder.name.startswith(("vipe", "nope")):
                continue
            cells = [spread(value(m["eval"], lo, hi, key) for m in ms)
                     for lo, hi in ((17, 24), (25, 32)) for key in ("exact", "token", "last")]
            lines.append(f"| {task} | {folder.name} | {len(ms)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task_dir", nargs="?", help="runs/<task>: print the table of its vipe-L*-* folders")
    p.add_argument("--commands", action="store_true", help="print the train.py command of each variant")
    p.add_argument("--rescore", action="store_true", help="task_dir is a results folder: read its stored ViPE and "
                   "NoPE runs per sequence, per token and on the final answer")
    p.add_argument("--readings", action="store_true", help="table every reading of the runs in task_dir")
    p.add_argument("--full", action="store_true", help="with --commands: the paper's setup, s = 3 and s = 2")
    p.add_argument("--ramp", action="store_true", help="with --full: the fine-tuning 1000 steps with s rising from 1 "
                   "(vipe_ramp), to 3 and, on the copy, to 2")
    p.add_argument("--plot", metavar="PNG", help="with --readings: also draw each reading by length")
    p.add_argument("--task", default="parity")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default="runs")
    a = p.parse_args(argv)
    if a.commands:
        tag = "ramp" if a.ramp else "s2also"
        print(FULL.format(task=a.task, seeds=a.seeds, jobs=len(a.seeds.split(",")), out=a.out, tag=tag,
                          finetune=FINETUNE[tag]) if a.full
              else "\n".join(commands(a.task, a.seeds, a.out)))
        return 0
    if not a.task_dir:
        p.error("give runs/<task> or --commands")
    print(rescore(Path(a.task_dir)) if a.rescore else readings(Path(a.task_dir)) if a.readings
          else table(Path(a.task_dir)))
    if a.plot:
        print(f"wrote {plot_readings(Path(a.task_dir), Path(a.plot))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
