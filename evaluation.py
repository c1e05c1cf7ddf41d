"""Evaluation: exact match and token accuracy of a trained model at every test length of a task; and
how every result file is written (save_atomic, json_text) and read back, plain or gzipped (read_metrics,
read_stored).

    from evaluation import evaluate, summary_line
    rows = evaluate(model, tasks.TASKS["copy"], [8, 16, 32], n=256, seed=0, device="cpu")
    print(summary_line(rows, train_max=16))   # "exact in-dist X | beyond train length Y"

Every row is one length (and task variant): {"name", "length", "variant", "n", "s", "exact", "token", "last"}:
exact match per sequence, accuracy per supervised token, and on the final answer alone ("last": the last
supervised position that is not the task's <eos>, e.g. parity's y_L; one per sequence). A task with
`by_offset` (the padded arithmetic, whose answer ends with its least significant digit) adds "by_offset":
the token accuracy at each supervised position counted back from the sequence's last one (offset 0), so
that a table can say at which digit a model starts to fail.
One teacher-forced pass per batch; for a causal model this equals greedy decoding (tests/test_train.py
checks it). The loop (train.py) calls `evaluate` during and after training; the tables of
experiments.py and cli.py read its rows from each run's metrics.json, which `json_text` lays out a row
a line (`save_atomic`, at the end, writes every .json file with it, and every other file of a run).

A file beside train.py rather than a section of it: the loop, its optimiser step and its checkpoints
fill the 500 lines that train.py may have, and evaluation needs none of them, only a model, a task
and model.batch_context.
Shapes: B batch, T time, V vocabulary.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from model import autocast, batch_context
from tasks import IGNORE, Task, collate


def score(logits, y, eos: int = -1):
    """Per sequence: exact match (every supervised position right), right and supervised tokens, and whether
    the final answer is right (the last supervised position whose target is not `eos`), (B,) each."""
    sup = y != IGNORE
    right = (logits.argmax(-1) == y) & sup
    answer = sup & (y != eos)                                          # (B, T)
    last = answer.shape[1] - 1 - answer.flip(1).int().argmax(1)        # (B,) its last position
    return (right | ~sup).all(dim=1), right.sum(1), sup.sum(1), right.gather(1, last[:, None])[:, 0] & answer.any(1)


def score_by_offset(logits, y):
    """Right and supervised tokens at each offset back from a sequence's last supervised position
    (offset 0 is that position), (B, T) each."""
    sup = y != IGNORE
    right = (logits.argmax(-1) == y) & sup
    T = y.shape[1]
    end = T - 1 - sup.flip(1).int().argmax(1)                          # (B,) the last supervised position
    at = end[:, None] - torch.arange(T, device=y.device)               # (B, T) position of each offset
    back = at.clamp(min=0)
    inside = at >= 0
    return right.gather(1, back) & inside, sup.gather(1, back) & inside


@torch.no_grad()
def evaluate(model, task: Task, lengths, n: int, seed: int, device, task_opts=None, s=1.0,
             batch_size: int = 256, stream: int = 1, tokens_per_batch: int = 2 ** 15,
             precision: str = "bf16", stop=None) -> list[dict]:
    """Exact-match and token accuracy at every test length (and every task variant). Uses its
    own generator (`stream` 1: the test set; 2: the held-out set of evaluations during training),
    so evaluating never changes the training data stream. A task with a finite test set (SCAN)
    gives every example of a length once instead (the row's n is then their number). Examples of
    several lengths share one forward pass, right-padded (exact, as in `train.Step`), up to
    tokens_per_batch tokens (few enough that PRISM with 512 bins and more, whose memory grows with
    tokens x cursors x bins, leaves room for the runs sharing the GPU: a pass that runs out of GPU
    memory is split in two, a training step beside it is not). `s`: ctx["s"] for every length, or
    a function of the length (ViPE's rules); each row records its s. `stop`, if given, is called before
    each forward pass and may raise to end the evaluation (train.train's, on a signal: jobs.stop_signals)."""
    model.eval()
    rng = np.random.default_rng([seed, stream])
    every = {L: task.every_example(L, **(task_opts or {})) for L in lengths}
    rows = [{"name": vname or str(L), "length": L, "variant": vname, "n": n if every[L] is None else len(every[L].x),
             "s": float(s(L) if callable(s) else s)} for L in lengths for vname in (task.variants or {None: {}})]
    counts = np.zeros((len(rows), 4))                      # per row: exact, right tokens, supervised, last
    offsets = [np.zeros((2, 0)) for _ in rows]             # per row with task.by_offset: right, supervised by offset
    eos = task.stoi.get("<eos>", -1)

    def pieces():                                          # (row, s, batch), in the order drawn
        for k, r in enumerate(rows):
            opts = {**(task_opts or {}), **task.variants.get(r["variant"], {})}
            for start in range(0, r["n"], batch_size):
                if every[r["length"]] is None:
                    yield k, r["s"], task.sample(min(batch_size, n - start), r["length"], rng, **opts)
                else:
                    yield k, r["s"], every[r["length"]].take(start, start + batch_size)

    def scores(group):                                     # (examples, 4): exact, right tokens, supervised, last
        if stop:
            stop()
        batch = collate([b for _, _, b in group], task.pad_id)
        with autocast(device, precision):
            logits = model(batch.x.to(device), batch_context(task, batch, device, group[0][1]))
        per_seq = torch.stack(score(logits.float(), batch.y.to(device), eos), 1).cpu().numpy()
        if not task.by_offset:
            return per_seq, None
        return per_seq, torch.stack(score_by_offset(logits.float(), batch.y.to(device)), 1).cpu().numpy()

    def run(group):
        try:
            per_seq, per_offset = scores(group)             # (examples, 4); (examples, 2, T) or None
        except torch.OutOfMemoryError:                     # the same examples in two passes instead
            if sum(len(b.x) for _, _, b in group) == 1:
                raise
            per_seq = None
        if per_seq is None:
            torch.cuda.empty_cache()
            if len(group) == 1:
                (k, s, b), half = group[0], len(group[0][2].x) // 2
                group = [(k, s, b.take(0, half)), (k, s, b.take(half, None))]
            for part in (group[:len(group) // 2], group[len(group) // 2:]):
                run(part)
            return
        first = 0
        for k, _, b in group:
            counts[k] += per_seq[first:first + len(b.x)].sum(0)
            if per_offset is not None:
                mine = per_offset[first:first + len(b.x)].sum(0)                     # (2, T)
                width = max(mine.shape[1], offsets[k].shape[1])
                offsets[k] = np.pad(offsets[k], ((0, 0), (0, width - offsets[k].shape[1]))) + \
                    np.pad(mine, ((0, 0), (0, width - mine.shape[1])))
            first += len(b.x)

    group = []
    for piece in pieces():
        size = sum(len(b.x) for _, _, b in group) + len(piece[2].x)
        width = max([b.x.shape[1] for _, _, b in group] + [piece[2].x.shape[1]])
        if group and (piece[1] != group[0][1] or size * width > tokens_per_batch):
            run(group)
            group = []
        group.append(piece)
    if group:
        run(group)
    for r, (exact, right, sup, last), (right_at, sup_at) in zip(rows, counts, offsets):
        r.update(exact=exact / r["n"], token=right / max(sup, 1), last=last / r["n"])
        if task.by_offset:                                 # up to the last offset that any example reaches
            reached = int(np.flatnonzero(sup_at)[-1]) + 1 if sup_at.any() else 0
            r["by_offset"] = [round(float(a / s), 3) for a, s in zip(right_at[:reached], sup_at[:reached])]
    model.train()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()                           # back to the runs that share the GPU
    return rows


# docs/results keeps each run's metrics.json gzipped (<name>.gz, docs/perf/compact_results.py), with the run's
# train.log inside it (key "train_log"), so that a clone stays light; these read a file in any of those forms,
# the plain one first (a run written since).

def stored(path: Path) -> Path | None:
    """`path`, or path + ".gz" where only that exists; None where neither does."""
    path = Path(path)
    if path.exists():
        return path
    gz = path.with_name(path.name + ".gz")
    return gz if gz.exists() else None


def read_stored(path: Path) -> str:
    """The text of `path`, plain or gzipped (`stored`), or for a train.log stored inside its run's metrics.json
    (its "train_log"); FileNotFoundError naming `path` where none is."""
    found = stored(path)
    if found is None:
        path = Path(path)
        if path.name == "train.log" and stored(path.with_name("metrics.json")):
            log = json.loads(read_stored(path.with_name("metrics.json"))).get("train_log")
            if isinstance(log, str):
                return log
        raise FileNotFoundError(f"no {path} (nor {Path(path).name}.gz)")
    return gzip.decompress(found.read_bytes()).decode() if found.name.endswith(".gz") else found.read_text()


def glob_stored(folder: Path, pattern: str) -> list[Path]:
    """folder.glob(pattern), files stored gzipped included under their plain names, sorted."""
    packed = (p.with_name(p.name[:-3]) for p in Path(folder).glob(pattern + ".gz"))
    return sorted({*Path(folder).glob(pattern), *packed})


def checkpoint_losses(saved) -> list:
    """A checkpoint's loss history as [[step, loss], ...]: train.py saves it as one (N, 2) float32 tensor;
    checkpoints written before hold it pickled, or as the list itself."""
    if torch.is_tensor(saved):
        return [[int(step), loss] for step, loss in saved.tolist()]
    return pickle.loads(saved) if isinstance(saved, bytes) else saved


def read_metrics(path: Path, keys) -> dict | None:
    """A metrics.json with the given keys, or None with a warning naming the file (a corrupt or
    foreign file beside the runs must not stop a figure or a table of the others)."""
    try:
        m = json.loads(read_stored(path))
        missing = [k for k in keys if k not in m]
        if missing:
            raise KeyError(f"no {', '.join(missing)}")
        return m
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"warning: skipping {path}: not a readable metrics file ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def json_text(obj, depth: int = 0) -> str:
    """JSON laid out by its structure, as save_atomic (below) writes every .json file: a list or dict that holds
    lists or dicts gets a line per element; one of plain values (a row above, a loss pair, the seeds) is one
    line. A row reads on one line, and a run's metrics take a quarter less space than with a number a line."""
    if not isinstance(obj, (dict, list)):
        return json.dumps(obj)
    items = list(obj.items()) if isinstance(obj, dict) else [(None, v) for v in obj]
    if not any(isinstance(v, (dict, list)) for _, v in items):
        return json.dumps(obj)
    inner = [" " * (depth + 1) + (f"{json.dumps(k)}: " if k is not None else "") + json_text(v, depth + 1)
             for k, v in items]
    opening, closing = "{}" if isinstance(obj, dict) else "[]"
    return opening + "\n" + ",\n".join(inner) + "\n" + " " * depth + closing


def summary_line(rows, train_max) -> str:
    ind = [r for r in rows if r["length"] <= train_max]
    ood = [r for r in rows if r["length"] > train_max]

    def part(rs):   # exact match over examples, as the tables count it (SCAN's lengths differ in size)
        return f"{np.average([r['exact'] for r in rs], weights=[r.get('n') or 1 for r in rs]):.3f}" if rs else "-"

    if rows and rows[0]["variant"]:
        return " ".join(f"{r['name']} err {100 * (1 - r['token']):.2f}%" for r in rows)
    return f"exact in-dist {part(ind)} | beyond train length {part(ood)}"


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (else set and put back)."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("Umask:"))
        return int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError):
        os.umask(mask := os.umask(0o022))
        return mask


def palette_png(data: bytes) -> bytes:
    """A PNG as a 256-colour palette image (a plot has far fewer colours; it looks the same at about a third
    of the bytes, which keeps the committed figures light); one that is a palette image already, or bytes
    that are no PNG, as they are."""
    from PIL import Image                 # matplotlib's own dependency
    if not data.startswith(b"\x89PNG"):
        return data
    image = Image.open(io.BytesIO(data))
    if image.mode == "P":
        return data
    out = io.BytesIO()
    image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, format="png", optimize=True)
    return out.getvalue()


def save_atomic(obj, path: Path, **savefig):
    """Write to a temporary file of its own in the target folder, then rename: a crash never leaves half a
    file, and two writers of one path never share a temporary name. Strings as text, dicts to .json as JSON,
    a figure with fig.savefig(**savefig) (a .png as a palette image, `palette_png`), the rest with torch.save;
    mode 0666 less the umask."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")  # one per writer
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(obj, str):
                f.write(obj.encode())
            elif path.suffix == ".json":
                f.write(json_text(obj).encode())
            elif hasattr(obj, "savefig") and path.suffix == ".png":
                png = io.BytesIO()
                obj.savefig(png, format="png", **savefig)
                f.write(palette_png(png.getvalue()))
            elif hasattr(obj, "savefig"):
                obj.savefig(f, format=path.suffix.lstrip("."), **savefig)
            else:
                torch.save(obj, f)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# What every run's metrics record beside its rows (train.train), and how its progress lines give times.

def git_hash() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)"


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
