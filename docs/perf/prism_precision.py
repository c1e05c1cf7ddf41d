"""Does a trained PRISM model keep its accuracy when the two matrix products of its position scores
(`prism.cursor_scores`: histograms x Gram matrix, then query x key cursors) take inputs of lower precision?

The model runs them in float32 (under autocast too), in cuBLAS's SIMT kernels without tensor cores. TF32
would use tensor cores: its inputs keep 10 of float32's 23 mantissa bits, bfloat16's 7, and the products
accumulate in float32. This script rounds both products' inputs to that many bits (round to nearest) on
any device and evaluates the run as the loop does at each length, once per precision, on the same examples.
`tf32-fp16` and `tf32-bf16` also round the scores themselves to float16 or bfloat16, as if they were stored in
it between the position update and the blocks that read them (half the bytes of the largest tensor of the step):

    python train.py --method prism --task copy --out runs
    python docs/perf/prism_precision.py runs/copy/prism/seed0 10,40,100 128

It reads the outputs only: training with these products in TF32 is another question. Run it from the
repository root. Results: docs/perf/prism.md ("TF32 for the position scores?").
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, ".")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import prism  # noqa: E402
from evaluation import evaluate  # noqa: E402
from run_state import load_model  # noqa: E402
from tasks import TASKS  # noqa: E402

# mantissa bits of the products' inputs, and the dtype the scores are stored in (None: float32)
PRECISIONS = {"float32": (23, None), "tf32": (10, None), "bfloat16": (7, None),
              "tf32-fp16": (10, torch.float16), "tf32-bf16": (10, torch.bfloat16)}


def rounded(x, bits: int):
    """float32 x with its mantissa rounded to `bits` bits (to nearest, ties away from zero)."""
    if bits >= 23:
        return x
    drop = 23 - bits
    i = x.contiguous().view(torch.int32)
    return ((i + (1 << (drop - 1))) & ~((1 << drop) - 1)).view(torch.float32)


def cursor_scores_at(bits: int, stored=None):
    """`prism.cursor_scores` with the inputs of its two matrix products rounded to `bits` bits, and the scores
    rounded to the dtype `stored` (as if kept in it between the position update and the blocks that read them)."""
    def scores(hist, gram, H: int, d: int):
        _, B, HO, T, P = hist.shape
        O = HO // H
        hg = rounded(hist, bits) @ rounded(gram, bits)                        # (2, B, H O, T, P)
        sq = (hg * hist).sum(-1).view(2, B, H, O, T)
        norm = sq.sum(3).clamp(min=1e-12).sqrt()                              # (2, B, H, T)
        q = rounded(hg[0], bits).reshape(B, H, O, T, P)
        k = rounded(hist[1], bits).reshape(B, H, O, T, P)
        norms = norm[0][:, :, None, :, None] * norm[1][:, :, None, None, :]
        out = (q @ k.transpose(-1, -2)) * (d / O) ** 0.5 / norms
        return out if stored is None else out.to(stored).float()
    return scores


def main(argv) -> int:
    run, lengths, n = Path(argv[0]), [int(a) for a in argv[1].split(",")], int(argv[2])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, meta = load_model(run, device)                # a finished run, or a checkpoint at any step
    if meta["method"] != "prism":
        raise SystemExit(f"{run} is a {meta['method']!r} run, not prism")
    cfg = meta["config"]
    task, plain = TASKS[meta["task"]], prism.cursor_scores
    print(f"{run}: {meta['task']}, trained to {meta['train_max_length']}; exact / token accuracy, "
          f"{n} examples a length")
    try:
        for name, (bits, stored) in PRECISIONS.items():
            prism.cursor_scores = cursor_scores_at(bits, stored)
            rows = evaluate(model, task, lengths, n, 0, device, cfg["task_opts"],
                            precision=cfg.get("precision", "bf16"))
            cells = "".join(f"  {r['length']}: {r['exact']:.3f} / {r['token']:.4f}" for r in rows)
            print(f"{name:9s}{cells}", flush=True)
    finally:
        prism.cursor_scores = plain
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
