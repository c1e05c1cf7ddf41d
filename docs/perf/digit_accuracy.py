"""Where in the answer a padded-arithmetic run goes wrong: for each run folder (seed*/metrics.json, or one
seed's folder), a markdown table of the token accuracy at each digit of the answer, counted back from its
least significant digit (offset 0: the last supervised position; the evaluation rows' "by_offset"), one row
per test length, with the first offset where accuracy falls below --below. Over several seeds, each cell is the
seeds' mean. With --step N, the evaluation during training at step N instead of the final one.

    python docs/perf/digit_accuracy.py docs/results/mul_padded/upe-m3low-full [more folders] [--step 50000]

Runs evaluated before the rows had "by_offset" (upe-mul's and upe-add's runs up to 2026-11-29) have none: such
a folder is named and skipped.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from evaluation import read_metrics, stored  # noqa: E402
from experiments import seed_metrics  # noqa: E402


def runs_of(folder: Path) -> list[dict]:
    """The metrics of a run folder's seeds, or of the one seed's folder given."""
    if folder.name.startswith("seed") and stored(folder / "metrics.json"):
        return [m for m in [read_metrics(folder / "metrics.json", ("eval",))] if m]
    return seed_metrics(folder, keys=("eval",))


def rows_of(metrics: dict, step: int | None) -> list[dict]:
    """The evaluation's rows per length (s = 1, no task variant): the final one, or the one at `step`."""
    if step is None:
        rows = metrics["eval"]
    else:
        rows = next((h["eval"] for h in metrics.get("history", []) if h["step"] == step), None)
        if rows is None:
            raise SystemExit(f"no evaluation at step {step} (steps: {[h['step'] for h in metrics.get('history', [])]})")
    return [r for r in rows if r["variant"] is None and r.get("s", 1.0) == 1.0 and "by_offset" in r]


def table(per_seed: list[list[dict]], below: float) -> list[str]:
    """Markdown lines: length, the first offset under `below` (of the seeds' mean), then each offset's mean."""
    by_length: dict[int, list[list[float]]] = {}
    for rows in per_seed:
        for r in rows:
            by_length.setdefault(r["length"], []).append(r["by_offset"])
    width = max(len(a) for accs in by_length.values() for a in accs)
    lines = ["| length | first offset < %g | " % below + " | ".join(str(k) for k in range(width)) + " |",
             "| --- | --- | " + " | ".join("---" for _ in range(width)) + " |"]
    for length in sorted(by_length):
        accs = by_length[length]
        mean = [sum(a[k] for a in accs if k < len(a)) / max(1, sum(k < len(a) for a in accs)) for k in range(width)]
        first = next((k for k, v in enumerate(mean) if v < below), "-")
        lines.append(f"| {length} | {first} | " + " | ".join(f"{v:.2f}" for v in mean) + " |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="run folders <task>/<label>, or seed folders")
    parser.add_argument("--step", type=int, help="the evaluation during training at this step")
    parser.add_argument("--below", type=float, default=0.9, help="accuracy that counts as failing (default 0.9)")
    args = parser.parse_args(argv)
    for folder in args.folders:
        per_seed = [rows_of(m, args.step) for m in runs_of(folder)]
        per_seed = [rows for rows in per_seed if rows]
        if not per_seed:
            print(f"{folder}: no evaluation with by_offset (run before it was recorded, or no seed*/metrics.json)\n")
            continue
        print(f"{folder} ({len(per_seed)} seed{'s' if len(per_seed) > 1 else ''}"
              f"{'' if args.step is None else f', step {args.step}'}): token accuracy by offset from the answer's end")
        print("\n".join(table(per_seed, args.below)) + "\n")


if __name__ == "__main__":
    main()
