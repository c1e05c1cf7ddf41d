"""Seeds of one configuration trained as one batched model, against one run alone: does one step for
all seeds beat one process per seed (`bench.py --op jobs`)?

    python docs/perf/batched_seeds.py --task parity --method vipe --seeds 8 --steps 2000 --alone
    python docs/perf/batched_seeds.py --task copy --method rope --seeds 2 --steps 4 --check --device cpu

One model per seed, built as train.train builds it (torch.manual_seed(seed), then train.build_model),
their parameters stacked (torch.func.stack_module_state) and trained by one step through train.Step
(on CUDA a CUDA graph per padded length): every seed's own batch from its own tasks.TrainBatches
stream, its own loss, its gradient clipped on its own norm, and one AdamW step over the stacked
tensors, with the learning rate of train.lr_at. The layers take their PyTorch paths (vmap cannot
enter the Triton kernels' autograd functions). Causal tasks without UPE's slots only.

Prints steps/s of the batched step and seed-steps/s (x seeds); --alone also trains seed 0 alone with
train.Step for the same steps, on the paths train.py takes (Triton kernels on CUDA); --check trains
every seed alone on the PyTorch paths and compares its losses step by step with the batched ones
(they agree to float rounding, or the batching is wrong). Run it from the
repository root. Settings: the GPU preset of the task on CUDA, the CPU preset otherwise, and the flags.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")
import cli                 # noqa: E402
import path_attention      # noqa: E402
import prism               # noqa: E402
import train               # noqa: E402
import upe                 # noqa: E402
import vipe                # noqa: E402
from model import autocast  # noqa: E402
from tasks import IGNORE, TASKS, collate  # noqa: E402


class BatchedStep(train.Step):
    """train.Step for G stacked models. A batch is the G seeds' batches concatenated (G * B rows, one
    padded width), seen as (G, B, T) inside the step."""

    def __init__(self, base, params: dict, buffers: dict, opt, cfg, task, device: str):
        super().__init__(None, None, opt, cfg, task, device)
        self.base, self.params, self.module_buffers = base, params, buffers   # (Step's own `buffers`: inputs)
        self.pad = True                  # padded widths everywhere, so that the CPU check covers CUDA's path
        self.G = next(iter(params.values())).shape[0]

    def loss(self, p, b, x, y, ctx):
        """One seed: parameters p, buffers b, x and y (B, T) -> its mean loss (0-dim)."""
        logits = functional_call(self.base, (p, b), (x, ctx))
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)

    def body(self, x, y, ctx):
        x, y = x.view(self.G, -1, x.shape[-1]), y.view(self.G, -1, y.shape[-1])       # (G, B, T)
        # SDPA without its memory-efficient backend, whose backward rejects the strides that vmap gives
        # ViPE's inputs ("LSE is not correctly aligned"): flash attention where it applies, else the math path
        with autocast(self.device, self.cfg.precision), sdpa_kernel([SDPBackend.FLASH_ATTENTION,
                                                                           SDPBackend.MATH]):
            losses = vmap(self.loss, in_dims=(0, 0, 0, 0, None), randomness="different")(
                self.params, self.module_buffers, x, y, ctx)                                    # (G,)
        losses.sum().backward()          # the seeds share no parameter: each gets its own gradient
        grads = [p.grad for p in self.params.values()]
        norms = torch.stack([g.flatten(1).float().pow(2).sum(1) for g in grads]).sum(0).sqrt()   # (G,)
        scale = (self.cfg.grad_clip / (norms + 1e-6)).clamp(max=1.0)   # clip_grad_norm_, per seed
        for g in grads:
            g.mul_(scale.view(-1, *[1] * (g.dim() - 1)).to(g.dtype))
        self.opt.step()
        return losses.detach()


def stacked_optimizer(params: dict, cfg: train.TrainConfig, device: str):
    """train.make_optimizer's AdamW for stacked tensors (one more leading dim): weight decay on the
    models' matrices, none on their vectors; learning-rate tensors on CUDA, as a graph reads them."""
    cuda = device.startswith("cuda")
    groups = [{"params": [p for p in params.values() if p.dim() >= 3], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params.values() if p.dim() < 3], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.beta2), eps=cfg.adam_eps, fused=cuda,
                            capturable=cuda)
    for g in opt.param_groups:
        g["lr_scale"] = 1.0
        if cuda:
            g["lr"] = torch.tensor(float(g["lr"]), device=device)
    return opt


def configs(args) -> list[train.TrainConfig]:
    device = train.device_of(args.device)
    values = dict(task=args.task, method=args.method, steps=args.steps, device=device, workers=args.workers,
                  graphs=device.startswith("cuda"), ckpt_every=10 ** 9, log_every=1e9)
    values.update({k: v for k, v in (("batch_size", args.batch_size), ("d_model", args.d_model),
                                     ("n_layers", args.n_layers), ("n_heads", args.n_heads)) if v is not None})
    cfgs = [cli.make_config({**values, "seed": s}, "gpu" if device.startswith("cuda") else "cpu")
            for s in range(args.seeds)]
    task = TASKS[args.task]
    for cfg in cfgs:
        cfg.model.vocab_size, cfg.model.causal = len(task.vocab), task.causal
    return cfgs


def seed_model(cfg: train.TrainConfig):
    torch.manual_seed(cfg.seed)                       # as train.train: the seed, then the model
    return train.build_model(cfg.model).to(train.device_of(cfg.device))


def stream(cfg: train.TrainConfig):
    """The seed's training batches, as train.train draws them."""
    task = TASKS[cfg.task]
    return train.batches(cfg, task, cfg.train_lengths or task.train_lengths, 0, cfg.steps)


def timed(step, batches, cfg, opt, warm: int) -> tuple[list, float]:
    """Run every step; (the losses of each step, steps/s after the first `warm` steps)."""
    cuda = train.device_of(cfg.device).startswith("cuda")
    losses, t0 = [], None
    for k, batch in enumerate(batches):
        if k == warm:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        train.set_lr(opt, train.lr_at(k, cfg))
        losses.append(step(batch))
    if cuda:
        torch.cuda.synchronize()
    rate = (len(losses) - warm) / (time.perf_counter() - t0) if t0 is not None else float("nan")
    return torch.stack(losses).float().cpu().tolist(), rate


def alone(cfg: train.TrainConfig, warm: int) -> tuple[list, float]:
    """One seed trained by train.Step on its own stream: (its losses, steps/s)."""
    device = train.device_of(cfg.device)
    model = seed_model(cfg)
    opt = train.make_optimizer(model, cfg, device)
    step = train.Step(model, model, opt, cfg, TASKS[cfg.task], device)
    batches = stream(cfg)
    try:
        return timed(step, batches, cfg, opt, warm)
    finally:
        batches.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="parity")
    p.add_argument("--method", default="vipe")
    p.add_argument("--seeds", type=int, default=8, help="seeds 0 .. N-1 in one batched model")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warm", type=int, default=20, help="steps before the clock starts (graph captures)")
    p.add_argument("--device", default="auto")
    p.add_argument("--workers", type=int, default=1, help="data processes per seed")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--d-model", type=int)
    p.add_argument("--n-layers", type=int)
    p.add_argument("--n-heads", type=int)
    p.add_argument("--alone", action="store_true", help="also time seed 0 trained alone")
    p.add_argument("--check", action="store_true", help="train every seed alone and compare the losses")
    p.add_argument("--out", help="also write the numbers to this JSON file")
    args = p.parse_args(argv)
    task = TASKS[args.task]
    if not task.causal:
        raise SystemExit(f"{args.task} is bidirectional: this script takes causal tasks only")
    backends = {module: module.BACKEND for module in (path_attention, prism, upe, vipe)}
    for module in backends:
        module.BACKEND = "torch"                      # vmap cannot enter the Triton kernels
    cfgs = configs(args)
    device = train.device_of(cfgs[0].device)
    warm = min(args.warm, args.steps - 1)
    models = [seed_model(cfg) for cfg in cfgs]
    params, buffers = stack_module_state(models)      # name -> (G, ...) leaf tensors
    base = copy.deepcopy(models[0]).to("meta")        # the structure functional_call runs
    opt = stacked_optimizer(params, cfgs[0], device)
    step = BatchedStep(base, params, buffers, opt, cfgs[0], task, device)
    streams = [stream(cfg) for cfg in cfgs]
    try:
        batches = (collate(list(group), task.pad_id) for group in zip(*streams))
        losses, rate = timed(step, batches, cfgs[0], opt, warm)
    finally:
        for s in streams:
            s.close()
    G = len(cfgs)
    result = {"task": args.task, "method": args.method, "seeds": G, "steps": args.steps,
              "device": train.device_name(device), "batch_size": cfgs[0].batch_size,
              "batched_steps_per_s": rate, "seed_steps_per_s": G * rate}
    print(f"{args.task} {args.method}, {G} seeds as one model on {result['device']}: {rate:.1f} steps/s, "
          f"{G * rate:.1f} seed-steps/s")
    if args.alone:
        for module, backend in backends.items():      # alone: the paths train.py takes
            module.BACKEND = backend
        _, one = alone(cfgs[0], warm)
        for module in backends:
            module.BACKEND = "torch"
        result["alone_steps_per_s"] = one
        print(f"seed 0 alone: {one:.1f} steps/s; the batched model: {G * rate / one:.2f}x its seed-steps/s")
    if args.check:
        worst = 0.0
        for g, cfg in enumerate(cfgs):
            own, _ = alone(cfg, warm)
            batched = [row[g] for row in losses]
            worst = max(worst, max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(own, batched)))
        result["largest_relative_loss_difference"] = worst
        print(f"each seed alone against the batched model: largest relative difference of a step's loss {worst:.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
