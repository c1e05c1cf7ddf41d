"""Does a run's training loss stay down once it got there? For each run folder: the step where the
loss first fell below 0.01, the highest loss after that step (and where); the step from which it
first stayed below 0.01 for --window steps (the end of the learning phase, where a single low batch
does not count), the highest loss after that, how often it jumped back to 1 or more after that, the
last jump's step and the most steps one took to fall below 0.01 again (None: one never did); the
largest attention logit at the first and last checkpoints, the in-distribution exact match (s = 1
rows) where the run has finished; from metrics.json (its loss_peak) or, for a run still going, from
checkpoint.pt (every loss). With --every N, also each N-step interval's highest loss and largest
logit, the timeline of a run that leaves zero loss.

    python docs/perf/loss_jumps.py runs/parity/vipe-wd0-long/seed* [--json OUT] [--every 5000] [--window 1000]
    python docs/perf/loss_jumps.py A.json B.json --plot docs/vipe_long_runs.png   # earlier --json outputs, drawn

With --plot, each run's intervals (from --every, or from a JSON file written with it) as two panels:
the highest loss of each interval (log scale) and the largest attention logit.

Run it from the repository root. Results: docs/perf/vipe.md ("Long runs").
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from evaluation import checkpoint_losses, read_stored, stored  # noqa: E402


def settled(losses, window: int):
    """The first step from which every loss of the next `window` steps is below 0.01, or None."""
    start = None
    for s, v in losses:
        if v >= 0.01:
            start = None
        elif start is None:
            start = s
        if start is not None and s - start + 1 >= window:
            return start
    return None


def jumps(losses, after, high: float = 1.0) -> list:
    """[step, steps until the loss is below 0.01 again (None: never)] for each time after step `after`
    (None: no time) that the loss rises to `high` or more from below it: the jumps of a settled run."""
    out, before = [], 0.0
    for k, (s, v) in enumerate(losses):
        if after is not None and s > after and v >= high > before:
            back = next((t for t, w in losses[k:] if w < 0.01), None)
            out.append([s, None if back is None else back - s])
        before = v
    return out


def summary(run: Path, every: int = 0, window: int = 1000) -> dict:
    if stored(run / "metrics.json"):
        m = json.loads(read_stored(run / "metrics.json"))
        losses, logits, done = m.get("loss_peak") or m["loss"], m.get("logit_max", []), True
        train_max = m["train_max_length"]
        exact = [r["exact"] for r in m["eval"] if r["length"] <= train_max]
        in_dist = sum(exact) / len(exact) if exact else None
    else:
        ckpt = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=False)
        losses, logits, done, in_dist = checkpoint_losses(ckpt["losses"]), ckpt.get("logit_max", []), False, None
    first = next((s for s, v in losses if v < 0.01), None)
    after = [(v, s) for s, v in losses if first is not None and s > first]
    peak, at = max(after) if after else (None, None)
    calm = settled(losses, window)
    late = [(v, s) for s, v in losses if calm is not None and s >= calm]
    late_peak, late_at = max(late) if late else (None, None)
    back = jumps(losses, calm)
    longest = None if any(t is None for _, t in back) else max((t for _, t in back), default=None)
    row = {"run": str(run), "finished": done, "steps": losses[-1][0] if losses else 0,
           "first_below_0.01": first, "max_loss_after": peak, "at_step": at,
           f"below_0.01_for_{window}": calm, "max_loss_after_that": late_peak, "at_step_after_that": late_at,
           "jumps_to_1_after_that": len(back), "last_jump": back[-1][0] if back else None,
           "longest_return_below_0.01": longest,
           "logit_max_first": max(logits[0][1]) if logits else None,
           "logit_max_last": max(logits[-1][1]) if logits else None, "in_dist_exact": in_dist}
    if every:
        row["intervals"] = intervals(losses, logits, every)
    return row


def intervals(losses, logits, every: int) -> list:
    """[end step, highest loss, largest logit] of each `every` steps (steps end - every + 1 .. end);
    the logit is None where no checkpoint fell in the interval."""
    last = losses[-1][0] if losses else 0
    out = []
    for end in range(every, last + every, every):
        loss = [v for s, v in losses if end - every < s <= end]
        logit = [max(v) for s, v in logits if end - every < s <= end]
        out.append([min(end, last), max(loss) if loss else None, max(logit) if logit else None])
    return out


def plot(rows, path: Path):
    """Two panels over the training steps: each interval's highest loss, and its largest logit."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for r in rows:
        steps = [end for end, _, _ in r["intervals"]]
        top.plot(steps, [loss for _, loss, _ in r["intervals"]], marker=".", label=r["label"])
        bottom.plot(steps, [logit for _, _, logit in r["intervals"]], marker=".", label=r["label"])
    top.set(yscale="log", ylabel="highest training loss of the interval")
    bottom.set(xlabel="step", ylabel="largest attention logit", yscale="log")
    top.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def read(run: Path, every: int, window: int, name: str | None = None) -> list[dict]:
    """The rows of a run folder (one), or of a JSON file that --json wrote, each labelled for the plot:
    `name` (else the file's folder and name, since two files may hold runs of one folder) and its run's."""
    if run.suffix == ".json":
        rows = json.loads(run.read_text())
        return [{**r, "label": f"{name or run.parent.name + '/' + run.stem}: {Path(r['run']).name}"} for r in rows]
    return [{**summary(run, every, window), "label": f"{name}: {run.name}" if name else str(run)}]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders, or JSON files that --json wrote")
    p.add_argument("--json", help="also write the summaries here")
    p.add_argument("--every", type=int, default=0, help="also the highest loss and largest logit of every N steps")
    p.add_argument("--window", type=int, default=1000, help="steps the loss must stay below 0.01 to count as settled")
    p.add_argument("--plot", type=Path, help="draw every run's intervals here (a .png)")
    p.add_argument("--names", help="comma-separated, one per run folder or JSON file: their labels in the plot")
    a = p.parse_args(argv)
    names = a.names.split(",") if a.names else [None] * len(a.runs)
    if len(names) != len(a.runs):
        p.error(f"--names has {len(names)} names for {len(a.runs)} inputs")
    rows = [row for run, name in zip(a.runs, names) for row in read(run, a.every, a.window, name)]
    if a.plot and not all(r.get("intervals") for r in rows):
        p.error("--plot needs every run's intervals: give --every N, or JSON files written with it")
    for r in rows:
        print(" | ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                         if k not in ("intervals", "label")))
        for end, loss, logit in r.get("intervals", []):
            print(f"  to step {end:>7}: highest loss " + ("-" if loss is None else f"{loss:.2g}") + ", largest logit " +
                  ("-" if logit is None else f"{logit:.4g}"))
    if a.json:
        Path(a.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "label"} for r in rows], indent=1))
    if a.plot:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
