"""The parts of PRISM's position path at a run's size, each timed forward + backward, with the variants
that could make the step faster: the histogram scan (Triton) at several warps per program, the cursor
scores in float32 and with TF32 matrix products, the mix of the cursors per block as a broadcast
multiply and sum and as a batched matrix product, and every block's mix from one read of the scores
(`mix_all`, not the model's path), and each of those compiled (as `--compile` would).

    python docs/perf/prism_parts.py --experiment prism-more --task stack --budget full [--reps 20]
    python docs/perf/prism_parts.py --device cpu --tiny --reps 1       # a check that it runs

Shapes, per position stream: the run's batch at its longest training length, padded as train.Step pads
it; the bins a cursor can reach (as PrismHooks cuts them); the mix once for each block that reads the
stream. Inputs are random (gates from random logits, histograms from the scan), so the times are the
run's but the values are not. Prints a table of milliseconds per position stream for each part and variant, and
how far the TF32 scores are from the float32 ones. Results: docs/perf/prism.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, ".")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import prism        # noqa: E402
import train        # noqa: E402
from step_profile import config, pick, run_options  # noqa: E402
from tasks import TASKS  # noqa: E402


def timed(fn, reps: int, device: str) -> float:
    """Milliseconds per call of fn, after two calls that warm it up (compilation, autotuning)."""
    for _ in range(2):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    tic = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - tic) / reps * 1e3


def triton_width(P: int) -> int:
    """The Triton scan's block over the bins: P rounded up to a power of 2, as the kernel's wrapper does."""
    import triton
    return triton.next_power_of_2(P)


def mix_matmul(scores, alpha):
    """`prism.mix_cursors` as one batched matrix product per (batch, head): (1, O) @ (O, T T)."""
    B, H, O, T, S = scores.shape
    return (alpha.abs()[None, :, None, :] @ scores.reshape(B, H, O, T * S)).view(B, H, T, S)


def mix_all(scores, alphas):
    """Every block's `prism.mix_cursors` from one read of the scores: alphas (L, H, O) -> (L, B, H, T, T)."""
    return (scores[None] * alphas.abs()[:, None, :, :, None, None]).sum(3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_options(p, budget="full", task="stack")
    p.add_argument("--warps", default="1,2,4,8", help="warps per program of the Triton scan to time")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-compile", action="store_true", help="leave out the compiled variants")
    a = p.parse_args(argv)
    device = train.device_of(a.device)
    cuda = device.startswith("cuda")
    cfg = config(pick(a.experiment, a.budget, a.task, a.label), device, a.tiny, False)
    m, o = cfg.model, cfg.model.opts
    if m.method != "prism":
        raise SystemExit(f"{cfg.task}/{m.method}: not a PRISM run")
    H, O, d = m.n_heads, int(o.get("prism_cursors", 4)), int(o.get("prism_dim", 32))
    blocks = [int(b) for b in o.get("prism_blocks", [0])]
    reads = [nxt - b for b, nxt in zip(blocks, blocks[1:] + [m.n_layers])]      # blocks per position stream
    task = TASKS[cfg.task]
    length = max(cfg.train_lengths or task.train_lengths)
    tokens = task.sample(1, length, np.random.default_rng(0), **cfg.task_opts).x.shape[1]
    T = -(-tokens // cfg.bucket) * cfg.bucket
    P = prism.reachable_bins(int(o.get("prism_bins", 256)), T)
    B, N = cfg.batch_size, 2 * H * O
    copy = bool(o.get("prism_copy", False))
    where = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{cfg.task}/{cfg.run_dir().parent.name}: B={B}, {N} cursors (H={H}, O={O}), T={T} ({tokens} tokens), "
          f"P={P}, d={d}, {len(blocks)} position stream(s) read by {reads} blocks, on {where}", flush=True)

    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    gates = [torch.sigmoid(rand(B, N, T) - 2)] + list(rand(B, N, T, 3).softmax(-1).unbind(-1))
    gates = [x.detach().requires_grad_() for x in gates]
    gamma = torch.full((N,), 2.0, device=device, requires_grad=True)
    p_copy = rand(B, N, T, P + 1).softmax(-1).requires_grad_() if copy else None
    with torch.no_grad():   # the cursors' rows sides first, as the model scans them (prism.sides_first)
        hist = prism.histogram_scan(*gates, gamma[None], P, p_copy).detach().view(2, B, H * O, T, P)
    gram = (lambda f: f @ f.T)(prism.sinusoid_table(P, d, device))
    rows = []                                                            # (part, variant, ms per stream)

    def scan():
        prism.histogram_scan(*gates, gamma[None], P, p_copy).sum().backward()
    if cuda:
        from kernels import prism_scan
        default = prism_scan.warps(triton_width(P))
        for w in [int(x) for x in a.warps.split(",")]:
            prism_scan.WARPS = w
            rows.append(("histogram scan", f"Triton, {w} warps{' (default)' if w == default else ''}",
                         timed(scan, a.reps, device)))
        prism_scan.WARPS = None
    else:
        rows.append(("histogram scan", "vectorised step (CPU)", timed(scan, a.reps, device)))

    h = hist.clone().requires_grad_()
    d_scores = rand(B, H, O, T, T)

    def scores_with(fn):
        def run():
            fn(h, gram, H, d).backward(d_scores)
        return run
    variants = [("float32", prism.cursor_scores)]
    if not a.no_compile:
        variants.append(("float32, compiled", torch.compile(prism.cursor_scores, dynamic=False)))
    for name, fn in variants:
        rows.append(("cursor scores", name, timed(scores_with(fn), a.reps, device)))
    with torch.no_grad():
        exact = prism.cursor_scores(hist, gram, H, d)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        rows.append(("cursor scores", "TF32 products", timed(scores_with(prism.cursor_scores), a.reps, device)))
        with torch.no_grad():
            tf32 = prism.cursor_scores(hist, gram, H, d)
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"TF32 scores against float32: largest difference {(tf32 - exact).abs().max().item():.2e}, "
              f"largest score {exact.abs().max().item():.2f}", flush=True)

    scores = exact.clone().requires_grad_()
    alphas = [torch.full((H, O), 8.0, device=device, requires_grad=True) for _ in range(max(reads))]
    d_mix = rand(B, H, T, T)

    def mix_with(fn, k: int):
        def run():
            torch.autograd.backward([fn(scores, alphas[i]) for i in range(k)], [d_mix] * k)
        return run
    variants = [("broadcast multiply and sum", prism.mix_cursors), ("batched matrix product", mix_matmul)]
    if not a.no_compile:
        variants.append(("broadcast multiply and sum, compiled", torch.compile(prism.mix_cursors, dynamic=False)))
    for name, fn in variants:
        rows.append((f"mix, {max(reads)} blocks", name, timed(mix_with(fn, max(reads)), a.reps, device)))

    def mix_all_with(fn, k: int):
        def run():
            fn(scores, torch.stack(alphas[:k])).backward(d_mix.expand(k, *d_mix.shape))
        return run
    variants = [("every block in one pass", mix_all)]
    if not a.no_compile:
        variants.append(("every block in one pass, compiled", torch.compile(mix_all, dynamic=False)))
    for name, fn in variants:
        rows.append((f"mix, {max(reads)} blocks", name, timed(mix_all_with(fn, max(reads)), a.reps, device)))

    print("\n| part (per position stream, forward + backward) | variant | ms |\n| --- | --- | ---: |")
    for part, name, ms in rows:
        print(f"| {part} | {name} | {ms:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(task=cfg.task, device=where, B=B, N=N, T=T, P=P, d=d, reads=reads,
                                               rows=rows, git=train.git_hash()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
