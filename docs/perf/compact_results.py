"""Keep docs/results light: gzip each run's metrics.json in place (metrics.json.gz, the plain file removed), with
the run's train.log moved inside it (key "train_log": one file a run instead of two, on a disk that gives each
file 4 KB at least), a run's curves thinned first; a train.log with no run's metrics beside it (a study's) is
gzipped alone. The code reads every form, the plain one first (evaluation.stored, read_stored, glob_stored), so a
run copied in since, or a table rebuilt there, needs nothing done before it is read.

Every evaluation a run made is kept as it is (its rows, its evaluations during training); its curves, which no
table reads, are thinned to at most CURVE_POINTS points: the loss every k-th logged point (and the last), its
highest value per k points ("loss_peak", so a jump stays visible), the largest logits every k-th checkpoint,
losses and logits to 4 significant digits. The metrics say so in "curves_thinned". Figures (.png) become
256-colour palette images, as the code now writes them (evaluation.palette_png).

    python docs/perf/compact_results.py docs/results        # after copying new runs in; prints what it saved

Gzip at level 9 with no timestamp, so compacting the same file twice gives the same bytes.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from evaluation import json_text, palette_png, read_stored, stored  # noqa: E402

NAMES = ("metrics.json", "train.log")
CURVE_POINTS = 200


def thin(m: dict) -> dict:
    """A run's metrics with its curves thinned (above); those of a summary, or already thin, as they are."""
    curves = [k for k in ("loss", "loss_peak", "logit_max") if len(m.get(k) or []) > CURVE_POINTS]
    if not curves:
        return m
    k = -(-max(len(m[c]) for c in curves) // CURVE_POINTS)
    sig = lambda v: float(f"{v:.4g}")  # noqa: E731
    out = dict(m, curves_thinned={"every": k, "digits": 4})
    if "loss" in m:
        out["loss"] = [[s, sig(v)] for s, v in m["loss"][::k] + ([m["loss"][-1]] if (len(m["loss"]) - 1) % k else [])]
    if "loss_peak" in m:
        out["loss_peak"] = [[s, sig(v)] for s, v in (max(m["loss_peak"][i:i + k], key=lambda p: p[1])
                                                     for i in range(0, len(m["loss_peak"]), k))]
    if "logit_max" in m:
        out["logit_max"] = [[s, [sig(v) for v in vs]] for s, vs in m["logit_max"][::k]]
    return out


def merge_log(folder: Path) -> bool:
    """Move the run's train.log in `folder` into its metrics.json (written plain, "train_log"), removing the log;
    a plain log goes into either form of the metrics, a gzipped one into gzipped metrics only (a plain
    metrics.json is a run made since, which the old log does not belong to). False where there is nothing to
    move, or the metrics are not one run's (a summary over seeds, a study's own file)."""
    plain_log, gz_log = folder / "train.log", folder / "train.log.gz"
    metrics = stored(folder / "metrics.json")
    if metrics is None or not (plain_log.exists() or (gz_log.exists() and metrics.name.endswith(".gz"))):
        return False
    m = json.loads(read_stored(folder / "metrics.json"))
    if not isinstance(m, dict) or "config" not in m:
        return False
    m["train_log"] = plain_log.read_text() if plain_log.exists() else read_stored(gz_log)
    tmp = folder / "metrics.json.tmp"
    tmp.write_text(json_text(m))
    os.replace(tmp, folder / "metrics.json")  # the log goes only once the metrics that hold it are whole
    for log in (plain_log, gz_log):
        log.unlink(missing_ok=True)
    return True


def compact(root: Path, rethin: bool = False) -> tuple[int, int, int]:
    """Move each run's train.log into its metrics (`merge_log`), gzip every NAMES file under root (a .gz beside
    it is replaced), and with rethin every metrics.json.gz already there again, thinned; every figure as a
    palette image; returns (files, bytes before, after)."""
    files, before, after = 0, 0, 0
    if rethin:
        for gz in sorted(root.rglob("metrics.json.gz")):
            plain = gz.with_name("metrics.json")
            if not plain.exists():
                plain.write_text(read_stored(plain))
    for folder in sorted({log.parent for name in ("train.log", "train.log.gz") for log in root.rglob(name)}):
        merge_log(folder)
    for path in sorted(p for name in NAMES for p in root.rglob(name) if p.is_file()):
        data = path.read_bytes()
        if path.name == "metrics.json":
            m = json.loads(data)
            thinned = thin(m) if isinstance(m, dict) else m
            if thinned is not m:
                data = json_text(thinned).encode()
        packed = gzip.compress(data, compresslevel=9, mtime=0)
        gz = path.with_name(path.name + ".gz")
        tmp = path.with_name(path.name + ".gz.tmp")
        tmp.write_bytes(packed)
        os.replace(tmp, gz)                  # the plain file goes only once its packed copy is whole
        path.unlink()
        files, before, after = files + 1, before + len(data), after + len(packed)
    for path in sorted(root.rglob("*.png")):
        data = path.read_bytes()
        packed = palette_png(data)
        if packed != data:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(packed)
            os.replace(tmp, path)
            files, before, after = files + 1, before + len(data), after + len(packed)
    return files, before, after


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="the folder to compact, e.g. docs/results")
    p.add_argument("--rethin", action="store_true", help="thin the curves of runs gzipped already too")
    a = p.parse_args(argv)
    if not a.root.is_dir():
        p.error(f"{a.root} is not a folder")
    files, before, after = compact(a.root, a.rethin)
    print(f"{files} files: {before / 2 ** 20:.1f} MiB -> {after / 2 ** 20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
