"""How long one evaluation of an experiment's run takes, eager as the loop runs it and in other ways:
more tokens in a forward pass (`evaluation.evaluate`'s tokens_per_batch) and the model compiled with
dynamic shapes. Each way evaluates the same freshly initialised model on the same examples; their
counts of exact matches and right tokens are printed beside the time, so that a faster way that
changes the numbers shows it (bf16 passes of other sizes may move a few tokens).

    python docs/perf/eval_speed.py --experiment prism-more --budget full --task dyn_str_cpy --tokens 32768,131072
    python docs/perf/eval_speed.py --experiment prism-copy --task copy --device cpu --tiny --tokens 256,1024

Run it from the repository root. --tiny shrinks the model and the test set: a check that the script
runs, not a measurement. Results: docs/perf/training.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "docs/perf")
import train  # noqa: E402
from evaluation import evaluate  # noqa: E402
from step_profile import config, pick, run_options, say, sync  # noqa: E402
from tasks import TASKS  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_options(p)
    p.add_argument("--tokens", default="32768", help="comma-separated tokens per forward pass, each timed")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    a = p.parse_args(argv)
    device = train.device_of(a.device)
    cfg = config(pick(a.experiment, a.budget, a.task, a.label), device, a.tiny, False)
    task = TASKS[cfg.task]
    lengths = cfg.test_lengths or task.test_lengths
    if a.tiny:
        lengths = lengths[:: max(1, len(lengths) // 4)]
    torch.manual_seed(cfg.seed)
    model = train.build_model(cfg.model).to(device)
    where = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    say(f"{a.experiment} ({a.budget}) {cfg.task}/{cfg.run_dir().parent.name}: {len(lengths)} test lengths x "
        f"{cfg.n_eval} examples, {cfg.model.n_layers} layers, d={cfg.model.d_model}, on {where}")
    ways = [("eager", model)] + ([] if a.no_compile else [("compiled", torch.compile(model, dynamic=True))])
    rows = []
    for name, fwd in ways:
        for tokens in [int(t) for t in a.tokens.split(",")]:
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            sync(device)
            tic = time.perf_counter()
            out = evaluate(fwd, task, lengths, cfg.n_eval, cfg.seed, device, cfg.task_opts, stream=2,
                           tokens_per_batch=tokens, precision=cfg.precision)
            sync(device)
            seconds = time.perf_counter() - tic
            exact = sum(round(r["exact"] * r["n"]) for r in out)
            right = sum(r["token"] for r in out)
            peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.startswith("cuda") else 0.0
            rows.append(dict(way=name, tokens=tokens, seconds=seconds, exact=exact, token_sum=right, peak_gib=peak))
            say(f"  {name:8s} {tokens:7d} tokens a pass: {seconds:6.1f} s, {peak:5.1f} GiB at most; "
                f"exact {exact}, token accuracy summed over lengths {right:.4f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(experiment=a.experiment, budget=a.budget, task=cfg.task, device=where, lengths=len(lengths),
                           n_eval=cfg.n_eval, rows=rows, git=train.git_hash()), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
