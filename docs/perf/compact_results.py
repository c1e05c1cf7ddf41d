"""Keep docs/results light: gzip each run's metrics.json and train.log in place (<name>.gz, the plain file
removed). A clone then carries every run's metrics, loss curves and evaluations during training at about a
fifth of their size; the code reads either form, the plain one first (evaluation.stored, read_stored,
glob_stored), so a run copied in since, or a table rebuilt there, needs nothing done before it is read.

    python docs/perf/compact_results.py docs/results        # after copying new runs in; prints what it saved

Gzip at level 9 with no timestamp, so compacting the same file twice gives the same bytes.
"""
from __future__ import annotations

import argparse
import gzip
import os
import sys
from pathlib import Path

NAMES = ("metrics.json", "train.log")


def compact(root: Path) -> tuple[int, int, int]:
    """Gzip every NAMES file under root (a .gz beside it is replaced); returns (files, bytes before, after)."""
    files, before, after = 0, 0, 0
    for path in sorted(p for name in NAMES for p in root.rglob(name) if p.is_file()):
        data = path.read_bytes()
        packed = gzip.compress(data, compresslevel=9, mtime=0)
        gz = path.with_name(path.name + ".gz")
        tmp = path.with_name(path.name + ".gz.tmp")
        tmp.write_bytes(packed)
        os.replace(tmp, gz)                  # the plain file goes only once its packed copy is whole
        path.unlink()
        files, before, after = files + 1, before + len(data), after + len(packed)
    return files, before, after


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="the folder to compact, e.g. docs/results")
    a = p.parse_args(argv)
    if not a.root.is_dir():
        p.error(f"{a.root} is not a folder")
    files, before, after = compact(a.root)
    print(f"{files} files: {before / 2 ** 20:.1f} MiB -> {after / 2 ** 20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
