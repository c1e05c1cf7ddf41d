"""Running configs: one in its folder (`run_in_folder`: the folder's lock, and refusing a folder whose
results or checkpoint were made with other options), or many at once: one after another, or `--jobs` of
them in a process pool, each logging to its <run>/train.log; SIGINT and SIGTERM turned into checkpoints
(`stop_signals`); CUDA MPS so that runs sharing a GPU run side by side; the GPUs shared out between the jobs;
job processes that outlive their runs found (/proc) and ended; and, before training, how long each run will
take (`time_of`, `print_plan`: the queue starts with the longest).

    failed = jobs.run_many(cfgs, cli.run, jobs=4)     # cli.run: one run with every check of the command line

Which runs to make is cli.py's (and experiments.py's); this file runs them. It imports train.py and below,
never cli.py: `run_many` receives the function that makes one run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from evaluation import fmt_time, glob_stored, read_metrics, read_stored, stored, summary_line
from model import ModelConfig
from tasks import TASKS, close_loaders
from train import CKPT, Interrupted, TrainConfig, device_of, train


@contextlib.contextmanager
def stop_signals():
    """Within: SIGINT and SIGTERM set flag["stop"] (the loop stops at the next step boundary)
    instead of interrupting wherever Python happens to be (only the main thread gets signals).
    While the loop has flag["now"] set (its message: the run is checkpointed and an evaluation runs,
    during training or the final one), a signal raises Interrupted at once, so that a long evaluation
    stops within a moment; once it has evaluated, the loop removes it (after the final one, the run's
    files are written whatever comes). Python drops an exception raised while it runs a finalizer (a
    data loader's __del__, say): flag["check"](), which every such evaluation calls before each pass,
    raises it again. After a stop, SIGTERM stays ignored: `timeout` and Slurm signal the process and then
    its whole group, and the second signal would otherwise kill the process before it says where it
    stopped."""
    def check():
        if flag["stop"] and flag.get("now"):
            raise Interrupted(flag["now"])
    flag = {"stop": None, "check": check}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(num, frame):
        flag.update(stop=num)
        if flag.get("now"):
            raise Interrupted(flag["now"])
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_IGN if s == signal.SIGTERM and flag["stop"] else handler)


class RunsFailed(Exception):
    """Some of several runs failed; the others ran to the end."""


class RunStopped(Exception):
    """A --jobs run stopped by a signal, with its checkpoint written (an Exception, unlike
    Interrupted, so that its process pool hands it back like any other outcome)."""


# =============================================================================================
# One run in its folder: its lock, and the options its results were made with
# =============================================================================================

class UsageError(Exception):
    """Bad input, found before anything is written: printed as one line by the command line (cli.main),
    which then exits with status 2."""


def run_in_folder(cfg: TrainConfig, resume: bool | str = False, log=print, force: bool = False) -> dict:
    """Train a checked config (cli.run) in its folder: refuse a folder holding other options, take its lock
    (run.lock) and train; SIGINT or SIGTERM stops the run at the next step with a checkpoint. Returns the
    metrics. resume: True, False, or "auto" (continue from the run's checkpoint where it has one: --reproduce)."""
    check_run_folder(cfg, resume is True, force)   # "auto": a checkpoint with other options is refused too
    if resume == "auto":
        resume = not force and (cfg.run_dir() / CKPT).exists()
        if resume:
            log(f"continuing {cfg.run_dir()} from its checkpoint")
    if resume:
        check_resume(cfg)
    lock = lock_run(cfg.run_dir())
    try:
        with stop_signals() as flag:
            return train(cfg, resume, log, flag)
    finally:
        lock.unlink(missing_ok=True)


def lock_run(run_dir: Path) -> Path:
    """Take <run>/run.lock (holding this process's pid) or refuse: another live process trains this
    run. A lock left by a process that is gone is taken over."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / "run.lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text() or 0)
                if pid <= 0:
                    raise ValueError("no pid")
                os.kill(pid, 0)                       # raises if no such process
            except (ValueError, ProcessLookupError, FileNotFoundError):
                lock.unlink(missing_ok=True)          # stale
                continue
            except PermissionError:                   # alive, owned by another user
                pass
            raise UsageError(f"{run_dir} is in use by process {pid} (remove {lock} if that is wrong)") from None
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return lock
    raise UsageError(f"cannot take {lock}")


# Settings of how a run executes, not of what it computes: a rerun may change them freely.
EXEC_KEYS = {"device", "workers", "graphs", "compile", "tf32", "runs_at_once", "log_every", "ckpt_every", "preset",
             "out", "bucket"}
RUN_KEYS = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in EXEC_KEYS]   # what a run computes


def other_setup(cfgs: list[TrainConfig], like, present: set) -> dict:
    """{id of a config: the options that differ} for each run present (`present`: ids of the configs
    with a metrics.json) that was made with other options than its experiment's setup: a setup changed
    since, whose old results a table must not take for the new. Each run is judged against the setup
    under the preset it was made with, `like(k, preset)`: run k's config under that preset (so a CPU
    builds the tables of GPU runs). Runs whose metrics hold no readable config are not judged."""
    found = {}
    for k, cfg in enumerate(cfgs):
        if id(cfg) not in present:
            continue
        try:
            saved = json.loads(read_stored(cfg.run_dir() / "metrics.json"))["config"]
            diff = saved_diff(saved, like(k, saved["preset"]), RUN_KEYS)
        except Exception:
            continue
        if diff:
            found[id(cfg)] = diff
    return found


def check_run_folder(cfg: TrainConfig, resume: bool, force: bool = False):
    """A run folder that holds a run (finished, or its checkpoint) with other options is refused
    unless --force, naming the options that differ: a rerun must not replace results silently."""
    if resume or force:
        return
    for name in ("metrics.json", CKPT):
        path = cfg.run_dir() / name
        if not stored(path):
            continue
        try:
            saved = json.loads(read_stored(path))["config"] if name.endswith(".json") else \
                torch.load(path, map_location="cpu", weights_only=False)["config"]
            diff = saved_diff(saved, cfg, RUN_KEYS)
        except Exception:   # an unreadable file holds no result to keep: it is overwritten
            continue
        if diff:
            what = "a finished run" if name.endswith(".json") else "a started run (its checkpoint)"
            raise UsageError(f"{cfg.run_dir()} holds {what} with other options ({diff}); give --tag NAME to "
                             f"keep both, or --force to replace it")
        return


# Fields that must agree between a checkpoint and the run resuming it.
RESUME_KEYS = ["task", "method", "seed", "batch_size", "train_lengths", "task_opts", "curriculum", "curriculum_steps",
               "train_set", "model"]


def check_resume(cfg: TrainConfig):
    """--resume: the run's checkpoint exists, reads, belongs to this config and is not past its end."""
    path = cfg.run_dir() / CKPT
    if not path.exists():
        raise UsageError(f"--resume: no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        saved = ckpt["config"]
        assert isinstance(saved, dict) and "model" in ckpt
    except Exception as e:  # any unreadable file is reported the same way
        raise UsageError(f"--resume: checkpoint {path} is corrupt or unreadable ({type(e).__name__})") from None
    diff = saved_diff(saved, cfg, RESUME_KEYS)
    if diff:
        raise UsageError(f"--resume: checkpoint {path} belongs to a different run ({diff})")
    if ckpt["step"] > cfg.steps:
        raise UsageError(f"--resume: checkpoint is at step {ckpt['step']}, beyond --steps {cfg.steps}")


def saved_diff(saved: dict, cfg: TrainConfig, keys) -> str:
    """config_diff between a run's saved config and cfg, as train() completes cfg (the task's
    vocabulary and causality), with defaults for fields newer than the saved run."""
    task = TASKS[cfg.task]
    new = asdict(cfg)
    new["model"].update(vocab_size=len(task.vocab), causal=task.causal)
    saved = {**asdict(TrainConfig()), **saved, "model": {**asdict(ModelConfig()), **saved["model"]}}
    if saved["method"] == "vipe":              # runs from when ViPE's two options were fields of the run
        old = {"vipe_finetune": saved.get("finetune_steps", 0), "vipe_s": saved.get("s_rule", "fixed")}
        saved["model"]["opts"] = {**{k: v for k, v in old.items() if v not in (0, "fixed")}, **saved["model"]["opts"]}
    return config_diff(saved, new, keys)


def config_diff(old: dict, new: dict, keys) -> str:
    """'model.d_model: 32 -> 64; seed: 0 -> 1' for the fields (and model sub-fields) that differ."""
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{k}.{s}: {a.get(s)} -> {b.get(s)}" for s in sorted(set(a) | set(b)) if a.get(s) != b.get(s)]
        elif a != b:
            out.append(f"{k}: {a} -> {b}")
    return "; ".join(out)


def run_many(cfgs: list[TrainConfig], run, jobs: int = 1, resume: bool | str = False, force: bool = False,
             mps: bool = True) -> list[str]:
    """Train every config with `run` (cli.run: one run with its checks, run(cfg, resume, log, force) -> metrics)
    in turn, or `jobs` of them at once, each in its own process with its log in <run>/train.log. A run's data
    and initialisation depend on its config alone, so the results are those of the runs one after the other.
    A run that fails (a NaN loss, CUDA out of memory, ...) does not stop the others: returns one line per
    failed run. With several jobs on a GPU they run under CUDA MPS (`mps_daemon`) unless mps is False."""
    t0, failed = time.time(), []

    def failure(folder, e):
        failed.append(f"{folder}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
        print(f"  [{fmt_time(time.time() - t0)}] failed {failed[-1]}", flush=True)

    if jobs <= 1 or len(cfgs) <= 1:
        for cfg in cfgs:
            try:
                run(cfg, resume=resume, force=force)
            except Exception as e:
                traceback.print_exc()
                failure(cfg.run_dir(), e)
        return failed
    gpus = visible_gpus()
    print(f"{len(cfgs)} runs, {jobs} at a time" + (f" over GPUs {', '.join(gpus)}" if len(gpus) > 1 else "")
          + "; each logs to <run>/train.log")
    ctx = multiprocessing.get_context("spawn")                   # CUDA: no fork
    stop = ctx.Event()                                           # set: queued runs do not start
    on_cpu = all(device_of(cfg.device) == "cpu" for cfg in cfgs)
    shared = mps and gpus and min(jobs, len(cfgs)) > len(gpus)   # some GPU runs several jobs
    sharing = mps_daemon(Path(cfgs[0].out) / ".mps", gpus) if shared else \
        passive_threads() if on_cpu else contextlib.nullcontext()
    stopped = []
    with stop_signals() as flag, sharing as renamed, \
            ProcessPoolExecutor(jobs, mp_context=ctx, initializer=start_job,
                                initargs=((renamed or gpus) if len(gpus) > 1 else [], ctx.Value("i", 0), stop)) as pool:
        futures = {pool.submit(run_logged, run, cfg, resume, force): cfg for cfg in cfgs}
        pending, passed_on, ended, finished = set(futures), False, 0, 0
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            if flag["stop"] and not passed_on:   # Ctrl-C reaches every process of the group; `kill PID`
                passed_on = True                 # only this one: the runs stop at their next step either way
                stop.set()
                for process in list(pool._processes.values()):   # the pool's processes (no public accessor)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, signal.SIGTERM)
            for future in done:
                folder, ended = futures[future].run_dir(), ended + 1
                try:
                    print(f"  [{fmt_time(time.time() - t0)}] done {folder} ({ended} of {len(cfgs)}): {future.result()}",
                          flush=True)
                    finished += 1
                except RunStopped as e:
                    started = str(e) != NOT_STARTED
                    if started:
                        stopped.append(folder)
                    print(f"  [{fmt_time(time.time() - t0)}] {folder}: "
                          + ("stopped, checkpoint written" if started else "not started"), flush=True)
                except Exception as e:
                    failure(folder, e)           # its traceback is in its train.log
        end_pool(pool)
    if flag["stop"]:                         # a run in its last moments may finish all the same
        left = len(cfgs) - finished - len(failed)
        raise Interrupted(f"stopped by signal {flag['stop']}: {len(stopped)} of {len(cfgs)} runs wrote a checkpoint"
                          + (f", {finished} finished" if finished else "")
                          + ((" (the same command continues each from it" if resume == "auto" else
                              " (--resume continues a run from it") + "; <run>/train.log says where each stopped)"
                             if left else "; every run finished")
                          + (f"; {len(failed)} failed" if failed else ""))
    return failed


@contextlib.contextmanager
def passive_threads():
    """For jobs on the CPU: the processes started in the block get OMP_WAIT_POLICY=PASSIVE, so that
    PyTorch's threads sleep between parallel regions instead of spinning. Each job starts a thread per
    core, and spinning threads of several jobs on the same cores wait on each other (docs/perf/
    training.md). Each job keeps a run's usual thread count, so its results are those of the run
    alone, bit for bit. A policy the user set is kept."""
    if "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


POOL_EXIT_WAIT = 10.0   # seconds for the job processes to exit once every run has ended (on a GPU they
                        # were seen not to exit on their own: docs/perf/vipe.md, "Stopping runs")


def end_pool(pool: ProcessPoolExecutor, wait: float = POOL_EXIT_WAIT, log=lambda line: print(line, flush=True)):
    """Shut down a pool whose runs have all ended, waiting at most `wait` seconds for its processes
    to exit. Every run's outcome is in by then (a stopped run has written its checkpoint), so a job
    process that has not exited (a thread or a child it left behind, its GPU context at exit) is
    killed with its child processes, with one line that says so and one per process on what it was
    doing, instead of holding the command until its time limit."""
    processes = list((pool._processes or {}).values())   # the pool's processes (no public accessor)
    pool.shutdown(wait=False)                              # its own thread joins them from now on, so
    running = {process.sentinel: process for process in processes}   # watch their sentinels (ready once
    deadline = time.time() + wait                          # a process has ended), not their exit codes
    while running and time.time() < deadline:
        for sentinel in multiprocessing.connection.wait(list(running), max(0.0, deadline - time.time())):
            running.pop(sentinel)
    stuck = list(running.values())
    states = [process_state(process.pid) for process in stuck]     # read before anything is killed
    for process in stuck:                                          # its children first: a data worker
        for pid in child_pids(process.pid) + [process.pid]:          # would outlive its job process
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if stuck:
        multiprocessing.connection.wait([process.sentinel for process in stuck], 10.0)
        log(f"  killed {len(stuck)} job process{'es' if len(stuck) > 1 else ''} (pid "
            f"{', '.join(str(x.pid) for x in stuck)}) still there {wait:g} s after the runs ended")
        for process, state in zip(stuck, states):
            if state:
                log(f"    pid {process.pid} was {state}")


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is pid, from Linux's /proc (none where there is no /proc)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:   # fields after "(name) ": state, ppid
                found.append(int(entry.name))
    return found


def process_state(pid: int) -> str:
    """What a process is doing, as /proc says: its state letter (R running, S sleeping, D in I/O, Z ended)
    and the kernel function it waits in, and the same for each of its child processes; "" without /proc.
    A process waiting for its children reads, for example, "S in do_wait; children: 812 S in futex_wait"."""
    def one(p: int) -> str:
        stat = Path(f"/proc/{p}/stat").read_text()
        letter = stat[stat.rindex(")") + 2:].split()[0]
        with contextlib.suppress(OSError):
            where = Path(f"/proc/{p}/wchan").read_text().strip()
            if where not in ("", "0"):
                return f"{letter} in {where}"
        return letter
    try:
        own = one(pid)
    except (OSError, ValueError, IndexError):
        return ""
    children = []
    for child in child_pids(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            children.append(f"{child} {one(child)}")
    return own + (f"; children: {', '.join(children)}" if children else "; no child processes")


MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_WAIT = 10.0   # seconds: for the daemon to open its control pipe, and to quit before it is killed
MPS_COST = ("the runs sharing a GPU take turns on it instead (measured on an H100: 8 ViPE runs at 1.12x one "
            "run's steps/s, 1.62x under MPS; docs/perf/training.md)")


@contextlib.contextmanager
def mps_daemon(folder: Path, gpus: list[str], log=print):
    """CUDA MPS for the duration of the block, so that the kernels of the processes sharing a GPU run
    side by side instead of taking turns. Starts `nvidia-cuda-mps-control -f` on `gpus` (this process's
    CUDA_VISIBLE_DEVICES) with its pipe and log folders in `folder`/<this process's id> (the pipe in /tmp
    when that path is too long for a socket): a folder of its own, so that two commands writing to one
    output folder at once each talk to their own daemon, and one that ends leaves the other's daemon and
    runs alone. Points the processes started in the block at it through
    CUDA_MPS_PIPE_DIRECTORY, and on leaving, however the block ends (Ctrl-C too), asks it to quit and
    ends it: nothing is left running. Its clients see the daemon's GPUs numbered from 0 (GPUs "2,3"
    are "0,1" to them), so the block's CUDA_VISIBLE_DEVICES is that numbering and the block receives
    the GPU names for the processes it starts. A daemon the user runs already
    (CUDA_MPS_PIPE_DIRECTORY set) is used as it is. Where none can start, one line says why and what
    that costs, and the block runs without (receiving None: the names are unchanged)."""
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        log(f"MPS: using the daemon at CUDA_MPS_PIPE_DIRECTORY={os.environ['CUDA_MPS_PIPE_DIRECTORY']}")
        yield
        return
    exe = shutil.which(MPS_CONTROL)
    if exe is None:
        log(f"MPS: {MPS_CONTROL} not found; {MPS_COST}")
        yield
        return
    home = folder / str(os.getpid())                  # this command's own: another command's daemon is left alone
    pipe, logs = home / "pipe", home / "log"
    logs.mkdir(parents=True, exist_ok=True)
    if len(str(pipe.resolve())) > 80:                 # the daemon's sockets live in it (108-byte paths)
        pipe = Path(tempfile.mkdtemp(prefix="mps-"))
    pipe.mkdir(parents=True, exist_ok=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe.resolve()), "CUDA_MPS_LOG_DIRECTORY": str(logs.resolve())}
    with open(logs / "daemon.out", "ab") as out:
        daemon = subprocess.Popen([exe, "-f"], env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)   # Ctrl-C reaches us only
    deadline = time.time() + MPS_WAIT
    while daemon.poll() is None and not (pipe / "control").exists() and time.time() < deadline:
        time.sleep(0.05)
    if daemon.poll() is not None or not (pipe / "control").exists():
        stop_mps(exe, daemon, env)
        said = (logs / "daemon.out").read_text(errors="replace").strip().splitlines()
        why = said[-1] if said else f"no control pipe after {MPS_WAIT:g} s"
        log(f"MPS: {MPS_CONTROL} did not start ({why}); {MPS_COST}")
        yield
        return
    log(f"MPS: daemon started for these runs (logs in {logs})")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    renamed = [str(i) for i in range(len(gpus))]
    os.environ.update(env, CUDA_VISIBLE_DEVICES=",".join(renamed))   # the processes started in the block inherit it
    try:
        yield renamed
    finally:
        for key in env:
            os.environ.pop(key, None)
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        stop_mps(exe, daemon, env, log)


def stop_mps(exe: str, daemon: subprocess.Popen, env: dict, log=None):
    """Ask the daemon to quit (it stops its server too); kill it if it has not gone within MPS_WAIT."""
    if daemon.poll() is None:
        try:
            subprocess.run([exe], input=b"quit\n", env={**os.environ, **env}, capture_output=True,
                           timeout=MPS_WAIT)
            daemon.wait(timeout=MPS_WAIT)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
            if log:
                log(f"MPS: the daemon had not quit {MPS_WAIT:g} s after it was asked to: killed")


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (none without CUDA)."""
    if not torch.cuda.is_available():
        return []
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    return [g.strip() for g in named.split(",")][:count] if named else [str(i) for i in range(count)]


def speed(args, device: str, n_runs: int) -> dict:
    """How runs are executed, never what they compute: sets args.jobs (given: at least 1) and returns each run's
    data workers, CUDA graphs and their padding bucket, torch.compile (see --help), and how many runs share a
    device (the jobs spread over the GPUs; on a CPU, all of them)."""
    cuda = device.startswith("cuda")
    gpus = visible_gpus() if cuda else []                        # none with --plan on a machine without one
    if args.jobs is None:                                        # per GPU: one job per 8 GB free, at most 8
        memory = torch.cuda.mem_get_info(0)[0] if gpus else 0   # free now: other commands' runs count
        args.jobs = max(1, min(8 * len(gpus), n_runs, len(gpus) * (memory // 2**33))) if cuda else 1
    workers = default_workers(args.jobs) if cuda else 0
    return {"workers": workers if args.workers is None else args.workers, "graphs": cuda and not args.no_graphs,
            "compile": bool(args.compile), "tf32": bool(args.tf32),
            "bucket": TrainConfig.bucket if args.bucket is None else args.bucket,
            "runs_at_once": -(-min(args.jobs, max(1, n_runs)) // max(1, len(gpus)))}


def default_workers(jobs: int) -> int:
    """Data workers per run when `jobs` runs share the machine: the CPU cores per run less one, 1 to 8."""
    return max(1, min(8, (os.cpu_count() or 1) // jobs - 1))


STOP = None                 # in a --jobs process: the command's stop event (start_job)
NOT_STARTED = "not started"


def start_job(gpus: list[str], counter, stop):
    """A --jobs process's first act: keep the command's stop event, and with several GPUs take one.
    Between runs the process ignores SIGINT and SIGTERM (each run stops on them while it trains): a
    signal to the whole group would otherwise kill a process that waits for work, which breaks the
    pool and makes every run still going read as failed. The stop event keeps queued runs from starting."""
    global STOP
    STOP = stop
    faulthandler.enable(sys.__stderr__)   # as main does: a crash prints where the job was, on the command's stderr
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    if gpus:
        take_gpu(gpus, counter)


def take_gpu(gpus: list[str], counter):
    """Take the next of the GPUs in turn (before CUDA starts in this process), so that the jobs
    spread evenly, ceil(jobs / GPUs) on each."""
    with counter.get_lock():
        k, counter.value = counter.value, counter.value + 1
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[k % len(gpus)]


def check_failures(failed: list[str], n_runs: int):
    if failed:
        raise RunsFailed(f"{len(failed)} of {n_runs} runs failed (the others ran to the end); the first: "
                         f"{failed[0]}")


def run_logged(run, cfg: TrainConfig, resume: bool | str = False, force: bool = False) -> str:
    """run(cfg) with its progress lines in <run>/train.log; returns the one-line summary. A run that a
    signal stops raises RunStopped; one whose turn comes after the command was stopped, at once."""
    if STOP is not None and STOP.is_set():
        raise RunStopped(NOT_STARTED)
    path = cfg.run_dir() / "train.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        print(f"process {os.getpid()}, {torch.get_num_threads()} CPU threads"
              + (f" (OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']})" if os.environ.get("OMP_WAIT_POLICY") else "")
              + (f", CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}"
                 if os.environ.get("CUDA_VISIBLE_DEVICES") is not None else "")
              + (", under CUDA MPS" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else ""), file=f, flush=True)
        before = set(multiprocessing.active_children())
        try:
            metrics = run(cfg, resume, log=lambda line: print(line, file=f, flush=True), force=force)
        except Interrupted as e:
            print(e, file=f, flush=True)
            if STOP is not None:
                STOP.set()                 # the signal stops the command: its queued runs do not start
            raise RunStopped(str(e)) from None
        except Exception:
            print(traceback.format_exc(), file=f, flush=True)
            raise
        finally:
            end_children(before, log=lambda line: print(line, file=f, flush=True))
    return summary_line(metrics["eval"], metrics["train_max_length"])


def end_children(before: set, log=print):
    """Once a run has ended: stop the data workers of any loader it left open (tasks.close_loaders), then
    kill the processes that it started in this process and left behind (a data worker that did not exit
    when its loader closed): they ignore SIGTERM, and at its own exit a process sends its children SIGTERM
    and then waits for them, so the job process would never end. While it kills them, torch's SIGCHLD
    handler is off: for a data worker it would raise "DataLoader worker ... is killed" in place of the
    run's outcome (a finished or checkpointed run)."""
    loaders = close_loaders()
    if loaders:
        log(f"stopped the data workers of {loaders} loader{'s' if loaders > 1 else ''} that the run left open")
    left = [p for p in multiprocessing.active_children() if p not in before]
    quiet = left and threading.current_thread() is threading.main_thread()
    if quiet:
        handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for process in left:
        process.kill()
    for process in left:
        process.join(5)
    if quiet:
        signal.signal(signal.SIGCHLD, handler)
    if left:
        log(f"killed {len(left)} process{'es' if len(left) > 1 else ''} that the run started and left behind "
            f"(pid {', '.join(str(p.pid) for p in left)})")


# =============================================================================================
# Before training: the plan, and each run's time
# =============================================================================================

def print_plan(everything: list[TrainConfig], todo: set, present: set, jobs: int, other: dict, scope: str,
               outside: str) -> dict:
    """Before training: each run of the list (`todo`, `present`: ids of the configs this command trains
    and of those with metrics, `other`: runs present with other options, from other_setup; `scope`: the
    part of the list the command takes, for the first line; `outside`: the state of a run outside it),
    whether this command trains it (from its checkpoint, where it has one), and its time: measured (the
    wall time of the same setup with another seed, per step) or estimated (the run of the same task and
    method with the closest settings, per step and sequence), else unknown. Returns {id of a config to
    train: seconds or None}."""
    print(f"{len(everything)} runs{scope}; {len(todo)} to train" + (f", {jobs} at once" if jobs > 1 else "") + ":")
    total, unknown, times = 0.0, 0, {}
    for k, cfg in enumerate(everything):
        state = ("train" if id(cfg) in todo else "other setup" if id(cfg) in other
                 else "present" if id(cfg) in present else outside)
        line = f"  {k:3d} {state:11s} {cfg.run_dir()}" + (f"  ({other[id(cfg)]})" if id(cfg) in other else "")
        if state == "train":
            seconds, how = time_of(cfg)
            done = checkpoint_step(cfg)
            times[id(cfg)] = seconds = None if seconds is None else seconds * (1 - done / cfg.steps)
            if seconds is None:
                unknown += 1
                line += "  time unknown (no run of this task and method on this kind of device yet)"
            else:
                total += seconds
                line += f"  {fmt_time(seconds)} ({how})"
            line += f", from its checkpoint at step {done}" if done else ""
        print(line)
    if todo and unknown == len(todo):
        print("  in all: unknown until one run of each setup has finished")
    elif todo:
        print(f"  in all about {fmt_time(total / max(1, min(jobs, len(todo))))}"
              + (f" with {jobs} at once, if they share the device evenly" if jobs > 1 else "")
              + (f", plus {unknown} run(s) of unknown time" if unknown else ""))
    return times


def checkpoint_step(cfg: TrainConfig) -> int:
    """The step of the run's checkpoint (0: none, or unreadable, which the run reports when it starts)."""
    try:
        return int(torch.load(cfg.run_dir() / CKPT, map_location="cpu", weights_only=False)["step"])
    except Exception:
        return 0


# settings that do not change what one step costs, or that every run has its own of
NOT_COST = {"seed", "out", "tag", "device", "workers", "graphs", "compile", "tf32", "runs_at_once", "preset",
            "log_every", "ckpt_every", "bucket"}


def differences(a: dict, b: dict) -> int:
    """How many settings two runs' configs (asdict(TrainConfig)) differ in, the model's counted one by one."""
    flat = lambda c: {**{k: v for k, v in c.items() if k != "model"}, **c.get("model", {})}  # noqa: E731
    fa, fb = flat(a), flat(b)
    return sum(fa.get(k) != fb.get(k) for k in set(fa) | set(fb) if k not in NOT_COST)


RESULTS = Path(__file__).parent / "docs" / "results"   # the committed runs: times where --out has none


def time_of(cfg: TrainConfig) -> tuple[float | None, str]:
    """(seconds, "measured: seedS" | "measured: median of N seeds" | "estimate: LABEL") for one run, from the
    metrics of runs already present on the same kind of device (a GPU's time says nothing of a CPU's): the
    other seeds of the same run (the median of their times), else the run of the same task and method whose
    settings differ from this one's in the fewest (its time per step, scaled by the batch size). Looked for in
    --out, then in this repository's committed runs (RESULTS; the label then says "in docs/results").
    Runs that share a device are taken to split it evenly: a time measured with k runs at once counts as
    k times that of the run alone, and this run takes its own runs_at_once times that (the label says so
    where the two differ; a run that recorded no runs_at_once counts as it ran, and the label says
    "sharing not recorded": its time may include other runs' share of its device). The label also says where
    those runs had another --compile or --tf32 than this one (not scaled for: their speed differs). Small models
    that leave a GPU idle gain from sharing it (docs/perf/training.md, section 4), so for them the time is
    overstated.
    A run's time is its training loop's (wall_s, per step) and its final evaluation's (final_eval_s, with
    ViPE's fine-tuning); runs from before that was recorded give the loop's alone, and the label says
    "final evaluation not timed there"."""
    seconds, how = time_in(cfg, Path(cfg.out))
    if seconds is None and RESULTS.is_dir() and Path(cfg.out).resolve() != RESULTS.resolve():
        seconds, how = time_in(cfg, RESULTS)
        how = how.replace(": ", " in docs/results: ", 1)
    return seconds, how


def time_in(cfg: TrainConfig, out: Path) -> tuple[float | None, str]:
    """`time_of` from the runs under `out` alone."""
    cpu = device_of(cfg.device) == "cpu"
    mine = dataclasses.replace(cfg, out=str(out))

    def usable(path):
        m = read_metrics(path, ("wall_s", "config", "device"))
        ok = m and m["config"]["steps"] and m["config"].get("batch_size") and m["device"].startswith("cpu") == cpu
        return m if ok else None

    def seconds(m, batch=1.0):   # its loop at this run's steps (x batch) and its final evaluation, scaled
        there = m["config"].get("runs_at_once")   # from the runs that shared its device to those sharing this one's
        loop = m["wall_s"] / max(1, m["config"]["steps"]) * cfg.steps * batch
        return (loop + m.get("final_eval_s", 0.0)) * (cfg.runs_at_once / there if there else 1)

    def shared(ms):
        there = sorted({m["config"]["runs_at_once"] for m in ms if "runs_at_once" in m["config"]})
        unrecorded = any("runs_at_once" not in m["config"] for m in ms)
        return ("" if there in ([], [cfg.runs_at_once]) else
                f", {'/'.join(map(str, there))} at once there, {cfg.runs_at_once} here") + \
            (", sharing not recorded there" if unrecorded else "") + \
            (", final evaluation not timed there" if any("final_eval_s" not in m for m in ms) else "") + \
            "".join(f", {'without' if getattr(cfg, flag) else 'with'} --{flag} there" for flag in ("compile", "tf32")
                    if any(bool(m["config"].get(flag)) != bool(getattr(cfg, flag)) for m in ms))
    seeds = [(m, path.parent.name) for path in glob_stored(mine.run_dir().parent, "seed*/metrics.json")
             if (m := usable(path)) and m["config"]["batch_size"] == cfg.batch_size]
    if seeds:       # their median: seeds of one setup ran beside different loads
        return float(np.median([seconds(m) for m, _ in seeds])), "measured: " + (
            seeds[0][1] if len(seeds) == 1 else f"median of {len(seeds)} seeds") + shared([m for m, _ in seeds])
    settings = asdict(cfg)
    others = [(differences(settings, m["config"]), path.parent.parent.name, m)
              for path in glob_stored(out / cfg.task, f"{cfg.method}*/seed*/metrics.json")
              if (m := usable(path))]
    if not others:
        return None, ""
    _, label, m = min(others, key=lambda x: x[0])          # the first of the closest, in folder order
    return seconds(m, cfg.batch_size / m["config"]["batch_size"]), "estimate: from " + label + shared([m])
