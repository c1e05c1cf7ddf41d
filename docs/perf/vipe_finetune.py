"""Does ViPE's fine-tuning with the fixed s fit a fully trained model, and does a gentler schedule
extrapolate? From a checkpoint (its weights, and with --continued its Adam state), fine-tune on the CPU in
float32 on the run's own next batches at the run's final learning rate with a fresh AdamW (the loop's
`train.finetune`, vipe.py's default), once per schedule:

    fixed:N   N steps at s = L_test_max / L_train_max (the paper's protocol; the loop's vipe_finetune)
    ramp:N    N steps with s rising linearly from 1 to that s

and report exact match (in the JSON also token accuracy) per band of lengths, every length tested at
that fixed s (1-16 too: whether the fine-tuning fit the compressed distances), and with s per length;
next to them the checkpoint as it is (s = 1 and s per length).

    python docs/perf/vipe_finetune.py runs/parity/vipe/seed0/checkpoint.pt [...] \\
        [--schedules fixed:200,fixed:1000,ramp:1000] [--n 256] [--json OUT] [--data-from STEP]

--data-from STEP fine-tunes on the batches the run would draw from STEP on instead of from the checkpoint's
step: the same weights and schedule on other data, to see how much of a reading is the fine-tuning's draw.

Run it from the repository root. Results: docs/perf/vipe.md ("Long runs").
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, ".")
import train  # noqa: E402
from evaluation import evaluate  # noqa: E402
from tasks import TASKS  # noqa: E402
from vipe import compression, ramp  # noqa: E402
from vipe_margins import load  # noqa: E402   (docs/perf, this script's folder)

BANDS = ((1, 16), (17, 24), (25, 32), (33, 48))


def bands(rows) -> dict:
    """Mean exact match and token accuracy over each band's lengths."""
    out = {"exact": [], "token": []}
    for key in out:
        for lo, hi in BANDS:
            r = [x[key] for x in rows if lo <= x["length"] <= hi]
            out[key].append(sum(r) / len(r) if r else float("nan"))
    return out


def study(path: Path, schedules: list[tuple[str, int]], n: int, log=print, continued: bool = False,
          data_from: int | None = None) -> dict:
    cfg, model, step = load(path)
    start = step if data_from is None else data_from                 # the fine-tuning's first batch
    task = TASKS[cfg.task]
    opt_state = torch.load(path, map_location="cpu", weights_only=False)["opt"]
    lengths = cfg.test_lengths or task.test_lengths
    top, test_max = max(cfg.train_lengths or task.train_lengths), max(lengths)
    s_max = compression("fixed", test_max, top, test_max)

    def test(m, rule):
        """Exact match per band at every length under `rule` ("all": s_max everywhere), on the loop's test
        sets (every length in one call, as its evaluations draw them)."""
        s = (lambda L: s_max) if rule == "all" else (lambda L: compression(rule, L, top, test_max))
        return bands(evaluate(m, task, lengths, n, cfg.seed, "cpu", cfg.task_opts, s=s, precision="fp32"))
    out = {"checkpoint": str(path), "step": step, "data_from": start, "s": s_max, "n": n,
           "bands": [f"{a}-{b}" for a, b in BANDS],
           "as trained, s = 1": test(model, "one"), "as trained, s per length": test(model, "per_length"),
           "schedules": []}
    for schedule, steps in schedules:
        t0 = time.time()
        m = copy.deepcopy(model).train()
        opt = train.make_optimizer(m, cfg, "cpu")
        opt.load_state_dict(copy.deepcopy(opt_state))      # its tensors would be shared, and stepped, otherwise
        here = dataclasses.replace(cfg, steps=start, graphs=False, compile=False)   # its batches from there
        losses = train.finetune(m, m, opt, here, task, cfg.train_lengths or task.train_lengths, "cpu", {"stop": None},
                                steps, s_max if schedule == "fixed" else ramp(s_max, steps),  # the loop's vipe_ramp
                                fresh=not continued)
        worst = max(range(steps), key=losses.__getitem__)
        row = {"schedule": f"{schedule}:{steps}", "loss_first": losses[0], "loss_last_20": sum(losses[-20:]) / 20,
               "loss_max": losses[worst], "loss_max_at": worst + 1, "loss_every_100": losses[::100],
               "all at s": test(m, "all"), "s per length": test(m, "per_length"),
               "seconds": time.time() - t0}
        log(f"  {row['schedule']}: loss {row['loss_first']:.3g} -> {row['loss_last_20']:.3g} (highest "
            f"{row['loss_max']:.3g} at step {row['loss_max_at']}), exact at s = {s_max:g} "
            + " / ".join(f"{v:.3f}" for v in row["all at s"]["exact"]) + f" ({time.time() - t0:.0f} s)")
        out["schedules"].append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--schedules", default="fixed:200,fixed:1000,ramp:1000", help="NAME:STEPS, comma-separated")
    p.add_argument("--n", type=int, default=256, help="test sequences per length (default 256)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--continued", action="store_true", help="fine-tune with the checkpoint's Adam state "
                   "(vipe_ft_optim=continued) instead of a fresh AdamW")
    p.add_argument("--data-from", type=int, help="fine-tune on the run's batches from this step on (default: the "
                   "checkpoint's step)")
    a = p.parse_args(argv)
    if a.data_from is not None and a.data_from < 0:
        p.error(f"--data-from: a step >= 0, got {a.data_from}")
    schedules = [(x.split(":")[0], int(x.split(":")[1])) for x in a.schedules.split(",")]
    if any(name not in ("fixed", "ramp") or steps < 1 for name, steps in schedules):
        p.error(f"--schedules: each is fixed:N or ramp:N with N >= 1, got {a.schedules!r}")
    results = []
    for path in a.checkpoints:
        print(f"{path}:")
        results.append(study(path, schedules, a.n, continued=a.continued, data_from=a.data_from))
        r = results[-1]
        print(f"  step {r['step']}, exact at {' / '.join(r['bands'])} ({r['n']} per length):")
        exact = lambda b: " / ".join(f"{v:.3f}" for v in b["exact"])    # noqa: E731
        print("    as trained, s = 1:         " + exact(r["as trained, s = 1"]))
        print("    as trained, s per length:  " + exact(r["as trained, s per length"]))
        for row in r["schedules"]:
            print(f"    {row['schedule']:>10}, all at s = {r['s']:g}: {exact(row['all at s'])}; s per length: "
                  f"{exact(row['s per length'])} (loss {row['loss_first']:.3g} -> {row['loss_last_20']:.3g})")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
