"""What a run folder holds, finished or not: its trained model and its evaluations during training.

A finished run's folder holds metrics.json (its config and `history`, the evaluations during training) and
model.pt; a run stopped between visits to a GPU holds only its checkpoint (train.CKPT: the config, the weights,
the optimiser's state and the same history). `load_model` builds the model from either, so that the analysis
scripts (prism_cot_errors.py, prism_answer_copy.py, prism_precision.py) read a long run at any step; `history`
and the command line show its evaluations so far:

    python docs/perf/run_state.py runs/add_cot/prism-150k-full/seed0 [--every 4000] [--ranges 1-10,11-20,21-30]
    python docs/perf/run_state.py RUN --json OUT.json     # the evaluations, exact match by length, as JSON

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


def table(rows: list[dict], ranges: list[tuple[int, int]], every: int = 0) -> str:
    """Mean exact match over each range of lengths (those evaluated), one line per evaluation (every `every`
    steps, and the last)."""
    head = "| step | " + " | ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) + " |"
    lines = [head, "|" + " ---: |" * (len(ranges) + 1)]
    for i, r in enumerate(rows):
        if every and r["step"] % every and i != len(rows) - 1:
            continue
        cells = []
        for a, b in ranges:
            got = [v for L, v in r["exact"].items() if a <= L <= b]
            cells.append(f"{np.mean(got):.3f}" if got else "-")
        lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a seed's folder: metrics.json (and model.pt) or a checkpoint")
    p.add_argument("--ranges", default="", help="lengths to average, e.g. 1-10,11-20 (default: each length)")
    p.add_argument("--every", type=int, default=0, help="one line every this many steps (default: every one)")
    p.add_argument("--json", help="write the evaluations (step, n, exact match by length) to this file")
    a = p.parse_args(argv)
    try:
        ranges = [tuple(int(x) for x in part.split("-")) for part in a.ranges.split(",")] if a.ranges else None
        assert ranges is None or all(len(r) == 2 and r[0] <= r[1] for r in ranges)
    except (ValueError, AssertionError):
        p.error(f"--ranges {a.ranges!r}: give ranges like 1-10,11-20")
    try:
        meta, _ = read(a.run)
    except FileNotFoundError as e:
        p.error(str(e))
    rows = history(meta)
    where = f"checkpoint at step {meta['step']}" if "step" in meta else "finished run"
    print(f"{a.run}: {meta['task']}, {meta['method']}, {where}; {len(rows)} evaluations during training")
    if not rows:
        return 0
    ranges = ranges or [(L, L) for L in sorted(rows[-1]["exact"])]
    print(table(rows, ranges, a.every))
    if a.json:
        Path(a.json).write_text(json.dumps({"run": str(a.run), "checkpoint_step": meta.get("step"),
                                            "evaluations": rows}))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
