"""Where one PRISM training step spends its time: a prism-more task in its quick-budget settings (the
GPU preset, the experiment's options), batches at the longest training length.

    python docs/perf/prism_step_profile.py --task reverse [--steps 30] [--top 25] [--out FILE.json]
    python docs/perf/prism_step_profile.py --task reverse --device cpu --tiny --steps 2

Prints (1) steps/s of train.Step as the loop runs it (CUDA graphs on a GPU), (2) the device time
of one eager step, summed over its kernels, against its wall time (near the wall time: the GPU is
busy all step and faster kernels are what helps; far below it: the step waits on launches), and
(3) the --top kernels or operators by device time per step (CUDA time on a GPU, the operators' own
CPU time otherwise). --tiny shrinks the model: a check that the script runs, not a measurement.
Run it from the repository root. Results: docs/perf/prism.md.
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
from tasks import TASKS  # noqa: E402


def config(name: str, device: str, tiny: bool) -> train.TrainConfig:
    run = experiments.run_of("prism-more", name)
    values = {**run, "device": device, "workers": 0, "graphs": device.startswith("cuda")}
    if tiny:
        values.update(d_model=32, n_layers=2, n_heads=2, batch_size=4,
                      opts={**run["opts"], "prism_bins": 16, "prism_dim": 16})
    cfg = cli.make_config(values, "gpu")
    task = TASKS[cfg.task]
    cfg.model.vocab_size, cfg.model.causal = len(task.vocab), task.causal
    return cfg


def sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="reverse", help="a task of prism-more")
    p.add_argument("--steps", type=int, default=30, help="steps timed, and steps profiled")
    p.add_argument("--warm", type=int, default=5, help="steps before the clock starts (graph captures)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="auto")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", help="also write the numbers to this JSON file")
    a = p.parse_args(argv)
    device = train.device_of(a.device)
    cfg = config(a.task, device, a.tiny)
    task = TASKS[cfg.task]
    length = max(cfg.train_lengths or task.train_lengths)
    rng = np.random.default_rng(0)
    data = [task.sample(cfg.batch_size, length, rng, **cfg.task_opts) for _ in range(a.warm + a.steps)]
    torch.manual_seed(cfg.seed)
    model = train.build_model(cfg.model).to(device)
    opt = train.make_optimizer(model, cfg, device)
    train.set_lr(opt, cfg.lr)

    step = train.Step(model, model, opt, cfg, task, device)           # (1) as the loop runs it
    for batch in data[:a.warm]:
        step(batch)
    sync(device)
    tic = time.perf_counter()
    for batch in data[a.warm:]:
        step(batch)
    sync(device)
    rate = a.steps / (time.perf_counter() - tic)
    step.release()

    cfg.graphs = False                                                  # (2), (3): every kernel seen
    eager = train.Step(model, model, opt, cfg, task, device)
    eager(data[0])
    sync(device)
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    tic = time.perf_counter()
    with profile(activities=activities) as prof:
        for batch in data[a.warm:]:
            eager(batch)
        sync(device)
    wall = (time.perf_counter() - tic) / a.steps * 1e3
    per = defaultdict(float)                                           # ms per step, by kernel / operator
    for evt in prof.key_averages():
        if device.startswith("cuda"):                                  # the kernels themselves (an
            if "CUDA" not in str(getattr(evt, "device_type", "")):     # operator's entry repeats its
                continue                                               # kernels' time)
            us = getattr(evt, "self_device_time_total", None)
            us = evt.self_cuda_time_total if us is None else us
        else:
            us = evt.self_cpu_time_total
        if us > 0:
            per[evt.key] += us / 1e3 / a.steps
    busy = sum(per.values())
    top = sorted(per.items(), key=lambda kv: -kv[1])[:a.top]
    where = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(f"{a.task} prism, batch {cfg.batch_size} at length {length}, {cfg.model.n_layers} layers, on {where}")
    print(f"(1) train.Step{' with CUDA graphs' if device.startswith('cuda') else ''}: {rate:.1f} steps/s "
          f"({1e3 / rate:.1f} ms a step)")
    print(f"(2) one eager step: {busy:.1f} ms of {'device' if device.startswith('cuda') else 'CPU'} time in "
          f"{wall:.1f} ms wall (profiled)")
    print("(3) by kernel / operator, ms per step:")
    for name, ms in top:
        print(f"  {ms:8.3f}  {100 * ms / busy:5.1f}%  {name[:100]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(task=a.task, device=where, batch=cfg.batch_size, length=length, steps_per_s=rate,
                           eager_busy_ms=busy, eager_wall_ms=wall, top=top, git=train.git_hash()), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
