"""Per-seed table of run folders outside an experiment (an ablation's runs, such as those of
docs/results/prism-more-lr-12k), as markdown: for each folder <task>/<label>, each seed's exact match up to / beyond
its training length and "to L" (at least 0.9 at every evaluated length up to L), then over its seeds the mean
(min-max) beyond it and PRISM's rule (the mean of the 3 best evaluations during training beyond it,
experiments.top_k_checkpoints). `--reproduce` builds tables for an experiment's own runs only; this one reads any
folders of seed*/metrics.json. Rows are named <task>/<label>, or by their paths where two folders share that name.

    python docs/perf/seed_table.py docs/results/prism-more-lr-12k/stack/prism-full-warm1k [more folders]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments import one_seed, seed_metrics, top_k_checkpoints  # noqa: E402

HOLDS = 0.9   # "to L": exact match at least this at every length up to L


def holds_to(rows: list[dict]) -> int:
    """The longest evaluated length L with exact match at least HOLDS at it and every shorter one (0: none)."""
    to = 0
    for r in sorted(rows, key=lambda r: r["length"]):
        if r["exact"] < HOLDS:
            break
        to = r["length"]
    return to


def spread(values: list[float]) -> str:
    """Mean (min-max) of the seeds' values, or the one seed's value."""
    if len(values) == 1:
        return f"{values[0]:.3f} (one seed)"
    return f"{sum(values) / len(values):.3f} ({min(values):.2f}-{max(values):.2f})"


def per_length(m: dict) -> list[dict]:
    """A run's evaluation rows per length (flip-flop's settings are not lengths)."""
    return [r for r in m["eval"] if r["variant"] is None]


def folder_row(name: str, runs: list[dict], seeds: list[int]) -> str:
    """One markdown row: the folder's name, a cell per seed in `seeds` (empty where it has none), then over its
    own seeds the mean beyond the training length and the top-3 rule ("-" where a seed has no evaluations during
    training)."""
    cells, beyond, rule = {}, [], []
    for m in runs:
        rows, top = per_length(m), m["train_max_length"]
        beyond.append(one_seed(rows, top, "beyond", "exact"))
        cells[m["seed"]] = f"{one_seed(rows, top, 'train', 'exact'):.3f} / {beyond[-1]:.3f}, to {holds_to(rows)}"
        rule.append(top_k_checkpoints(m, "beyond", "exact"))
    rule_text = "-" if None in rule else spread(rule)
    return "| " + " | ".join([name, *(cells.get(s, "") for s in seeds), spread(beyond), rule_text]) + " |"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="run folders <task>/<label> holding seed*/")
    args = parser.parse_args(argv)
    names = [f"{f.parent.name}/{f.name}" for f in args.folders]
    if len(set(names)) < len(names):       # the same <task>/<label> in two places: name each row by its path
        names = [str(f) for f in args.folders]
    folders = {name: seed_metrics(f) for name, f in zip(names, args.folders)}
    for name, runs in folders.items():
        if not runs:
            parser.error(f"no seed*/metrics.json in {name}")
        if not all(per_length(m) for m in runs):
            parser.error(f"{name}: a run without an evaluation per length")
    seeds = sorted({m["seed"] for runs in folders.values() for m in runs})
    columns = ["run", *(f"seed {s}" for s in seeds), "beyond, mean (min-max)", "the paper's rule (top 3)"]
    print("| " + " | ".join(columns) + " |")
    print("| --- |" + " --- |" * (len(seeds) + 2))
    for name, runs in folders.items():
        print(folder_row(name, runs, seeds))


if __name__ == "__main__":
    main()
