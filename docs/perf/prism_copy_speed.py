"""Training steps/s of prism-more's tasks with PRISM's copy branch, with the scan on each backend:
does the Triton scan (kernels/prism_scan.py, HAS_COPY) make them train faster than the PyTorch loop?

    python docs/perf/prism_copy_speed.py --steps 200 --torch-steps 30 [--out FILE.json]
    python docs/perf/prism_copy_speed.py --device cpu --steps 2 --torch-steps 2 --tiny

Each task of experiments.py's prism-more that sets prism_copy (reverse, dyn_str_cpy, scan_cot) is
trained with its quick-budget settings (the GPU preset, seed 0) by train.train, for --steps steps with
prism.BACKEND = "triton" and --torch-steps with "torch"; steps/s is the run's own (its loop's time
after the first steps, which compile the kernels). --tiny shrinks the model (a check that the script
runs, not a measurement). Run it from the repository root. Results: docs/perf/prism.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch

sys.path.insert(0, ".")
import cli          # noqa: E402
import experiments  # noqa: E402
import prism        # noqa: E402
import train        # noqa: E402
from tasks import TASKS  # noqa: E402


def speed(run: dict, backend: str, steps: int, device: str, tiny: bool) -> dict:
    prism.BACKEND = backend
    with tempfile.TemporaryDirectory() as tmp:
        lengths = run.get("train_lengths") or TASKS[run["task"]].train_lengths
        values = {**run, "steps": steps, "device": device, "out": tmp, "n_eval": 2, "ckpt_every": 10 ** 9,
                  "log_every": 1e9, "test_lengths": [max(lengths)]}
        if tiny:
            values.update(d_model=32, n_layers=1, n_heads=2, batch_size=4,
                          opts={**run["opts"], "prism_bins": 16, "prism_dim": 16})
        m = train.train(cli.make_config(values, "gpu"), log=lambda *_: None)
    return {"task": run["task"], "backend": backend, "steps": steps, "steps_per_s": m["steps_per_s"],
            "batch": m["config"]["batch_size"], "device": m["device"], "git": m["git"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps with the Triton scan (0: skip)")
    p.add_argument("--torch-steps", type=int, default=30, help="steps with the PyTorch loop (0: skip)")
    p.add_argument("--device", default="auto")
    p.add_argument("--tiny", action="store_true", help="a tiny model: checks that the script runs")
    p.add_argument("--out", help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    device = train.device_of(args.device)
    runs = [r for r in experiments.EXPERIMENTS["prism-more"].runs if r.get("opts", {}).get("prism_copy")]
    rows = []
    for run in runs:
        for backend, steps in (("triton", args.steps), ("torch", args.torch_steps)):
            if steps:
                rows.append(speed(run, backend, steps, device, args.tiny))
                print(f"{run['task']:12s} {backend:6s} {rows[-1]['steps_per_s']:8.2f} steps/s "
                      f"(batch {rows[-1]['batch']}, {steps} steps, {rows[-1]['device']})", flush=True)
        pair = [r for r in rows if r["task"] == run["task"]]
        if len(pair) == 2:
            print(f"{run['task']:12s} triton / torch: {pair[0]['steps_per_s'] / pair[1]['steps_per_s']:.1f}x",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
