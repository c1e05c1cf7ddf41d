"""Past the training length, do add_cot's PRISM cursors blur, or do they reach bins they never reached in training?

For each cursor (query and key side, every head), on n sums a length, teacher-forced: its histogram at each step's
sum digit d (position `=` + 5k + 4), read two ways. Its peak (the largest bin's mass): a cursor whose mass spreads
over neighbouring bins has a low peak. Its centre (the mass-weighted mean bin), against the largest centre the same
cursor reaches on the sums of the first length given (the training length): a cursor past it sits on bins that the
first length never showed it. Per step k: the share of cursors past their first-length reach (by more than half a
bin) and the 10 % quantile of the peaks, over cursors and sums; then, at the last length, the cursors past their
reach in most sums at the steps past the first length, by head (a head's cursors serve it in every block).

    python docs/perf/prism_hist_reach.py RUN 10,12,14 [n]     # RUN: a finished run, or only its checkpoint

The histograms are those of the position update before the first block that reads them (prism_blocks). Run it
from the repository root. Results: docs/results/reproduce/full-budget-findings.md ("At the paper's 150k steps").
"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, ".")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import prism  # noqa: E402
from model import batch_context  # noqa: E402
from run_state import load_model  # noqa: E402
from tasks import TASKS  # noqa: E402


def histograms(model, task, batch) -> torch.Tensor:
    """The first position update's histograms on the batch: (2, B, H O, T, P), query cursors then key cursors."""
    found, before = [], prism.PrismHooks.before_block

    def keep(self, i, h, ctx):
        before(self, i, h, ctx)
        if i == self.blocks[0]:
            found.append(ctx["prism_hist"].detach().float())
    prism.PrismHooks.before_block = keep
    try:
        with torch.no_grad():
            model(batch.x, batch_context(task, batch, "cpu"))
    finally:
        prism.PrismHooks.before_block = before
    return found[0]


def at_steps(task, x: torch.Tensor, hist: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(centre, peak) of every cursor's histogram at each step's d: (L, B, 2, H O) each."""
    P = hist.shape[-1]
    centre, peak = (hist * torch.arange(P)).sum(-1), hist.max(-1).values          # (2, B, H O, T)
    eq = (x == task.stoi["="]).int().argmax(1)
    rows = torch.arange(len(x))
    return (torch.stack([centre[:, rows, :, eq + 5 * k + 4] for k in range(L)]),
            torch.stack([peak[:, rows, :, eq + 5 * k + 4] for k in range(L)]))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run, lengths, n = Path(argv[0]), [int(a) for a in argv[1].split(",")], int(argv[2]) if len(argv) > 2 else 32
    model, meta = load_model(run)                        # a finished run, or a checkpoint at any step
    task = TASKS[meta["task"]]
    if task.name != "add_cot" or meta["method"] != "prism":
        raise SystemExit(f"{run}: a PRISM add_cot run, not {meta['method']} on {task.name}")
    rng = np.random.default_rng(7)
    steps = {}
    for L in lengths:
        batch = task.sample(n, L, rng)
        steps[L] = at_steps(task, batch.x, histograms(model, task, batch), L)
    reach = steps[lengths[0]][0].amax(dim=(0, 1))                                  # (2, H O): each cursor's reach
    print(f"{run}: per step k, the share of cursors whose centre is past their reach at {lengths[0]} digits, and "
          f"the 10 % quantile of their peaks ({n} sums a length; query / key cursors)")
    for L in lengths:
        centre, peak = steps[L]
        past = (centre > reach + 0.5).float().mean(1)                              # (L, 2, H O) -> share per side
        cells = [f"k={k}: {past[k, 0].mean():.2f} / {past[k, 1].mean():.2f}, "
                 f"{peak[k, :, 0].quantile(0.1):.2f} / {peak[k, :, 1].quantile(0.1):.2f}" for k in range(L)]
        print(f"{L} digits: " + "; ".join(cells))
    last, first = lengths[-1], lengths[0]
    if last > first:                                     # which cursors: over the steps past the first length
        H = model.cfg.n_heads
        past = (steps[last][0][first:] > reach + 0.5).float().mean((0, 1)).view(2, H, -1)   # (2, H, O)
        held = [(h, side, c) for h in range(H) for side in (0, 1) for c in range(past.shape[-1])
                if past[side, h, c] > 0.5]
        heads = sorted({h for h, _, _ in held})
        print(f"\npast their reach in most sums at steps {first}-{last - 1} of {last} digits ({len(heads)} of {H} "
              "heads; head: query cursors q<c>, key cursors k<c>):")
        print("  " + "; ".join(f"{h}: " + " ".join(f"{'qk'[side]}{c}" for g, side, c in held if g == h)
                               for h in heads))


if __name__ == "__main__":
    main()
