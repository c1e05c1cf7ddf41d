"""What a run folder holds, finished or not: its trained model and its evaluations during training.

A finished run's folder holds metrics.json (its config and `history`, the evaluations during training) and
model.pt; a run stopped between visits to a GPU holds only its checkpoint (train.CKPT: the config, the weights,
the optimiser's state and the same history). `load_model` builds the model from either, so that the analysis
scripts (prism_cot_errors.py, prism_answer_copy.py, prism_precision.py) read a long run at any step; `history`
and the command line show its evaluations so far:

    python docs/perf/run_state.py runs/add_cot/prism-150k-full/seed0 [--every 4000] [--ranges 1-10,11-20,21-30]
    python docs/perf/run_state.py RUN --json OUT.json     # the evaluations, exact match by length, as JSON
    python docs/perf/run_state.py RUN [RUN ...] --ranges 11-20,21-30 --plot OUT.png   # the ranges over steps

A RUN may also be a JSON file that `--json` wrote (the evaluations of a checkpoint that is gone).

Run it from the repository root.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train  # noqa: E402
from evaluation import read_stored, stored  # noqa: E402
from model import ModelConfig  # noqa: E402
from tasks import TASKS  # noqa: E402


def read(run) -> tuple[dict, dict | None]:
    """(meta, state_dict or None): metrics.json(.gz) and model.pt if the run finished, else its checkpoint.
    meta has the run's task, method, config, history and train_max_length, and `step` for a checkpoint."""
    run = Path(run)
    if stored(run / "metrics.json"):
        meta = json.loads(read_stored(run / "metrics.json"))
        weights = run / "model.pt"
        return meta, (torch.load(weights, map_location="cpu") if weights.exists() else None)
    if (run / train.CKPT).exists():
        ckpt = torch.load(run / train.CKPT, map_location="cpu", weights_only=False)
        cfg = ckpt["config"]
        lengths = cfg.get("train_lengths") or TASKS[cfg["task"]].train_lengths            # as train.train
        meta = {"task": cfg["task"], "method": cfg["method"], "config": cfg, "history": ckpt["history"],
                "step": ckpt["step"], "train_max_length": max(lengths)}
        return meta, ckpt["model"]
    raise FileNotFoundError(f"{run}: neither metrics.json nor {train.CKPT}")


def load_model(run, device="cpu"):
    """(model in eval mode on device, meta) of a run folder, finished or from its checkpoint."""
    meta, weights = read(run)
    if weights is None:
        raise FileNotFoundError(f"{run}: metrics.json but no model.pt")
    model = train.build_model(ModelConfig(**meta["config"]["model"])).to(device)
    model.load_state_dict(weights)
    return model.eval(), meta


def history(meta: dict) -> list[dict]:
    """The evaluations during training: [{step, n, exact: {length: exact match}}], the first variant of each
    length (tasks with variants score each; this reads the plain one)."""
    rows = []
    for entry in meta.get("history") or []:
        exact = {}
        for r in entry["eval"]:
            exact.setdefault(int(r["length"]), float(r["exact"]))
        rows.append({"step": int(entry["step"]), "n": int(entry["eval"][0]["n"]), "exact": exact})
    return rows


def range_mean(row: dict, a: int, b: int) -> float | None:
    """One evaluation's mean exact match over the lengths a-b it has (None if it has none)."""
    got = [v for L, v in row["exact"].items() if a <= L <= b]
    return float(np.mean(got)) if got else None


def table(rows: list[dict], ranges: list[tuple[int, int]], every: int = 0) -> str:
    """Mean exact match over each range of lengths (those evaluated), one line per evaluation (every `every`
    steps, and the last)."""
    head = "| step | " + " | ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) + " |"
    lines = [head, "|" + " ---: |" * (len(ranges) + 1)]
    for i, r in enumerate(rows):
        if every and r["step"] % every and i != len(rows) - 1:
            continue
        cells = [f"{m:.3f}" if m is not None else "-" for m in (range_mean(r, a, b) for a, b in ranges)]
        lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def means(rows: list[dict], a: int, b: int) -> tuple[list[int], list[float]]:
    """(steps, mean exact match over the lengths a-b evaluated) of the evaluations that have any of them."""
    got = [(r["step"], range_mean(r, a, b)) for r in rows]
    return [step for step, m in got if m is not None], [m for _, m in got if m is not None]


def plot(series: dict[str, list[dict]], ranges: list[tuple[int, int]], out) -> list[tuple[str, list, list]]:
    """One line per run and range (a colour a run, a line style a range): exact match over training steps.
    Returns (label, steps, means) of each line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    lines, styles = [], ["-", "--", ":", "-."]
    for i, (name, rows) in enumerate(series.items()):
        for j, (a, b) in enumerate(ranges):
            label = f"{name}, {a}-{b}" if a != b else f"{name}, {a}"
            x, y = means(rows, a, b)
            ax.plot(x, y, styles[j % len(styles)], color=f"C{i}", label=label, linewidth=1.2)
            lines.append((label, x, y))
    ax.set_xlabel("training step")
    ax.set_ylabel("exact match (evaluations during training)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="run",
                   help="a seed's folder (metrics.json and model.pt, or a checkpoint), or a JSON file --json wrote")
    p.add_argument("--ranges", default="", help="lengths to average, e.g. 1-10,11-20 (default: each length)")
    p.add_argument("--every", type=int, default=0, help="one line every this many steps (default: every one)")
    p.add_argument("--json", help="write the evaluations (step, n, exact match by length) to this file (one run)")
    p.add_argument("--plot", help="draw each range's mean over the steps, every run on one figure (needs --ranges)")
    a = p.parse_intermixed_args(argv)                                # runs before and after options
    try:
        ranges = [tuple(int(x) for x in part.split("-")) for part in a.ranges.split(",")] if a.ranges else None
        assert ranges is None or all(len(r) == 2 and r[0] <= r[1] for r in ranges)
    except (ValueError, AssertionError):
        p.error(f"--ranges {a.ranges!r}: give ranges like 1-10,11-20")
    if a.json and len(a.runs) > 1:
        p.error("--json takes one run")
    if a.plot and not ranges:
        p.error("--plot needs --ranges")
    series = {}
    for run in a.runs:
        if str(run).endswith(".json") and Path(run).is_file():
            saved = json.loads(Path(run).read_text())
            rows = [{**r, "exact": {int(L): v for L, v in r["exact"].items()}} for r in saved["evaluations"]]
            print(f"{run}: the evaluations of {saved['run']} (checkpoint at step {saved['checkpoint_step']})")
            name = saved["run"]
        else:
            try:
                meta, _ = read(run)
            except FileNotFoundError as e:
                p.error(str(e))
            rows = history(meta)
            where = f"checkpoint at step {meta['step']}" if "step" in meta else "finished run"
            print(f"{run}: {meta['task']}, {meta['method']}, {where}; {len(rows)} evaluations during training")
            name = run
            if a.json:
                Path(a.json).write_text(json.dumps({"run": str(run), "checkpoint_step": meta.get("step"),
                                                    "evaluations": rows}))
        if rows:
            print(table(rows, ranges or [(L, L) for L in sorted(rows[-1]["exact"])], a.every))
        if a.json:
            print(f"wrote {a.json}")
        key = "/".join(Path(name).parts[-2:])                            # the label: label/seedN
        series[key if key not in series else str(run)] = rows
    if a.plot:
        plot(series, ranges, a.plot)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
