"""Where one training step of an experiment's run spends its time, and what a whole run of it costs:
the run's own settings (the GPU preset, the experiment's options, at either budget), batches at its
longest training length (--as-trained: drawn as its last training stage draws them, every training length mixed,
so that the padded lengths, `--bucket`, are those of training).

    python docs/perf/step_profile.py --experiment prism-more --task reverse [--steps 30] [--top 25]
    python docs/perf/step_profile.py --experiment vipe-parity --budget full --label vipe-L3 --compile
    python docs/perf/step_profile.py --experiment prism-more --task reverse --device cpu --tiny --steps 2

Prints (1) steps/s of train.Step as the loop runs it (CUDA graphs on a GPU; --compile: of the
compiled model, as `train.py --compile` runs it), (2) the device time of one eager step
(--profile-compiled: of the compiled model without CUDA graphs), summed over its kernels, against its
wall time (near the wall time: the GPU is busy all step and faster kernels are what helps; far below
it: the step waits on launches), (3) the --top kernels or operators by
device time per step (CUDA time on a GPU, the operators' own CPU time otherwise), and (4) one
evaluation as the run makes it (its test lengths and examples, and its held-out set; and one as it
evaluates during training, where that takes fewer examples) and the run's projected time alone: its
steps at (1)'s rate plus its evaluations. Data is made before the clock starts, so (1) is the step
alone; a run's data workers add nothing where they keep up. --no-eval leaves out (4), --top 0 (2) and (3);
--scan-warps and --tf32 time PRISM's step with another warp count in its scan or with TF32 products,
--scores-kernel with its cursor scores from kernels/prism_scores.py (prism.SCORES_BACKEND), --half-scores
with the scores kept in float16 (prism.SCORES_DTYPE). --tiny shrinks the model: a check that the script runs,
not a measurement. Run it from the repository root.
Results: docs/perf/prism.md (PRISM), docs/perf/training.md (the full budget's runs).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, ".")
import cli          # noqa: E402
import experiments  # noqa: E402
import train        # noqa: E402
from evaluation import evaluate  # noqa: E402
from tasks import TASKS, sample_mixed  # noqa: E402


def pick(name: str, budget: str, task: str | None, label: str | None) -> dict:
    """The experiment's first run on `task` (any task if None) whose folder name ("vipe-L3-full") is
    `label` (any if None)."""
    exp = experiments.at_budget(experiments.EXPERIMENTS[name], budget)
    for run in exp.runs:
        if (task is None or run["task"] == task) and (label is None or experiments.run_label(run) == label):
            return run
    raise SystemExit(f"{name} ({budget}) has no run with task {task} and label {label}")


def config(run: dict, device: str, tiny: bool, compile_: bool, bucket: int | None = None) -> train.TrainConfig:
    values = {**run, "device": device, "workers": 0, "graphs": device.startswith("cuda"), "compile": compile_,
              "bucket": bucket or train.TrainConfig.bucket}
    if tiny:
        blocks = run.get("opts", {}).get("prism_blocks", [0])          # the blocks PRISM's positions feed
        values.update(d_model=32, n_layers=max(2, max(blocks) + 1), n_heads=2, batch_size=4, n_eval=2,
                      n_eval_during=min(1, run.get("n_eval_during", 0)))
        if run["method"] == "prism":
            values["opts"] = {**run.get("opts", {}), "prism_bins": 16, "prism_dim": 16, "prism_cursors": 2}
    cfg = cli.make_config(values, "gpu")
    task = TASKS[cfg.task]
    cfg.model.vocab_size, cfg.model.causal = len(task.vocab), task.causal
    return cfg


def say(line: str):
    print(line, flush=True)


def sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_options(p: argparse.ArgumentParser, budget: str = "quick", task: str | None = None):
    """The options that pick a run (`pick`) and where it runs (`config`), for this and the other perf scripts."""
    p.add_argument("--experiment", default="prism-more", help="an experiment of experiments.EXPERIMENTS")
    p.add_argument("--budget", default=budget, choices=experiments.BUDGETS)
    p.add_argument("--task", default=task, help="a task of the experiment (default: its first run's)")
    p.add_argument("--label", help="the run's folder name, e.g. vipe-L3-full (default: the task's first run)")
    p.add_argument("--device", default="auto")
    p.add_argument("--tiny", action="store_true", help="a tiny model: a check that the script runs")
    p.add_argument("--out", help="also write the numbers to this JSON file")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_options(p)
    p.add_argument("--compile", action="store_true", help="(1) with the model compiled (train.py --compile)")
    p.add_argument("--steps", type=int, default=30, help="steps timed, and steps profiled")
    p.add_argument("--warm", type=int, default=5, help="steps before the clock starts (graph captures)")
    p.add_argument("--top", type=int, default=25, help="operators listed in (3); 0 leaves (2) and (3) out")
    p.add_argument("--profile-compiled", action="store_true",
                   help="(2), (3) of the compiled model (without CUDA graphs) instead of the eager one")
    p.add_argument("--no-eval", action="store_true", help="leave out (4)")
    p.add_argument("--scan-warps", type=int, help="PRISM: warps per program of the Triton histogram scan")
    p.add_argument("--tf32", action="store_true", help="float32 matrix products in TF32 (PRISM's cursor scores)")
    p.add_argument("--bucket", type=int, help="(1) batches padded to a multiple of this many tokens (train.py --bucket)")
    p.add_argument("--as-trained", action="store_true", help="batches of every training length mixed, as in training")
    p.add_argument("--scores-kernel", action="store_true", help="PRISM: the cursor scores' Triton kernels")
    p.add_argument("--half-scores", action="store_true", help="PRISM: the scores kept in float16 (prism.SCORES_DTYPE)")
    a = p.parse_args(argv)
    if a.profile_compiled and not a.compile:
        p.error("--profile-compiled profiles the compiled model: add --compile")
    device = train.device_of(a.device)
    if a.scan_warps:
        from kernels import prism_scan
        prism_scan.WARPS = a.scan_warps
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    if a.half_scores:
        import prism
        prism.SCORES_DTYPE = torch.float16
    if a.scores_kernel:
        import prism
        prism.SCORES_BACKEND = "triton"
    run = pick(a.experiment, a.budget, a.task, a.label)
    cfg = config(run, device, a.tiny, a.compile, a.bucket)
    task = TASKS[cfg.task]
    lengths = cfg.train_lengths or task.train_lengths
    length = max(lengths)
    where = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    name = f"{a.experiment} ({a.budget}) {cfg.task}/{cfg.run_dir().parent.name}"
    rng = np.random.default_rng(0)
    data = [sample_mixed(task, cfg.batch_size, lengths, rng, **cfg.task_opts) if a.as_trained
            else task.sample(cfg.batch_size, length, rng, **cfg.task_opts) for _ in range(a.warm + a.steps)]
    pad = lambda b: -(-b.x.shape[1] // cfg.bucket) * cfg.bucket          # noqa: E731
    padded = sorted({pad(b) for b in data})
    say(f"{name}: batch {cfg.batch_size} {'of lengths mixed up to' if a.as_trained else 'at length'} {length} "
        f"(padded to {', '.join(map(str, padded))} tokens), {cfg.model.n_layers} layers, d={cfg.model.d_model}, "
        f"on {where}")                                  # each part as soon as it is measured
    torch.manual_seed(cfg.seed)
    model = train.build_model(cfg.model).to(device)
    opt = train.make_optimizer(model, cfg, device)
    train.set_lr(opt, cfg.lr)

    fwd = train.compiled(model) if a.compile else model
    step = train.Step(model, fwd, opt, cfg, task, device)             # (1) as the loop runs it
    warm, seen = data[:a.warm], {pad(b) for b in data[:a.warm]}
    for b in data[a.warm:]:                      # every padded shape captured before the clock starts
        if pad(b) not in seen:
            warm.append(b)
            seen.add(pad(b))
    for batch in warm:
        step(batch)
    sync(device)
    tic = time.perf_counter()
    for batch in data[a.warm:]:
        step(batch)
    sync(device)
    rate = a.steps / (time.perf_counter() - tic)
    step.release()
    say(f"(1) train.Step{' with CUDA graphs' if device.startswith('cuda') else ''}"
        f"{' (compiled)' if a.compile else ''}: {rate:.1f} steps/s ({1e3 / rate:.2f} ms a step)"
        + (f", {torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB at most" if device.startswith("cuda") else ""))

    numbers = dict(experiment=a.experiment, budget=a.budget, task=cfg.task, run=cfg.run_dir().parent.name,
                   compile=a.compile, profiled_compiled=a.profile_compiled, scan_warps=a.scan_warps, tf32=a.tf32,
                   scores_kernel=a.scores_kernel, half_scores=a.half_scores, bucket=cfg.bucket,
                   as_trained=a.as_trained, padded=padded, device=where, batch=cfg.batch_size, length=length,
                   steps_per_s=rate, git=train.git_hash())
    if a.top:
        numbers.update(profiled(a, cfg, model, fwd, opt, task, device, data))
    if not a.no_eval:
        numbers.update(evaluations(a, cfg, model, task, device, rate))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(numbers, f, indent=1)
    return 0


def profiled(a, cfg, model, fwd, opt, task, device: str, data: list) -> dict:
    """(2), (3): the timed steps again, eager (or compiled without graphs) under torch's profiler."""
    cfg.graphs, cfg.compile = False, a.profile_compiled                  # every kernel seen
    eager = train.Step(model, fwd if a.profile_compiled else model, opt, cfg, task, device)
    for batch in data[:2]:                                              # a compiled model compiles on both
        eager(batch)
    sync(device)
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    tic = time.perf_counter()
    with profile(activities=activities) as prof:
        for batch in data[a.warm:]:
            eager(batch)
        sync(device)
    wall = (time.perf_counter() - tic) / a.steps * 1e3
    per, launches = defaultdict(float), 0                              # ms per step, by kernel / operator
    for evt in prof.key_averages():
        if device.startswith("cuda"):                                  # the kernels themselves (an
            if "CUDA" not in str(getattr(evt, "device_type", "")):     # operator's entry repeats its
                continue                                               # kernels' time)
            us = getattr(evt, "self_device_time_total", None)
            us = evt.self_cuda_time_total if us is None else us
            launches += evt.count
        else:
            us = evt.self_cpu_time_total
        if us > 0:
            per[evt.key] += us / 1e3 / a.steps
    busy = sum(per.values())
    top = sorted(per.items(), key=lambda kv: -kv[1])[:a.top]
    kind = "compiled step without graphs" if a.profile_compiled else "eager step"
    say(f"(2) one {kind}: {busy:.2f} ms of {'device' if device.startswith('cuda') else 'CPU'} time in "
        f"{wall:.2f} ms wall (profiled)" + (f", {launches / a.steps:.0f} kernels" if launches else ""))
    say("(3) by kernel / operator, ms per step:")
    for key, ms in top:
        say(f"  {ms:8.3f}  {100 * ms / busy:5.1f}%  {key[:100]}")

    return dict(eager_busy_ms=busy, eager_wall_ms=wall, kernels_per_step=launches / a.steps, top=top)


def evaluations(a, cfg, model, task, device: str, rate: float) -> dict:
    """(4): one evaluation as the run makes it, and the run alone projected from it and (1)'s rate."""
    sets = [(cfg.test_lengths or task.test_lengths, 1)] + ([(cfg.held_out_lengths, 2)] if cfg.held_out_lengths else [])

    def one_evaluation(n: int) -> float:
        sync(device)
        tic = time.perf_counter()
        for lengths, stream in sets:
            evaluate(model, task, lengths, n, cfg.seed, device, cfg.task_opts, stream=stream, precision=cfg.precision)
        sync(device)
        return time.perf_counter() - tic
    eval_s = one_evaluation(cfg.n_eval)                                  # (4) the final evaluation
    n_during = cfg.steps // cfg.eval_every if cfg.eval_every else 0
    fewer = bool(n_during and cfg.n_eval_during)                         # those during training: n_eval_during
    during_s = one_evaluation(cfg.n_eval_during) if fewer else eval_s
    n_evals = 1 + n_during
    projected = cfg.steps / rate + n_during * during_s + eval_s

    say(f"(4) one evaluation: {eval_s:.1f} s ({cfg.n_eval} examples a length)"
        + (f", {during_s:.1f} s during training ({cfg.n_eval_during} a length)" if fewer else "")
        + f"; the run alone: {cfg.steps} steps at (1)'s rate + {n_during} evaluations during training + the final "
        f"one = {train.fmt_time(projected)} (projected"
        + (f"; at most: the evaluations wait for a loss below {cfg.eval_from_loss})" if cfg.eval_from_loss else ")"))
    return dict(eval_s=eval_s, eval_during_s=during_s, steps=cfg.steps, n_evals=n_evals, projected_s=projected)


if __name__ == "__main__":
    sys.exit(main())
