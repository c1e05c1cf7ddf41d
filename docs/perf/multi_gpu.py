"""How `--jobs` scales over the GPUs of one host: every quick experiment alone on one GPU against
`--reproduce all` over all of them, from the time stamps of the commands that ran them.

    python docs/perf/multi_gpu.py ONE_WALLS ALL_WALLS --gpus 4 [--runs 267]

ONE_WALLS: one line per command of an experiment alone on one GPU, "NAME gpu G rc R start S end E"
(S, E: Unix seconds; an experiment stopped and continued has one line per command). ALL_WALLS: one
line per command of `--reproduce all` over every GPU, "all rc R start S end E". Only the commands'
own time counts, not the gaps between them. Prints each experiment's time alone, their sum, the time
of the run over all GPUs, runs per hour of each, and the scaling efficiency: the sum over (GPUs x the
time over all GPUs), 1.0 when N GPUs take 1/N of the time of the experiments one after another on
one GPU. The experiments alone each end with a round of runs that leaves jobs idle; one queue over
every experiment has one such round in all, so the efficiency can pass 1.0.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict


def read_walls(path: str) -> dict[str, float]:
    """{name: seconds} summed over the name's commands."""
    seconds = defaultdict(float)
    for line in open(path):
        words = line.split()
        if not words:
            continue
        try:
            start, end = int(words[words.index("start") + 1]), int(words[words.index("end") + 1])
        except (ValueError, IndexError) as e:
            raise SystemExit(f"{path}: not a line of NAME ... start S end E: {line.strip()!r} ({e})")
        seconds[words[0]] += end - start
    return dict(seconds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("one", help="the experiments alone on one GPU: NAME gpu G rc R start S end E")
    p.add_argument("all", help="--reproduce all over every GPU: all rc R start S end E")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--runs", type=int, help="runs in all, for runs per hour")
    a = p.parse_args(argv)
    one, every = read_walls(a.one), read_walls(a.all)
    if set(every) != {"all"}:
        raise SystemExit(f"{a.all}: expected lines of 'all', got {sorted(every)}")
    for name, s in sorted(one.items(), key=lambda x: -x[1]):
        print(f"  {name:18s} {s / 60:6.1f} min alone on one GPU")
    alone, wall = sum(one.values()), every["all"]
    print(f"one GPU, one experiment after another: {alone / 60:.1f} min ({len(one)} experiments)")
    print(f"{a.gpus} GPUs, --reproduce all: {wall / 60:.1f} min")
    if a.runs:
        print(f"runs per hour: {a.runs / (alone / 3600):.0f} on one GPU, {a.runs / (wall / 3600):.0f} on {a.gpus}")
    print(f"speed-up {alone / wall:.2f}x on {a.gpus} GPUs; scaling efficiency {alone / (a.gpus * wall):.2f} "
          f"(target 0.85)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
