"""What happens inside a long run when its loss leaves zero: one run of train.py's loop (the same
model, optimiser, schedule, CUDA-graph step and data stream), with every `--every` steps a record of

    loss      mean, min and max of the training loss over the interval (a spike shows in max)
    logit     the largest |attention logit| of each layer on 16 fixed training sequences
    grad      the gradient norm on those sequences (before clipping)
    adam      quantiles of sqrt(v), Adam's second-moment root, over every parameter, and the share
              of parameters with sqrt(v) < 10 eps (an update m / (sqrt(v) + eps) there is ~ lr
              however small the gradient)
    params    the norm of all parameters, and of ViPE's key-factor vector u where there is one
    exact     (every --eval-every steps) exact match at s = 1 on lengths 1-16 and 17-24

one JSON object per record, appended to OUT as it is made (a run stopped by --seconds keeps all
its records). Settings are train.py's flags as key=value (TrainConfig or ModelConfig fields):

    python docs/perf/vipe_stability.py OUT.jsonl method=vipe task=parity steps=60000 \\
        weight_decay=0 precision=bf16 --seconds 500

Run it from the repository root. Results: docs/perf/vipe.md ("Long runs").
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
import cli    # noqa: E402
import train  # noqa: E402
import evaluation  # noqa: E402
from model import autocast, batch_context, largest_logits  # noqa: E402
from tasks import IGNORE, TASKS  # noqa: E402


def adam_stats(opt, eps: float) -> dict:
    roots = torch.cat([st["exp_avg_sq"].sqrt().flatten().float() for st in opt.state.values() if "exp_avg_sq" in st])
    q = torch.quantile(roots[torch.randperm(len(roots), device=roots.device)[:100_000]],
                       torch.tensor([0.01, 0.5, 0.99], device=roots.device)).tolist()
    return {"sqrt_v_q01": q[0], "sqrt_v_median": q[1], "sqrt_v_q99": q[2],
            "below_10eps": float((roots < 10 * eps).float().mean())}


def grad_norm(model, task, probe, device, precision) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    with autocast(device, precision):
        logits = model(probe.x.to(device), batch_context(task, probe, device))
    loss = F.cross_entropy(logits.float().flatten(0, 1), probe.y.to(device).flatten(), ignore_index=IGNORE)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("settings", nargs="+", help="key=value")
    p.add_argument("--seconds", type=float, default=1e9, help="stop after this long (records kept)")
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=5000)
    a = p.parse_args(argv)
    device = train.device_of("auto")
    values = {"device": device, "graphs": device == "cuda", "workers": 1 if device == "cuda" else 0}
    for item in a.settings:
        k, v = item.split("=", 1)
        try:
            values[k] = json.loads(v)
        except json.JSONDecodeError:
            values[k] = v
    cfg = cli.make_config(values, "gpu" if device == "cuda" else "cpu")
    task = TASKS[cfg.task]
    cfg.model.vocab_size, cfg.model.causal = len(task.vocab), task.causal
    lengths = cfg.train_lengths or task.train_lengths
    torch.manual_seed(cfg.seed)
    model = train.build_model(cfg.model).to(device)
    opt = train.make_optimizer(model, cfg, device)
    step_fn = train.Step(model, model, opt, cfg, task, device)
    probe = task.sample(16, max(lengths), np.random.default_rng([cfg.seed, 3]), **cfg.task_opts)
    u = [m.u for m in model.modules() if hasattr(m, "u") and isinstance(m.u, torch.nn.Parameter)]
    t0, pending = time.time(), []
    with open(a.out, "a") as f:
        f.write(json.dumps({"config": {k: v for k, v in values.items()}, "git": train.git_hash()}) + "\n")
        for step, batch in enumerate(train.batches(cfg, task, lengths, 0, cfg.steps), start=1):
            train.set_lr(opt, train.lr_at(step - 1, cfg))
            pending.append(step_fn(batch))
            if step % a.every and step != cfg.steps:
                continue
            losses = torch.stack(pending).float()
            pending.clear()
            with autocast(device, cfg.precision):
                logits = largest_logits(model, probe.x.to(device), batch_context(task, probe, device))
            with torch.no_grad():
                norm = float(torch.sqrt(sum((q.float() ** 2).sum() for q in model.parameters())))
            rec = {"step": step, "s": round(time.time() - t0, 1), "lr": train.lr_at(step - 1, cfg),
                   "loss_mean": float(losses.mean()), "loss_min": float(losses.min()), "loss_max": float(losses.max()),
                   "logit": logits, "grad": grad_norm(model, task, probe, device, cfg.precision),
                   **adam_stats(opt, cfg.adam_eps),
                   "param_norm": norm,
                   "u_norm": [float(x.norm()) for x in u]}
            if step % a.eval_every == 0 or step == cfg.steps:
                rows = evaluation.evaluate(model, task, list(range(1, 25)), 64, cfg.seed, device, cfg.task_opts,
                                      precision=cfg.precision)
                rec["exact_1_16"] = float(np.mean([r["exact"] for r in rows if r["length"] <= 16]))
                rec["exact_17_24"] = float(np.mean([r["exact"] for r in rows if r["length"] > 16]))
            f.write(json.dumps(rec) + "\n")
            f.flush()
            if not all(np.isfinite([rec["loss_max"]])) or time.time() - t0 > a.seconds:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
