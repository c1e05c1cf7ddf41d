"""Which half of ViPE's s moves a trained model: the distance compression or the logit factor?

ViPE's s enters twice (vipe.py): the value code p = W_p (n - i) / s + b_p and the logit factor
lambda = s log(n) (1 + u.k). Either half can be undone by a weight change: W_p x s gives the code
back its s = 1 values, W_q / s (the query half of the layer's q/k projection) cancels the factor s
in the logits (tests/test_vipe.py checks both identities). This script evaluates one trained ViPE
run at the fixed s = 48 / 16 and at s = L / 16 per length, with each half alone:

    python train.py --method vipe --task parity --preset gpu --tag diag --out runs
    python docs/perf/vipe_s_halves.py runs/parity/vipe-diag/seed0

Run it from the repository root. Results: docs/perf/vipe.md ("Which half of s").
"""
import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cli    # noqa: E402
import evaluation  # noqa: E402
import train  # noqa: E402
from tasks import TASKS  # noqa: E402
from vipe import ViPEAttention  # noqa: E402

TRAIN_MAX, TEST_MAX, N = 16, 48, 128


def load(run: Path):
    m = json.loads((run / "metrics.json").read_text())
    values = {k: v for k, v in m["config"].items() if k != "model"} | m["config"]["model"]
    cfg = cli.make_config(values, "gpu")
    task = TASKS[cfg.task]
    cfg.model.vocab_size, cfg.model.causal = len(task.vocab), task.causal
    model = train.build_model(cfg.model)
    model.load_state_dict(torch.load(run / "model.pt", map_location="cpu"))
    return model, task, cfg


def undo(model, s: float, distances: bool, logits: bool):
    """A copy of model whose layers, run at s, act as if that half of s were 1."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, ViPEAttention):
                if distances:
                    layer.w_p.mul_(s)
                if logits:
                    C = layer.qk.weight.shape[1]
                    layer.qk.weight[:C].div_(s)                  # rows 0..C-1 of the q/k projection: W_q
    return model


def exact(model, task, cfg, lengths, s: float) -> dict:
    """Exact match per length with every layer at s (the "fixed" rule with test_max = 16 s)."""
    rows = evaluation.evaluate(model, task, lengths, N, 0, "cpu", cfg.task_opts, s=lambda L: s if L > TRAIN_MAX else 1.0)
    return {r["length"]: r["exact"] for r in rows}


def band(acc: dict, lo: int, hi: int) -> float:
    return float(np.mean([e for L, e in acc.items() if lo <= L <= hi]))


HALVES = [("both halves", False, False), ("the logit factor only (W_p x s)", True, False),
          ("the distance compression only (W_q / s)", False, True), ("neither (as s = 1)", True, True)]

if __name__ == "__main__":
    model, task, cfg = load(Path(sys.argv[1]))
    s = TEST_MAX / TRAIN_MAX
    print(f"fixed s = {s:g}, exact match at 1-16 / 17-24 / 25-32 ({N} examples per length):")
    for name, d, lg in HALVES:
        acc = exact(undo(model, s, d, lg), task, cfg, list(range(1, 33)), s)
        print(f"  {name:42s} {band(acc, 1, 16):.3f} / {band(acc, 17, 24):.3f} / {band(acc, 25, 32):.3f}")
    print("s = L / 16 at each length L of 17-32, exact match at 17-24 / 25-32:")
    for name, d, lg in HALVES:
        acc = {}
        for L in range(17, 33):
            acc |= exact(undo(model, L / TRAIN_MAX, d, lg), task, cfg, [L], L / TRAIN_MAX)
        print(f"  {name:42s} {band(acc, 17, 24):.3f} / {band(acc, 25, 32):.3f}")
