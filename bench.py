"""Speed and memory of the fast paths against PyTorch SDPA (no position encoding), on one GPU.

    python bench.py                 # every op, bf16, writes runs/bench/<op>.{md,png}
    python bench.py --op path --lengths 512,1024,2048
    python bench.py --op path --lengths 4096 --heads 16 --head-dim 128 --gate   # PaTH-FoX, D = 128
    python bench.py --op train      # train.py's steps/s on the headline presets
    python bench.py --op jobs       # steps/s of 1, 4 and 8 runs at once (train.py --jobs)
    python bench.py --op jobs --runs a5:path --counts 1,8,16

For each sequence length T: milliseconds (triton.testing.do_bench, median; a single call for a
case slower than 5 s, like PRISM's naive loop) of the forward and of forward + backward, the
ratio to SDPA from the same run, the peak memory of one forward + backward, and TFLOP/s counted
with the FLOPs of plain causal attention for every column, so the numbers compare time on the same
work:

    forward  = 2 matmuls (Q K^T, P V) x 2 FLOPs per multiply-add x B H T^2 D / 2 (causal half)
             = 2 B H T^2 D
    backward = 2.5 x forward (5 matmuls: S and dP recomputed, dV, dQ, dK)

Shapes: B batch, H heads, T time, D head dim.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


DEVICE = "cuda"  # the tests build the cases on the CPU at tiny sizes
SLOW_MS = 5000.0  # a case slower than this per call is timed from one call (PRISM's naive loop)


def attention_flops(B, H, T, D, causal=True, backward=False):
    fwd = 4 * B * H * T * T * D / (2 if causal else 1)
    return fwd * (3.5 if backward else 1.0)


def measure(fn, backward: bool):
    """(milliseconds, peak GiB) of fn() and, if backward, of its backward with a fixed gradient."""
    import triton.testing

    out = fn()
    do = torch.randn_like(out)
    inputs = [x for x in fn.inputs if x.requires_grad]

    def step():
        o = fn()
        if backward:
            torch.autograd.grad(o, inputs, do)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    once = start.elapsed_time(end)
    if once > SLOW_MS:  # do_bench would call it ~8 more times (5 to estimate, warmup, repeats): minutes
        return once, peak
    ms = triton.testing.do_bench(step, warmup=5, rep=40)
    return ms, peak


def path_cases(B, H, T, D, dtype, gate=False):
    """The callables compared for PaTH at one shape (PaTH-FoX with gate); each carries its .inputs."""
    import path_attention as pa
    from path_attention import path_attention_triton

    dev = DEVICE
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    w = F.normalize(torch.randn(B, H, T, D, device=dev), dim=-1).requires_grad_(True)
    beta = (2 * torch.rand(B, H, T, device=dev)).requires_grad_(True)
    g = F.logsigmoid(4 + torch.randn(B, H, T, device=dev)).requires_grad_(True) if gate else None
    name = "PaTH-FoX" if gate else "PaTH"

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def triton_path():
        return path_attention_triton(q, k, v, w, beta, g)

    def torch_path():
        return pa.path_attention_torch(q, k, v, w, beta, g, block=64)

    sdpa.inputs = [q, k, v]
    triton_path.inputs = torch_path.inputs = [q, k, v, w, beta] + ([g] if gate else [])
    cases = {"SDPA (no PE)": sdpa, f"{name} Triton": triton_path}
    if T <= 2048:  # the PyTorch path builds (T, T) logits; beyond this it only measures memory limits
        cases[f"{name} PyTorch (UT)"] = torch_path
    return cases


def vipe_cases(B, H, T, D, dtype):
    """ViPE as its layer calls it: value head D - 1, a code of 8 channels."""
    import vipe

    dev = DEVICE
    q, k = (torch.randn(B, H, T, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(B, H, T, D - 1, device=dev, dtype=dtype, requires_grad=True)
    v_full = torch.randn(B, H, T, D, device=dev, dtype=dtype, requires_grad=True)
    u = (0.1 * torch.randn(H, D, device=dev)).requires_grad_(True)
    w_p, b_p = (torch.randn(H, 8, device=dev, requires_grad=True) for _ in range(2))

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v_full, is_causal=True)

    def fast():
        return vipe.vipe_attention_triton(q, k, v, u, w_p, b_p, s=2.0)

    def torch_ops():
        return vipe.vipe_attention_torch(q, k, v, u, w_p, b_p, s=2.0)

    def naive():
        return vipe.vipe_attention_naive(q, k, v, u, w_p, b_p, s=2.0)

    sdpa.inputs = [q, k, v_full]
    fast.inputs = torch_ops.inputs = naive.inputs = [q, k, v, u, w_p, b_p]
    cases = {"SDPA (no PE)": sdpa, "ViPE Triton + SDPA": fast, "ViPE PyTorch ops + SDPA": torch_ops}
    if T <= 1024:  # the naive path holds (B, H, T, T, d_p) codes
        cases["ViPE naive"] = naive
    return cases


def upe_cases(B, H, T, D, dtype, K=256, M=3):
    """UPE at the speed target's shape: bidirectional, clip K = 256, 3 uniform slots (the first keys)."""
    import upe

    dev = DEVICE
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    rel = (0.1 * torch.randn(H, 2 * K + 1, D, device=dev, dtype=dtype)).requires_grad_(True)
    uni = (0.1 * torch.randn(H, M, D, device=dev, dtype=dtype)).requires_grad_(True)
    slot = torch.full((B, T), -1, device=dev, dtype=torch.long)
    slot[:, :M] = torch.arange(M, device=dev)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v)

    def fast():
        return upe.upe_attention(q, k, v, rel, uni, slot)

    def torch_path():
        return upe.upe_attention_torch(q, k, v, rel, uni, slot)

    sdpa.inputs = [q, k, v]
    fast.inputs = torch_path.inputs = [q, k, v, rel, uni]
    cases = {"SDPA (no PE)": sdpa, "UPE Triton": fast}
    if T <= 2048:  # the PyTorch path builds (B, H, T, T) logits
        cases["UPE PyTorch (gathered tables)"] = torch_path
    return cases


def prism_cases(B, N, T, P, dtype):
    """PRISM's histogram scan, forward + backward through all gates (float32 state)."""
    import prism

    dev = DEVICE
    gates = [torch.rand(B, N, T, device=dev, requires_grad=True) for _ in range(4)]
    gamma = torch.full((B, N), 2.0, device=dev, requires_grad=True)

    def triton_scan():
        from kernels.prism_scan import histogram_scan_triton
        return histogram_scan_triton(*gates, gamma, P)

    def fast():
        return prism._scan(prism.histogram_step, *gates, gamma, P)

    def naive():
        return prism.histogram_scan_naive(*gates, gamma, P)

    triton_scan.inputs = fast.inputs = naive.inputs = gates + [gamma]
    cases = {"scan, Triton": triton_scan}
    if T <= 1024:  # a Python loop over T of ~20 small kernels per step, seconds per call beyond this
        cases["scan, vectorised step"] = fast
    if T <= 256:  # the naive step loops over the P bins in Python
        cases["scan, naive (Algorithm 1 per bin)"] = naive
    return cases


OPS = {
    "path": dict(cases=path_cases, lengths=[512, 1024, 2048, 4096, 8192], B=8, H=32, D=64, causal=True),
    "vipe": dict(cases=vipe_cases, lengths=[1024, 2048, 4096, 8192], B=8, H=32, D=64, causal=True),
    "upe": dict(cases=upe_cases, lengths=[1024, 2048, 4096, 8192], B=8, H=32, D=64, causal=False),
    # B, N (cursors), P (bins) in the B, H, D slots; no SDPA row, TFLOP/s not meaningful
    "prism": dict(cases=prism_cases, lengths=[256, 512, 1024, 2048], B=32, H=32, D=256, causal=True, flops=False),
}


def run_op(name, spec, lengths, dtype, out_dir: Path):
    B, H, D = spec["B"], spec["H"], spec["D"]
    rows = []
    for T in lengths:
        for label, fn in spec["cases"](B, H, T, D, dtype).items():
            row = dict(T=T, impl=label)
            for mode, bwd in (("fwd", False), ("fwd+bwd", True)):
                try:
                    ms, peak = measure(fn, bwd)
                except torch.cuda.OutOfMemoryError:
                    ms, peak = float("nan"), float("nan")
                    torch.cuda.empty_cache()
                row[mode] = ms
                row[mode + " GiB"] = peak
                row[mode + " TFLOP/s"] = attention_flops(B, H, T, D, spec["causal"], bwd) / ms / 1e9
            rows.append(row)
            print(f"{name} T={T:5d} {label:20s} fwd {row['fwd']:8.3f} ms   fwd+bwd {row['fwd+bwd']:8.3f} ms"
                  f"   peak {row['fwd+bwd GiB']:6.2f} GiB", flush=True)
    gpu = torch.cuda.get_device_name()
    base_name = "SDPA" if any(r["impl"].startswith("SDPA") for r in rows) else rows[0]["impl"]
    lines = [f"# {name}: {gpu}, {str(dtype).replace('torch.', '')}, B={B} H={H} D={D}, "
             f"torch {torch.__version__}", "",
             f"| T | implementation | fwd ms | fwd+bwd ms | fwd+bwd / {base_name} | TFLOP/s fwd+bwd | peak GiB fwd+bwd |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        base = next(r for r in rows if r["T"] == row["T"] and r["impl"].startswith(base_name))
        ratio = row["fwd+bwd"] / base["fwd+bwd"]
        tflops = f"{row['fwd+bwd TFLOP/s']:.1f}" if spec.get("flops", True) else "-"
        lines.append(f"| {row['T']} | {row['impl']} | {row['fwd']:.3f} | {row['fwd+bwd']:.3f} | {ratio:.2f}x | "
                     f"{tflops} | {row['fwd+bwd GiB']:.2f} |")
    table = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.md").write_text(table)
    plot(name, rows, gpu, out_dir / f"{name}.png")
    print(table)
    return table


def plot(name, rows, gpu, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = [(r["T"], r[mode]) for r in rows if r["impl"] == impl]
            ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("ms")
        ax.set_title(f"{name} {mode}")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(gpu)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# =============================================================================================
# Training throughput:  python bench.py --op train
# =============================================================================================

TRAIN_RUNS = [("flipflop", "rope"), ("flipflop", "path"), ("a5", "path"), ("polynomial", "vipe"),
              ("add_padded", "rpe"), ("add_cot", "rope"), ("add_cot", "prism"), ("copy", "prism"),
              ("reverse", "prism")]
TRAIN_AS = {("reverse", "prism"): "prism-more"}   # trained as this experiment does (PRISM's copy branch)
TRAIN_MODES = {"data in the loop, eager step": dict(workers=0, graphs=False),   # the loop before workers/graphs
               "data workers": dict(workers=None, graphs=False),               # None: jobs.default_workers(1)
               "data workers + CUDA graphs": dict(workers=None, graphs=True)}


def data_ms(task, n=256, repeats=5) -> float:
    """Milliseconds (best of `repeats`) to make a batch of n problems at the task's longest training length."""
    import time

    import numpy as np
    rng = np.random.default_rng(0)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        task.sample(n, max(task.train_lengths), rng)
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def run_train(steps: int, out_dir: Path, runs=TRAIN_RUNS, modes=TRAIN_MODES, device=None):
    """Steps/s of train.train on each headline preset (GPU preset, its batch size) in each mode,
    from the run's own metrics (steps over the loop's time, graph captures included), and the
    fraction of that time the loop waited for data."""
    import tempfile

    import cli
    import experiments
    import jobs
    import train
    from tasks import TASKS

    device = device or DEVICE
    rows = []
    for task, method in runs:
        settings = {}
        if (task, method) in TRAIN_AS:                    # the experiment's settings but its steps and n_eval
            settings = {k: v for k, v in experiments.run_of(TRAIN_AS[task, method], task).items()
                        if k not in ("task", "method", "steps", "n_eval")}
        for mode, how in modes.items():
            with tempfile.TemporaryDirectory() as tmp:
                how = {**how, "workers": jobs.default_workers(1) if how["workers"] is None else how["workers"]}
                cfg = cli.make_config(dict(task=task, method=method, steps=steps, device=device, out=tmp,
                                           n_eval=8, test_lengths=[max(TASKS[task].train_lengths)],
                                           ckpt_every=10 ** 9, log_every=1e9,
                                           **settings, **how), "gpu")
                m = train.train(cfg, log=lambda *_: None)
            rows.append(dict(run=f"{task} {method}", batch=cfg.batch_size, mode=mode, workers=cfg.workers,
                             steps_per_s=m["steps_per_s"], data_wait=m["data_wait"]))
            print(f"train {task:10s} {method:6s} batch {cfg.batch_size:4d} {mode:30s} "
                  f"{m['steps_per_s']:8.1f} steps/s   data wait {100 * m['data_wait']:4.0f}%", flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    first = next(iter(modes))
    lines = [f"# Training throughput: {gpu}, torch {torch.__version__}, GPU preset, {steps} steps per run", "",
             "| run | batch | mode | workers | steps/s | samples/s | vs " + first + " | data wait |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = next(b for b in rows if b["run"] == r["run"] and b["mode"] == first)
        lines.append(f"| {r['run']} | {r['batch']} | {r['mode']} | {r['workers']} | {r['steps_per_s']:.1f} | "
                     f"{r['steps_per_s'] * r['batch']:.0f} | {r['steps_per_s'] / base['steps_per_s']:.2f}x | "
                     f"{100 * r['data_wait']:.0f}% |")
    lines += ["", "Data generation on one CPU core, a batch of 256 at the longest training length (best of 5):", "",
              "| task | ms |", "| --- | ---: |"]
    lines += [f"| {name} | {data_ms(task):.1f} |" for name, task in TASKS.items()]
    table = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train.md").write_text(table)
    plot_train(rows, list(modes), gpu, out_dir / "train.png")
    print(table)
    return rows


def plot_train(rows, modes, gpu, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(dict.fromkeys(r["run"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        ys = [next(r["steps_per_s"] for r in rows if r["run"] == run and r["mode"] == mode) for run in runs]
        ax.bar([i + k * width for i in range(len(runs))], ys, width, label=mode)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))], runs, rotation=20, fontsize=8)
    ax.set_ylabel("training steps/s (GPU preset batch)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title(f"train.py throughput, {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# =============================================================================================
# Many runs at once:  python bench.py --op jobs
# =============================================================================================

JOBS_RUNS = [("parity", "vipe"), ("flipflop", "rope")]   # the ViPE paper's model; flip-flop's preset
JOBS_COUNTS = (1, 4, 8)


def run_jobs(steps: int, out_dir: Path, runs=JOBS_RUNS, counts=JOBS_COUNTS, extra=(), device=None):
    """Steps/s of N identical runs (seeds 0..N-1, the GPU preset) trained at once by
    `train.py --jobs N` against one run alone: each run's steps/s from its own metrics (the loop's
    time after its first steps), summed over the runs that share the GPUs. The largest N runs
    twice, under the MPS daemon that train.py starts and with --no-mps."""
    import json
    import subprocess
    import tempfile
    import time

    import jobs
    from tasks import TASKS

    device = device or DEVICE
    gpus = len(jobs.visible_gpus()) if device == "cuda" else 0
    cases = [(n, True) for n in counts] + [(max(counts), False)]
    rows = []
    for task, method in runs:
        for n, mps in cases:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, str(Path(__file__).parent / "train.py"), "--task", task, "--method", method,
                       "--seeds", ",".join(map(str, range(n))), "--jobs", str(n), "--steps", str(steps),
                       "--device", device, "--preset", "gpu", "--n-eval", "8", "--out", tmp,
                       "--test-lengths", str(max(TASKS[task].train_lengths)), *extra] + ([] if mps else ["--no-mps"])
                tic = time.time()
                done = subprocess.run(cmd, capture_output=True, text=True)
                wall = time.time() - tic
                if done.returncode:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
                rates = [json.loads(p.read_text())["steps_per_s"] for p in Path(tmp).glob("*/*/seed*/metrics.json")]
            said = next((line for line in done.stdout.splitlines() if line.startswith("MPS:")), "")
            used = "-" if n == 1 else "yes" if "started" in said or "using" in said else "no"
            rows.append(dict(run=f"{task} {method}", n=n, mps=used, rates=rates, total=sum(rates), wall=wall))
            print(f"jobs {task:10s} {method:6s} N={n} MPS {rows[-1]['mps']:3s} {sum(rates):8.1f} steps/s in all "
                  f"({min(rates):.0f}-{max(rates):.0f} per run), {wall:.0f} s", flush=True)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [f"# Runs at once: {gpu} x {max(gpus, 1)}, torch {torch.__version__}, GPU preset, {steps} steps per run",
             "", "| run | runs at once | MPS | steps/s per run | steps/s in all | x one run | per run (1 = no loss) "
             "| wall s |", "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        one = next(b["total"] for b in rows if b["run"] == r["run"] and b["n"] == 1)
        lines.append(f"| {r['run']} | {r['n']} | {r['mps']} | {min(r['rates']):.0f}-{max(r['rates']):.0f} | "
                     f"{r['total']:.0f} | {r['total'] / one:.2f}x | {r['total'] / one / r['n']:.2f} | {r['wall']:.0f} |")
    table = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "jobs.md").write_text(table)
    print(table)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--op", default="all", help=f"one of {', '.join(OPS)}, all (the kernels), train or jobs")
    parser.add_argument("--steps", type=int, default=None, help="--op train: steps per run (default 300); "
                        "--op jobs: steps per run (default 3000)")
    parser.add_argument("--lengths", default=None, help="comma-separated T values (default: per op)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--heads", type=int, default=None, help="H (default: per op)")
    parser.add_argument("--head-dim", type=int, default=None, help="D (default: per op)")
    parser.add_argument("--gate", action="store_true", help="--op path: PaTH-FoX (with the forget gate)")
    parser.add_argument("--runs", default=None, help="--op jobs: comma-separated task:method presets "
                        "(default: " + ",".join(f"{t}:{m}" for t, m in JOBS_RUNS) + ")")
    parser.add_argument("--counts", default=None, help="--op jobs: comma-separated numbers of runs at once "
                        f"(default: {','.join(map(str, JOBS_COUNTS))}; the largest also without MPS)")
    parser.add_argument("--out", default="runs/bench")
    args = parser.parse_args(argv)
    try:
        runs = [tuple(r.split(":")) for r in args.runs.split(",")] if args.runs else JOBS_RUNS
        counts = tuple(int(n) for n in args.counts.split(",")) if args.counts else JOBS_COUNTS
    except ValueError:
        print(f"--counts takes whole numbers, got {args.counts!r}", file=sys.stderr)
        return 2
    if any(len(r) != 2 for r in runs) or 1 not in counts:
        print("--runs takes task:method pairs, and --counts must include 1 (the baseline)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench.py measures GPU kernels; no CUDA device found", file=sys.stderr)
        return 2
    if args.op == "train":
        run_train(args.steps or 300, Path(args.out))
        return 0
    if args.op == "jobs":
        run_jobs(args.steps or 3000, Path(args.out), runs, counts)
        return 0
    names = list(OPS) if args.op == "all" else [args.op]
    for name in names:
        if name not in OPS:
            print(f"unknown op {name!r}; available: {', '.join(OPS)}, all", file=sys.stderr)
            return 2
    if args.gate and names != ["path"]:
        print("--gate applies to --op path only", file=sys.stderr)
        return 2
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
    for name in names:
        spec = dict(OPS[name], H=args.heads or OPS[name]["H"], D=args.head_dim or OPS[name]["D"])
        if args.gate:
            spec["cases"] = functools.partial(path_cases, gate=True)
        label = name + (f"_H{spec['H']}_D{spec['D']}" if (args.heads or args.head_dim) else "") + \
            ("_fox" if args.gate else "")
        run_op(label, spec, lengths or spec["lengths"], getattr(torch, args.dtype), Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
