"""How close a trained ViPE model is to a decision that rounding could flip. For each checkpoint
(checkpoint.pt or a before-jump-<step>.pt that the loop keeps) on the run's own training stream:

    loss      each sequence's highest token loss, with the model in float32 and under bf16 autocast
              (mean, max, and how many sequences are above 0.05)
    gap       per ViPE layer, the gap between the two largest logits of each attention row (rows
              with two keys or more; logits in float64 from the layer's q, k and u): quantiles, and
              the rows whose gap is below 1
    moved     per ViPE layer, the rows whose largest logit is at another key under bf16

    python docs/perf/vipe_margins.py runs/parity/vipe/seed0/checkpoint.pt [...] [--batches 8] [--json OUT]

Run it from the repository root, on any machine (it runs on the CPU). bf16 is the CPU's autocast:
the same rounding of each value as on a GPU, not the GPU's kernels. Results: docs/perf/vipe.md
("Long runs").
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
import train  # noqa: E402
import vipe   # noqa: E402
from model import ModelConfig, batch_context, causal_mask  # noqa: E402
from tasks import IGNORE, TASKS  # noqa: E402

_logits = []   # the (B, H, T, T) float64 logits of each ViPE call of the current forward pass
_real = vipe.vipe_attention


def _recording(q, k, v, u, w_p, b_p, s=1.0, rescale=True, code="linear", g=None):
    T, D = q.shape[-2], q.shape[-1]
    n = torch.arange(1, T + 1, dtype=torch.float64, device=q.device)
    q64, k64 = q.double(), k.double()
    logits = q64 @ k64.transpose(-1, -2) / math.sqrt(D)                          # (B, H, T, T)
    if rescale:
        factor = s if g is None else g.double()[:, None, None]                   # g(s) per head (vipe_g=affine)
        logits = logits * (factor * torch.log(n)[:, None] * (1 + k64 @ u.double()[:, :, None]).transpose(-1, -2))
    _logits.append(logits.masked_fill(~causal_mask(T, q.device), -math.inf))
    return _real(q, k, v, u, w_p, b_p, s, rescale, code, g)


def load(path: Path):
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    values = dict(ckpt["config"])
    cfg = train.TrainConfig(**{**values, "model": ModelConfig(**values["model"]), "device": "cpu", "workers": 0})
    model = train.build_model(cfg.model)
    model.load_state_dict(ckpt["model"])
    return cfg, model.eval(), ckpt["step"]


@torch.no_grad()
def probe(path: Path, batches: int) -> dict:
    cfg, model, step = load(path)
    task = TASKS[cfg.task]
    worst = {"fp32": [], "bf16": []}
    gaps, moved, largest, rows = [], [], [], 0
    for batch in train.batches(cfg, task, cfg.train_lengths or task.train_lengths, 0, batches):
        ctx = batch_context(task, batch, "cpu")
        seen = {}
        for mode in ("fp32", "bf16"):
            _logits.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
                out = model(batch.x, ctx).float()                                # (B, T, V)
            loss = F.cross_entropy(out.transpose(1, 2), batch.y, ignore_index=IGNORE, reduction="none")  # (B, T)
            worst[mode].append(loss.max(1).values)
            seen[mode] = list(_logits)
        for layer, (a, b) in enumerate(zip(seen["fp32"], seen["bf16"])):
            top = a[..., 1:, :].topk(2, dim=-1).values                             # rows with >= 2 keys
            if len(gaps) <= layer:
                gaps.append([]), moved.append(0), largest.append(0.0)
            gaps[layer].append((top[..., 0] - top[..., 1]).flatten())
            largest[layer] = max(largest[layer], float(a[torch.isfinite(a)].abs().max()))
            moved[layer] += int((a.argmax(-1) != b.argmax(-1))[..., 1:].sum())
        rows += seen["fp32"][0][..., 1:, 0].numel()
    out = {"checkpoint": str(path), "step": step, "sequences": int(sum(len(w) for w in worst["fp32"])), "rows": rows}
    for mode, w in worst.items():
        w = torch.cat(w)
        out[f"loss_{mode}"] = {"mean": float(w.mean()), "max": float(w.max()), "above_0.05": int((w > 0.05).sum())}
    out["layers"] = []
    for layer, g in enumerate(gaps):
        g = torch.cat(g)
        out["layers"].append({"largest_logit": largest[layer], "gap_q01": float(g.quantile(0.01)), "gap_q10": float(g.quantile(0.1)),
                              "gap_median": float(g.median()), "rows_gap_below_1": int((g < 1).sum()),
                              "rows_moved_by_bf16": moved[layer]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--batches", type=int, default=8, help="training batches of the run's stream (default 8)")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    vipe.vipe_attention = _recording
    results = [probe(path, a.batches) for path in a.checkpoints]
    for r in results:
        print(f"{r['checkpoint']} (step {r['step']}, {r['sequences']} sequences): highest loss per sequence, "
              + "; ".join(f"{m} mean {r[f'loss_{m}']['mean']:.3g} max {r[f'loss_{m}']['max']:.3g} "
                          f"above 0.05 {r[f'loss_{m}']['above_0.05']}" for m in ("fp32", "bf16")))
        for k, layer in enumerate(r["layers"]):
            print(f"  ViPE layer {k + 1}: largest logit {layer['largest_logit']:.4g}; gap between the two largest "
                  f"logits q01 {layer['gap_q01']:.3g} q10 {layer['gap_q10']:.3g} median {layer['gap_median']:.3g}, "
                  f"below 1 in {layer['rows_gap_below_1']} of {r['rows']} rows; top key moved by bf16 in "
                  f"{layer['rows_moved_by_bf16']}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
