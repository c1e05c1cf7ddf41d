"""One run: the method registry, the training config, the optimiser step (CUDA graphs on a GPU)
and the loop with its checkpoints. Evaluation is in evaluation.py, the command line and its checks
in cli.py.

    python train.py --method rope --task flipflop
    import cli, train; metrics = train.train(cli.make_config(dict(task="copy", method="rope"), "cpu"))

`train` trains the shared Transformer of model.py on data generated on the fly (tasks.py), then
evaluates exact match and token accuracy at every test length (evaluation.evaluate, or the method's
own final_eval), and writes runs/<task>/<method>/seed<S>/{metrics.json, model.pt}.
Shapes: B batch, T time, V vocabulary.
"""
from __future__ import annotations

if __name__ == "__main__":   # `python train.py ...`: the command line (cli.py) takes over before this
    import sys               # file's body runs, so that the body runs once, as the module `train`
    import cli
    sys.exit(cli.main())

import copy
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import path_attention
import prism
import upe
import vipe
from examples import relative_bias
from evaluation import checkpoint_losses, device_name, evaluate, fmt_time, git_hash, save_atomic, summary_line
from model import (Final, SinusoidalAPE, Method, Model, ModelConfig, autocast, baseline, batch_context,
                   largest_logits)
from tasks import IGNORE, TASKS, Batch, Task, TrainBatches, curriculum_lengths

# Every position encoding by name: one line each. A new encoding is a Method in its own file
# (see examples/relative_bias.py) and one line here.
METHODS: dict[str, Method] = {
    "nope": baseline("nope"),
    "ape": baseline("nope", hooks=SinusoidalAPE),
    **{name: baseline(name) for name in ("rope", "alibi", "t5", "fire")},
    "fox": path_attention.FOX,
    "path": path_attention.PATH,
    "path-fox": path_attention.PATH_FOX,
    "vipe": vipe.VIPE,
    "rpe": upe.RPE,
    "upe": upe.UPE,
    "prism": prism.PRISM,
    "relbias": relative_bias.RELBIAS,
}


def build_model(cfg: ModelConfig) -> Model:
    """The model of a config, with the encoding named by cfg.method."""
    return Model(cfg, METHODS[cfg.method])


# =============================================================================================
# Training
# =============================================================================================

@dataclass
class TrainConfig:
    task: str = "flipflop"            # a key of tasks.TASKS
    method: str = "rope"              # a key of METHODS
    seed: int = 0                     # seeds the model init and the data stream
    steps: int = 1000                 # optimiser steps
    batch_size: int = 64              # sequences per step
    lr: float = 1e-3                  # peak learning rate (AdamW)
    weight_decay: float = 0.01        # AdamW weight decay
    beta2: float = 0.999              # AdamW's second-moment decay (its first is 0.9)
    adam_eps: float = 1e-6            # AdamW's epsilon, above PyTorch's 1e-8 (docs/perf/vipe.md, "Long runs")
    precision: str = "bf16"           # on CUDA: bf16 (autocast) | fp32 (no autocast); the CPU runs fp32
    warmup: int = 100                 # linear warm-up steps, then cosine decay to lr * min_lr_ratio
    min_lr_ratio: float = 0.1         # final learning rate as a fraction of the peak
    grad_clip: float = 1.0            # global gradient-norm clip
    train_lengths: list | None = None   # problem lengths sampled in training (None: the task's)
    test_lengths: list | None = None    # problem lengths evaluated (None: the task's)
    task_opts: dict = field(default_factory=dict)  # options passed to task.sample (e.g. n_back)
    curriculum: bool = False          # grow the maximum training length over the first half
    curriculum_steps: int = 0         # > 0: the curriculum on PRISM's own schedule (tasks.curriculum_lengths)
    train_set: int = 0                # > 0: a fixed training set of this many problems (0: fresh every step)
    n_eval: int = 256                 # evaluation examples per length (and variant)
    eval_every: int = 0               # evaluate during training every this many steps (0: only at the end)
    n_eval_during: int = 0            # > 0: examples per length in those evaluations (0: n_eval)
    eval_from_loss: float = 0.0       # > 0: they start once the mean loss of the last eval_every steps is below it
    held_out_lengths: list | None = None  # also evaluated then, on other examples (the UPE paper's rule)
    ckpt_every: int = 500             # write a checkpoint every this many steps (less often if slow: CKPT_SHARE)
    log_every: float = 5.0            # seconds between progress lines
    device: str = "auto"              # auto | cpu | cuda
    workers: int = 0                  # processes that make training batches ahead of the step (0: in the loop)
    graphs: bool = False              # replay each step from a CUDA graph per padded length (CUDA only)
    bucket: int = 32                  # with graphs or compile, batches are padded to a multiple of this many tokens
    compile: bool = False             # torch.compile the model (CUDA only)
    tf32: bool = False                # CUDA: float32 matrix products in TF32 (PRISM's position scores)
    runs_at_once: int = 1             # runs sharing its device as it starts (recorded for the plan's times)
    preset: str = ""                  # the preset the defaults came from (recorded, not used)
    out: str = "runs"                 # output root
    tag: str = ""                     # run name suffix: runs/<task>/<method>[-tag]
    model: ModelConfig = field(default_factory=ModelConfig)

    def run_dir(self) -> Path:
        name = self.method + (f"-{self.tag}" if self.tag else "")
        return Path(self.out) / self.task / name / f"seed{self.seed}"


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio; a function of the step (resuming keeps no state)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def device_of(name: str) -> str:
    """"auto": CUDA where there is a GPU, else the CPU; any other name as given (cli checks it)."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


CKPT = "checkpoint.pt"
CKPT_SHARE = 0.03   # a periodic checkpoint's write, less 0.1 s, takes at most this share of the time between two
JUMP = (0.01, 0.05, 3)   # a loss above 0.05 after one below 0.01, at one curriculum length: a jump (the last 3 kept)


class NaNLoss(Exception):
    pass


class Step:
    """One optimiser step: forward, loss, backward, gradient clip, AdamW; returns the loss on the device.

    With cfg.graphs (CUDA), a batch is right-padded to a multiple of cfg.bucket tokens; the first batch of each
    padded length runs eagerly (a real step), then that step is captured as a CUDA graph which the later
    batches of the length replay: one launch instead of hundreds for a tiny model (a compiled model: its first
    two batches eagerly, as it compiles some of its frames on its second call). The graphs share one
    memory pool (they replay one at a time, each replay's loss copied before the next), so a run holds the
    memory of its largest step; `release` frees it. Padding changes no result beyond float rounding: pads
    come after every real token (causal models never read them), are never supervised, and bidirectional
    models mask them as keys. A smaller bucket wastes fewer tokens, in more shapes (each one captured, and
    compiled under --compile)."""

    def __init__(self, model, fwd, opt, cfg: TrainConfig, task: Task, device: str, s: float = 1.0):
        self.model, self.fwd, self.opt, self.cfg, self.task, self.device = model, fwd, opt, cfg, task, device
        self.s = s                              # ctx["s"]: 1 in training (see `finetune`)
        self.pad = cfg.graphs or cfg.compile    # compiled models: a few shapes, so a few compilations
        self.buffers, self.graphs = {}, {}      # padded length -> static (x, y, slot); -> (graph, loss)
        self.eager = {}                         # padded length -> eager steps run before its capture
        self.pool = None                        # the graphs' memory pool

    def body(self, x, y, ctx):
        """x, y: (B, T) on the device -> the loss (0-dim). Padded inputs get their key mask here,
        from x, so that a CUDA graph recomputes it for every batch."""
        if self.pad and not self.task.causal:
            ctx = {**ctx, "key_mask": x != self.task.pad_id}
        with autocast(self.device, self.cfg.precision):
            logits = self.fwd(x, ctx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        return loss.detach()

    def __call__(self, batch: Batch):
        if not self.pad:
            self.opt.zero_grad(set_to_none=True)
            return self.body(batch.x.to(self.device, non_blocking=True), batch.y.to(self.device, non_blocking=True),
                             batch_context(self.task, batch, self.device, self.s))
        T = -(-batch.x.shape[1] // self.cfg.bucket) * self.cfg.bucket
        if T not in self.buffers:
            self.buffers[T] = [None if t is None else torch.empty(len(t), T, dtype=torch.long, device=self.device)
                               for t in (batch.x, batch.y, batch.slot)]
        x, y, slot = self.buffers[T]
        for dst, src, pad in zip((x, y, slot), (batch.x, batch.y, batch.slot), (self.task.pad_id, IGNORE, -1)):
            if src is not None:
                dst[:, src.shape[1]:] = pad
                dst[:, :src.shape[1]].copy_(src, non_blocking=True)
        if T in self.graphs:
            graph, loss = self.graphs[T]
            graph.replay()
            return loss.clone()
        ctx = {"s": self.s} if slot is None else {"s": self.s, "slot": slot, "slot_max": int(batch.slot.max())}
        self.opt.zero_grad(set_to_none=True)
        if not self.cfg.graphs:
            return self.body(x, y, ctx)
        side = torch.cuda.Stream()                       # the eager step before a capture runs on a
        side.wait_stream(torch.cuda.current_stream())    # side stream, as torch.cuda.graph asks
        with torch.cuda.stream(side):
            first = self.body(x, y, ctx)
        torch.cuda.current_stream().wait_stream(side)
        self.eager[T] = self.eager.get(T, 0) + 1
        if self.cfg.compile and self.eager[T] < 2:       # a compiled model compiles some frames (where a graph
            return first                                 # break resumes) on its second call: not in a capture
        graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)             # the graph's backward allocates the gradients
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            loss = self.body(x, y, ctx)
        self.graphs[T] = (graph, loss)
        return first

    def release(self):
        """Frees the graphs and their memory (the gradients too): after training and fine-tuning."""
        self.opt.zero_grad(set_to_none=True)
        self.graphs, self.buffers, self.pool = {}, {}, None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def compiled(model, backend: str = "inductor"):
    """torch.compile for the training step: one static compilation per padded length (Step pads to a few).
    torch's default compiles the second length it meets, and every later one, with the length as a symbol:
    generic kernels, slower than those of a fixed length, so a curriculum run kept them for all its later
    stages. The evaluation runs the model uncompiled. AOTAutograd's cache of compiled graphs is turned off: saving
    an entry crashed the process (a segmentation fault in its pickling, in the first backward pass) for UPE's model
    at the UPE paper's width on the GPU; each run compiles its own graphs either way. Up to 64 shapes compile (torch's
    default, 8, would leave a long curriculum's later stages uncompiled under a small --bucket)."""
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(model, dynamic=False, backend=backend)


def make_optimizer(model, cfg: TrainConfig, device: str):
    """AdamW: weight decay on matrices only, the method's extra groups (PRISM's alpha) at their own
    ratio to the base learning rate. On CUDA fused, with tensor learning rates a CUDA graph reads."""
    method = METHODS[cfg.method]
    groups = method.param_groups(model, cfg.lr) if method.param_groups else []
    grouped = {id(p) for g in groups for p in g["params"]}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in grouped]
    no_decay = [p for p in model.parameters() if p.dim() < 2 and id(p) not in grouped]
    cuda = device.startswith("cuda")
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}] + groups, lr=cfg.lr,
                            betas=(0.9, cfg.beta2), eps=cfg.adam_eps, fused=cuda, capturable=cuda)
    for g in opt.param_groups:
        g["lr_scale"] = g.get("lr", cfg.lr) / cfg.lr  # extra groups keep their ratio to the base lr
        if cuda:
            g["lr"] = torch.tensor(float(g["lr"]), device=device)
    return opt


def set_lr(opt, lr: float):
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr * g["lr_scale"])
        else:
            g["lr"] = lr * g["lr_scale"]


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a run between two steps, after it wrote its checkpoint."""


def train(cfg: TrainConfig, resume: bool = False, log=print, flag: dict | None = None) -> dict:
    """Train one model from cfg (or continue its checkpoint), evaluate it, write metrics.json and model.pt in
    cfg.run_dir(); return the metrics. The loop stops with a checkpoint when flag["stop"] is set (cli.run sets
    it on SIGINT/SIGTERM). The config is taken as valid: cli.validate checks it."""
    task, flag, device = TASKS[cfg.task], flag or {"stop": None}, device_of(cfg.device)
    commit = git_hash()      # the code this process imported: read before a long run, not after it
    cfg.model.vocab_size, cfg.model.causal = len(task.vocab), task.causal
    ckpt = torch.load(cfg.run_dir() / CKPT, map_location="cpu", weights_only=False) if resume else None
    train_lengths, test_lengths = cfg.train_lengths or task.train_lengths, cfg.test_lengths or task.test_lengths
    train_max = max(train_lengths)

    torch.manual_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32   # this run's steps and evaluations (a process may run several)
    model = build_model(cfg.model).to(device)
    opt = make_optimizer(model, cfg, device)
    step, losses, wall, timed = 0, [], 0.0, [0, 0.0, 0.0]   # timed: steps, seconds, data wait of earlier processes
    history = []    # evaluations during training: {"step", "eval" (test set), "held_out" (other examples)}
    logit_max = []  # at each checkpoint: [step, the largest |attention logit| of each attention call]
    sets = [("eval", 1, test_lengths)] + ([("held_out", 2, cfg.held_out_lengths)] if cfg.held_out_lengths else [])
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        lrs = [g["lr"] for g in opt.param_groups]        # CUDA: the tensors a CUDA graph reads, kept
        opt.load_state_dict(ckpt["opt"])                 # (loading would put CPU copies in their place)
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        torch.set_rng_state(ckpt["torch_rng"])
        if device.startswith("cuda") and ckpt.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(ckpt["cuda_rng"])
        step, wall, history, logit_max = ckpt["step"], ckpt["wall"], ckpt.get("history", []), ckpt.get("logit_max", [])
        timed, losses = ckpt.get("timed", timed), checkpoint_losses(ckpt["losses"])
        log(f"resumed {cfg.run_dir()} at step {step}")
    fwd = compiled(model) if cfg.compile else model
    train_step = Step(model, fwd, opt, cfg, task, device)

    n_params = sum(p.numel() for p in model.parameters())
    log(f"{cfg.task} / {cfg.method} / seed {cfg.seed}: {cfg.model.n_layers} layers, {cfg.model.n_heads} heads, "
        f"d={cfg.model.d_model}, {n_params / 1e6:.2f}M params, {cfg.steps} steps x {cfg.batch_size} on {device}"
        + (f", {cfg.workers} data workers" if cfg.workers else "") + (", CUDA graphs" if cfg.graphs else ""))

    def checkpoint(cuda=device.startswith("cuda")):   # -> the time from which the next periodic one is due
        tic = time.time()                             # (the losses go as one float32 tensor, 8 bytes a step)
        save_atomic({"config": asdict(cfg), "model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                     "torch_rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state() if cuda else None,
                     "wall": time.time() - t0, "history": history, "timed": timing(), "logit_max": logit_max,
                     "losses": torch.tensor(losses, dtype=torch.float32).view(-1, 2)}, cfg.run_dir() / CKPT)
        return time.time() + max(0.0, time.time() - tic - 0.1) / CKPT_SHARE

    def forked(net, net_opt, during=False):   # method_final over a deep copy of the model (eager) and an optimiser
        net = copy.deepcopy(net)
        new_opt = make_optimizer(net, cfg, device)                # over the copy, with copies of the Adam moments
        new_opt.load_state_dict(copy.deepcopy(net_opt.state_dict()))   # (loading a state dict shares its tensors)
        return method_final(net, net, new_opt, during)

    def method_final(net, net_fwd, net_opt, during=False):   # what the method's final_eval works on (model.Final)
        n = (cfg.n_eval_during or cfg.n_eval) if during else cfg.n_eval
        how = cfg if net_fwd is fwd else replace(cfg, graphs=False, compile=False)   # a copy: eager
        return Final(cfg.model.opts, train_max, test_lengths, (lambda *_: None) if during else log, during=during,
                     evaluate=lambda lengths, s=1.0: evaluate(net, task, lengths, n, cfg.seed, device, cfg.task_opts, s,
                                                              precision=cfg.precision, stop=flag.get("check")),
                     finetune=lambda steps, s, fresh=True, lr=None: finetune(net, net_fwd, net_opt, how, task,
                                                                            train_lengths, device, flag, steps, s,
                                                                            fresh, lr),
                     fork=lambda: forked(net, net_opt, during))

    probe = task.sample(16, max(train_lengths), np.random.default_rng([cfg.seed, 3]), **cfg.task_opts)

    def probe_logits():      # on the same 16 training sequences each time (their own generator)
        with autocast(device, cfg.precision):
            return largest_logits(model, probe.x.to(device), batch_context(task, probe, device))

    model.train()
    t0, last_log, log_step = time.time() - wall, time.time(), step
    waited, log_waited, due_ckpt = 0.0, 0.0, 0.0   # data wait (s; in all, at the last log); when a checkpoint is due
    warm = step + min(50, (cfg.steps - step) // 5)   # steps/s and data wait in the metrics: after these
    mark = (step, time.time(), 0.0)             # steps (compiles, graph captures, workers starting)

    def timing():   # [steps, seconds, data wait] after the warm-up: before a resume, and here if steps ran
        now = (step - mark[0], time.time() - mark[1], waited - mark[2]) if step > mark[0] else (0, 0.0, 0.0)
        return [a + b for a, b in zip(timed, now)]
    pending = []  # losses still on the device: reading each one would stall the GPU every step
    # jumps: the last step below JUMP[0] (0: none), is the loss in a jump now (not back below since)
    jump = {"low": max([s for s, v in losses if v < JUMP[0]], default=0)}
    jump["up"] = jump["low"] > 0 and losses[-1][1] >= JUMP[0]

    def top(at: int) -> int:    # the curriculum's longest length at step `at` (batch at - 1; 0 without a curriculum)
        return max(curriculum_lengths(at - 1, cfg.steps, train_lengths, cfg.curriculum_steps)) if cfg.curriculum else 0

    def keep_before_jump(at: int):
        """The last checkpoint, from before the jump at step `at`, as before-jump-<at>.pt (docs/perf/vipe.md)."""
        jump["up"] = True
        if (cfg.run_dir() / CKPT).exists():
            shutil.copyfile(cfg.run_dir() / CKPT, cfg.run_dir() / f"before-jump-{at}.pt")
            kept = sorted(cfg.run_dir().glob("before-jump-*.pt"), key=lambda path: int(path.stem[len("before-jump-"):]))
            gone = [path.unlink() or path.name for path in kept[:-JUMP[2]]]   # a late jump is the one to replay
            log(f"  loss {losses[-1][1]:.3g} at step {at} after it had been below {JUMP[0]}: kept the checkpoint "
                f"before it as before-jump-{at}.pt" + (f" (removed the earliest, {', '.join(gone)})" if gone else ""))

    def flush():
        """Move pending losses to the host; stop at the first non-finite one."""
        if not pending:
            return
        values = torch.stack(pending).tolist()
        first = step - len(values) + 1
        for k, v in enumerate(values):
            if not math.isfinite(v):
                last, kept = losses[-1][1] if losses else None, (cfg.run_dir() / CKPT).exists()
                raise NaNLoss(f"loss is {v} at step {first + k} (counted as in the progress lines); last finite "
                              f"loss {'none' if last is None else f'{last:.4g}'} ("
                              + (f"the last checkpoint in {cfg.run_dir()} is kept)" if kept else "no checkpoint written)"))
            losses.append([first + k, v])
            if v < JUMP[0]:
                jump.update(low=first + k, up=False)
            elif v > JUMP[1] and jump["low"] and not jump["up"] and top(first + k) == top(jump["low"]):
                keep_before_jump(first + k)
        pending.clear()

    def evaluating():   # the evaluations during training start once the recent loss is below eval_from_loss
        flush()
        return not cfg.eval_from_loss or np.mean([v for _, v in losses[-cfg.eval_every:]]) < cfg.eval_from_loss

    def due():   # an evaluation during training at this step, not yet made
        made = history and history[-1]["step"] == step
        return cfg.eval_every and step % cfg.eval_every == 0 and not made and (history or evaluating())

    def evaluate_during():   # its own checkpoint first: a signal stops it at once, and --resume makes it again
        flush()
        checkpoint()
        flag["now"] = (f"stopped by signal during the evaluation at step {step}, checkpoint written: the same command "
                       "with --resume evaluates it and goes on (with --reproduce, the same command)")
        history.append({"step": step, **{key: evaluate(
            model, task, lengths, cfg.n_eval_during or cfg.n_eval, cfg.seed, device, cfg.task_opts, stream=stream_id,
            precision=cfg.precision, stop=flag.get("check")) for key, stream_id, lengths in sets}})
        if METHODS[cfg.method].final_eval:      # the method's own reading (ViPE's fine-tuning) on a copy
            history[-1]["final"] = METHODS[cfg.method].final_eval(forked(model, opt, True))[0]
        flag.pop("now")
        log("  eval: " + summary_line(history[-1]["eval"], max(train_lengths)))

    if step and due():
        evaluate_during()                        # a run stopped during this evaluation: made again first
    stream = batches(cfg, task, train_lengths, step, cfg.steps)
    try:
        while step < cfg.steps:
            if flag["stop"]:
                flush()
                checkpoint()
                raise Interrupted(f"stopped by signal {flag['stop']} after step {step}, checkpoint written: "
                                  "the same command with --resume continues it (with --reproduce, the same command)")
            if step == warm:
                flush()
                mark = (step, time.time(), waited)
            tic = time.time()
            batch = next(stream)
            waited += time.time() - tic
            set_lr(opt, lr_at(step, cfg))
            pending.append(train_step(batch))
            step += 1
            if device == "cpu" or len(pending) >= 50:
                flush()
            at_checkpoint = step % cfg.ckpt_every == 0 or step == cfg.steps
            if at_checkpoint:
                flush()   # never checkpoint (or probe) weights that a NaN step has touched
                logit_max.append([step, probe_logits()])
            now = time.time()
            if now - last_log >= cfg.log_every or step == cfg.steps:
                flush()
                rate = (step - log_step) / (now - last_log)
                log(f"  step {step:>6}/{cfg.steps} | loss {losses[-1][1]:.4f} | lr {lr_at(step - 1, cfg):.2e} | "
                    f"{rate:6.1f} steps/s | data wait {100 * (waited - log_waited) / (now - last_log):.0f}% | "
                    f"eta {fmt_time((cfg.steps - step) / max(rate, 1e-9))}"
                    + (f" | logit max {max(logit_max[-1][1]):.3g}" if logit_max else ""))
                last_log, log_step, log_waited = now, step, waited
            if due():
                evaluate_during()
            if at_checkpoint and (step == cfg.steps or time.time() >= due_ckpt):
                due_ckpt = checkpoint()
    finally:
        stream.close()                           # stops the data workers, however the loop ends
    wall, (ran, loop, wait) = time.time() - t0, timing()
    train_step.release()
    # from here to the evaluation's end a signal stops the run at once (jobs.stop_signals; flag["check"] before
    # each pass of the evaluation): the last step's checkpoint is written, and --resume goes straight to evaluating
    flag["now"] = (f"stopped by signal during the final evaluation; the checkpoint at step {step} is intact: "
                   "the same command with --resume evaluates it")
    t_final = time.time()
    final, final_eval = method_final(model, fwd, opt), METHODS[cfg.method].final_eval
    rows, extra = final_eval(final) if final_eval else (final.evaluate(test_lengths), {})
    flag.pop("now", None)                      # evaluated: a signal from here waits, and the run's files get written
    final_s = time.time() - t_final            # the final evaluation's seconds (with ViPE's fine-tuning)
    in_dist = [r["exact"] for r in rows if r["length"] <= train_max and r["variant"] in (None, "ID")]
    stride = max(1, len(losses) // 500)                    # at most about 1000 of the losses kept
    metrics = {
        "task": cfg.task, "method": cfg.method, "seed": cfg.seed, "config": asdict(cfg),
        "git": commit, "device": device_name(device), "wall_s": round(wall, 1), "final_eval_s": round(final_s, 1),
        "steps_per_s": round(ran / loop, 2) if ran else None, "data_wait": round(wait / max(loop, 1e-9), 3),
        "peak_memory_gb": round(torch.cuda.max_memory_reserved() / 2 ** 30, 2) if device.startswith("cuda") else None,
        "n_params": n_params, "train_max_length": train_max,
        "train_exact": float(np.mean(in_dist)) if in_dist else None,
        "eval": rows, "loss": losses[::stride],            # every stride-th step's loss, and the highest
        "loss_peak": [max(losses[i:i + stride], key=lambda x: x[1]) for i in range(0, len(losses), stride)],
    }
    metrics.update({key: v for key, v in (*extra.items(), ("history", history), ("logit_max", logit_max)) if v})
    out = cfg.run_dir()
    save_atomic(model.state_dict(), out / "model.pt")
    save_atomic(metrics, out / "metrics.json")
    return metrics


def batches(cfg: TrainConfig, task: Task, lengths: list[int], start: int, end: int):
    """The training batches of steps start .. end - 1 (tasks.TrainBatches), cfg.workers processes ahead."""
    stream = TrainBatches(task, lengths, cfg.batch_size, cfg.seed, cfg.steps, cfg.curriculum, cfg.train_set,
                          cfg.curriculum_steps, **cfg.task_opts)
    return stream.loader(start, end, cfg.workers)


def finetune(model, fwd, opt, cfg: TrainConfig, task: Task, lengths, device: str, flag: dict, steps: int, s,
             fresh: bool = True, lr: float | None = None):
    """`steps` more steps of the same data stream at a constant rate, `lr` or the run's final one, with a new
    AdamW (fresh) or `opt` as training left it, and ctx["s"] = s in every attention call (ViPE's fine-tuning with
    compressed distances, the paper's eq. 7); `s` a number, or a function of the step k = 0, 1, ... (then
    eager: a CUDA graph or a compiled model would keep the first s). Returns the losses."""
    changing = callable(s)
    opt = make_optimizer(model, cfg, device) if fresh else opt
    step = Step(model, model if changing else fwd, opt, replace(cfg, graphs=False, compile=False) if changing
                else cfg, task, device, s=1.0 if changing else s)
    set_lr(opt, lr or cfg.lr * cfg.min_lr_ratio)
    losses, stream = [], batches(cfg, task, lengths, cfg.steps, cfg.steps + steps)
    try:
        for k, batch in enumerate(stream):
            if flag["stop"]:
                raise Interrupted(f"stopped by signal {flag['stop']} while fine-tuning: --resume continues from "
                                  f"the checkpoint at step {cfg.steps} and fine-tunes again")
            if changing:
                step.s = s(k)
            losses.append(step(batch))
    finally:
        stream.close()                           # stops the data workers, however the loop ends
    losses = torch.stack(losses).tolist() if losses else []
    step.release()
    if losses and not math.isfinite(losses[-1]):
        raise NaNLoss(f"loss is {losses[-1]} at the end of fine-tuning (the checkpoint at step {cfg.steps} is kept)")
    return losses
