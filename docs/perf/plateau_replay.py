"""Can one unlucky batch knock a run off its zero-loss plateau? From a checkpoint (its weights and
Adam's state), train the run's own next batches again on the CPU in float32, with the first step's
gradient multiplied by c (a batch whose loss, and so gradient, is c times the plateau's), and
report the highest loss of the steps after it, for each c and each Adam epsilon given. Also the
quantiles of sqrt(v), Adam's second-moment root, at the checkpoint: where it lies far below eps, a
gradient well above eps is taken as a step of about (1 - beta1) / sqrt(1 - beta2) = 3.2 learning
rates on every weight at once.

    python docs/perf/plateau_replay.py runs/parity/vipe/seed0/checkpoint.pt [...] [--steps 20] \\
        [--scales 1,10,100,1000,10000] [--eps 1e-6,1e-5,1e-4] [--json OUT]

Run it from the repository root. Results: docs/perf/vipe.md ("Long runs").
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
import train  # noqa: E402
from model import batch_context  # noqa: E402
from tasks import IGNORE, TASKS  # noqa: E402
from vipe_margins import load  # noqa: E402   (docs/perf, this script's folder)


def loss_of(model, task, batch):
    logits = model(batch.x, batch_context(task, batch, "cpu"))                     # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), batch.y.flatten(), ignore_index=IGNORE)


def replay(path: Path, steps: int, scales: list[float], epsilons: list[float]) -> dict:
    cfg, model, step = load(path)
    opt_state = torch.load(path, map_location="cpu", weights_only=False)["opt"]
    task = TASKS[cfg.task]
    batches = list(train.batches(cfg, task, cfg.train_lengths or task.train_lengths, step, step + steps + 1))
    opt = train.make_optimizer(model, cfg, "cpu")
    opt.load_state_dict(copy.deepcopy(opt_state))
    roots = torch.cat([s["exp_avg_sq"].sqrt().flatten() for s in opt.state.values()])
    out = {"checkpoint": str(path), "step": step, "sqrt_v": {q: float(roots.quantile(q)) for q in (0.1, 0.5, 0.9)},
           "below_eps": {eps: float((roots < eps).float().mean()) for eps in epsilons}, "runs": []}
    for eps in epsilons:
        for c in scales:
            m = copy.deepcopy(model).train()
            opt = train.make_optimizer(m, cfg, "cpu")
            opt.load_state_dict(copy.deepcopy(opt_state))    # its tensors would be shared, and stepped, otherwise
            for g in opt.param_groups:
                g["eps"] = eps
            losses = []
            for k, batch in enumerate(batches):
                train.set_lr(opt, train.lr_at(step + k, cfg))
                opt.zero_grad(set_to_none=True)
                loss = loss_of(m, task, batch)
                losses.append(loss.item())
                if k == steps:                                 # the last batch: its loss after the steps
                    break
                (loss * (c if k == 0 else 1.0)).backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.grad_clip)
                opt.step()
            out["runs"].append({"eps": eps, "scale": c, "first_loss": losses[0], "highest_after": max(losses[1:]),
                                "last": losses[-1]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--steps", type=int, default=20, help="steps replayed from the checkpoint (default 20)")
    p.add_argument("--scales", default="1,10,100,1000,10000", help="factors on the first step's gradient")
    p.add_argument("--eps", default="1e-6,1e-5,1e-4", help="Adam epsilons to replay with")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    scales, epsilons = [float(x) for x in a.scales.split(",")], [float(x) for x in a.eps.split(",")]
    results = [replay(path, a.steps, scales, epsilons) for path in a.checkpoints]
    for r in results:
        print(f"{r['checkpoint']} (step {r['step']}): sqrt(v) 10/50/90 % " +
              " / ".join(f"{v:.2g}" for v in r["sqrt_v"].values()) + "; below eps " +
              ", ".join(f"{eps:g}: {share:.0%}" for eps, share in r["below_eps"].items()))
        for eps in epsilons:
            print(f"  eps {eps:g}, highest loss in {a.steps} steps after a first gradient times c: " +
                  ", ".join(f"x{x['scale']:g} {x['highest_after']:.2g}" for x in r["runs"] if x["eps"] == eps))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
