"""--reproduce: the headline experiments' runs, skips, tables and figures (CPU, tiny settings)."""
import dataclasses
import gzip
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import evaluation
import experiments
import cli
import jobs
import train
from cli import main, make_config, validate


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_reproduce_runs_skips_and_tables(capsys, tmp_path, monkeypatch):
    exp = experiments.Experiment(
        claim="tiny", runs=[dict(task="copy", method=m, steps=10, batch_size=8, d_model=32, n_layers=1,
                                 n_heads=2, n_eval=8, train_lengths=[1, 2], test_lengths=[2, 4]) for m in ("nope", "rope")],
        columns=[("len 2", (2, 2), "exact"), ("len 4", (4, 4), "exact")],
        paper={"rope": ["1.0", "0.5"]}, scaled="tiny")
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", exp)
    out = tmp_path / "runs"
    code, stdout, _ = run_cli(capsys, "--reproduce", "tiny", "--out", str(out), "--device", "cpu")
    assert code == 0
    table = (out / "reproduce" / "tiny.md").read_text()
    s = json.loads((out / "copy" / "rope" / "metrics.json").read_text())
    assert "| copy/rope | paper | 1.0 | 0.5 |" in table
    assert "| copy/rope | this repo, last checkpoint, mean [90 % interval] (min-max) over seeds, 8 examples per " \
        f"point | {s['eval'][0]['exact']:.3f}" in table
    code, stdout, _ = run_cli(capsys, "--reproduce", "tiny", "--out", str(out), "--device", "cpu")
    assert stdout.count(" present ") == 2 and "0 to train" in stdout


def test_a_failed_run_does_not_stop_the_others(capsys, tmp_path, monkeypatch):
    """One of two runs raises: the other runs to the end and has its row in the table, the failed one
    reads "not run", and the command ends with one line naming the failure and exit status 1."""
    exp = experiments.Experiment(
        claim="tiny", runs=[dict(task="copy", method=m, steps=5, batch_size=8, d_model=32, n_layers=1,
                                 n_heads=2, n_eval=8, train_lengths=[1, 2], test_lengths=[2]) for m in ("nope", "rope")],
        columns=[("len 2", (2, 2), "exact")], paper={}, scaled="tiny")
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", exp)
    real = cli.run

    def nope_fails(cfg, *a, **k):
        if cfg.model.method == "nope":
            raise RuntimeError("CUDA out of memory (simulated)\nsecond line")
        return real(cfg, *a, **k)
    monkeypatch.setattr(cli, "run", nope_fails)
    out = tmp_path / "runs"
    code, stdout, err = run_cli(capsys, "--reproduce", "tiny", "--out", str(out), "--device", "cpu")
    assert code == 1 and (out / "copy" / "rope" / "metrics.json").exists()
    assert err.strip().splitlines()[-1] == (f"error: 1 of 2 runs failed (the others ran to the end); the first: "
                                            f"{out}/copy/nope/seed0: RuntimeError: CUDA out of memory (simulated)")
    assert "Traceback" in err and f"failed {out}/copy/nope/seed0" in stdout
    table = (out / "reproduce" / "tiny.md").read_text()
    assert "| copy/nope | this repo | not run |" in table and "| copy/rope | this repo, last checkpoint" in table


def test_reproduce_sweep_figure(capsys, tmp_path, monkeypatch):
    """The quick budget's figure is <name>.png, the full budget's <name>-full.png: one does not replace the other."""
    runs = [dict(task="copy", method=m, tag=f"L{n}", n_layers=n, steps=5, batch_size=8, d_model=32, n_heads=2,
                 n_eval=8, train_lengths=[1, 2], test_lengths=[2]) for n in (1, 2) for m in ("nope", "rope")]
    exp = experiments.Experiment(
        claim="tiny sweep", runs=runs, columns=[("len 2", (2, 2), "exact")], paper={}, scaled="tiny",
        sweep=("layers", 0), full=dict(runs=[{**run, "steps": 6} for run in runs], seeds=[0], scaled="tiny, full"))
    monkeypatch.setitem(experiments.EXPERIMENTS, "sweep", exp)
    out = tmp_path / "runs"
    code, stdout, _ = run_cli(capsys, "--reproduce", "sweep", "--out", str(out), "--device", "cpu")
    assert code == 0 and (out / "reproduce" / "sweep.png").stat().st_size > 1000
    assert "| copy/rope-L2 | this repo, last checkpoint" in (out / "reproduce" / "sweep.md").read_text()
    quick = (out / "reproduce" / "sweep.png").read_bytes()
    code, stdout, _ = run_cli(capsys, "--reproduce", "sweep", "--budget", "full", "--out", str(out), "--device", "cpu")
    assert code == 0 and (out / "reproduce" / "sweep-full.png").stat().st_size > 1000
    assert (out / "reproduce" / "sweep.png").read_bytes() == quick
    assert "| copy/rope-L2-full | this repo, last checkpoint" in (out / "reproduce" / "sweep-full.md").read_text()


def two_tiny_experiments(monkeypatch, tmp_path) -> Path:
    """experiments.EXPERIMENTS replaced by "one" (copy/nope) and "two" (copy/rope), one tiny run each;
    returns the output folder for them."""
    tiny = dict(task="copy", steps=3, batch_size=8, d_model=32, n_layers=1, n_heads=2, n_eval=8,
                train_lengths=[1, 2], test_lengths=[2])
    exps = {name: experiments.Experiment(claim=f"claim {name}", runs=[dict(tiny, method=m)], paper={}, scaled="tiny",
                                         columns=[("len 2", (2, 2), "exact")]) for name, m in (("one", "nope"), ("two", "rope"))}
    monkeypatch.setattr(experiments, "EXPERIMENTS", exps)
    return tmp_path / "runs"


def test_reproduce_all_writes_one_table(capsys, tmp_path, monkeypatch):
    out = two_tiny_experiments(monkeypatch, tmp_path)
    code, stdout, _ = run_cli(capsys, "--reproduce", "all", "--out", str(out), "--device", "cpu")
    assert code == 0
    text = (out / "reproduce" / "all.md").read_text()
    assert text.index("### one") < text.index("### two")
    assert "| copy/nope | this repo, last checkpoint" in text and "| copy/rope | this repo, last checkpoint" in text


def test_every_experiment_run_is_valid():
    for name, exp in experiments.EXPERIMENTS.items():
        for run in exp.runs:
            validate(make_config({**run, "device": "cpu"}, "gpu"))


def test_jobs_run_concurrently_with_the_results_of_sequential_runs(capsys, tmp_path):
    """--jobs 2: two runs at once, each in its own process with its log in <run>/train.log; the
    weights are those of the same runs one after the other."""
    import torch
    tiny = ["--task", "copy", "--methods", "nope,rope", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
            "--steps", "15", "--batch-size", "8", "--n-eval", "8", "--train-lengths", "1-3", "--test-lengths", "2,5",
            "--device", "cpu"]
    for n_jobs, out in (("1", tmp_path / "seq"), ("2", tmp_path / "par")):
        code, stdout, _ = run_cli(capsys, *tiny, "--jobs", n_jobs, "--out", str(out))
        assert code == 0
    assert "2 runs, 2 at a time" in stdout and stdout.count("done ") == 2
    for m in ("nope", "rope"):
        a = torch.load(tmp_path / "seq" / "copy" / m / "seed0" / "model.pt")
        b = torch.load(tmp_path / "par" / "copy" / m / "seed0" / "model.pt")
        assert all(torch.equal(a[k], b[k]) for k in a)
        log = (tmp_path / "par" / "copy" / m / "seed0" / "train.log").read_text()
        assert "steps/s" in log and "CPU threads (OMP_WAIT_POLICY=PASSIVE)" in log


def test_cpu_jobs_keep_an_omp_wait_policy_the_user_set(capsys, tmp_path, monkeypatch):
    """PASSIVE is set for the jobs only (the command's own environment is left as it was), and a policy
    the user chose is passed on unchanged."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    code, _, _ = run_cli(capsys, *TINY_JOBS, "--out", str(tmp_path / "a"))
    assert code == 0 and "OMP_WAIT_POLICY" not in os.environ
    assert "(OMP_WAIT_POLICY=PASSIVE)" in (tmp_path / "a" / "copy" / "rope" / "seed0" / "train.log").read_text()
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    code, _, _ = run_cli(capsys, *TINY_JOBS, "--out", str(tmp_path / "b"))
    assert code == 0 and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "(OMP_WAIT_POLICY=ACTIVE)" in (tmp_path / "b" / "copy" / "rope" / "seed0" / "train.log").read_text()


def fake_rows(values, lengths=(5, 10, 15)):
    return [{"name": str(L), "length": L, "variant": None, "exact": v, "token": v, "n": 8} for L, v in zip(lengths, values)]


def fake_seed(seed, train_exact, final, history):
    """A seed's metrics: final rows, and history entries (step, test values, held-out values)."""
    return {"task": "copy", "method": "rope", "seed": seed, "train_max_length": 5, "train_exact": train_exact,
            "device": "cpu", "wall_s": 1.0, "eval": fake_rows(final),
            "history": [{"step": s, "eval": fake_rows(t), "held_out": fake_rows(h)} for s, t, h in history]}


def write_seeds(out, seeds):
    """The seeds' metrics as the run copy/rope under out, with its summary; returns out."""
    for m in seeds:
        path = out / "copy" / "rope" / f"seed{m['seed']}" / "metrics.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(m))
    experiments.write_summary(out / "copy" / "rope")
    return out


def test_selection_rules_on_a_fake_history(tmp_path):
    """best_seed skips seeds below 0.85 in distribution; top-3 averages the three best evaluations;
    the held-out rule picks its checkpoint on the held-out examples, never on the test ones; and
    the experiment table reports each rule beside the last checkpoint."""
    a = fake_seed(0, 0.9, [1.0, 0.5, 0.1], [(1, [1, 0.1, 0], [1, 0.2, 0]), (2, [1, 0.6, 0], [1, 0.9, 0]),
                                            (3, [1, 0.4, 0], [1, 0.3, 0]), (4, [1, 0.8, 0], [1, 0.5, 0])])
    b = fake_seed(1, 0.7, [0.7, 0.9, 0.9], [(4, [1, 0.2, 0], [1, 0.2, 0])])
    assert experiments.best_seed([a, b])["seed"] == 0                        # b beats a beyond 5 but fails 0.85
    assert experiments.top_k_checkpoints(a, (10, 10), "exact") == pytest.approx((0.8 + 0.6 + 0.4) / 3)
    assert experiments.top_k_checkpoints(b, (10, 10), "exact") == pytest.approx(0.2)
    assert [r["exact"] for r in experiments.best_held_out(a, (10, 10))] == [1, 0.6, 0]   # step 2, not step 4
    tied = fake_seed(2, 1.0, [1, 1, 1], [(1, [1, 0.1, 0], [1, 1, 0]), (2, [1, 0.9, 0], [1, 1, 0])])
    assert [r["exact"] for r in experiments.best_held_out(tied, (10, 10))] == [1, 0.1, 0]   # the earliest of equals

    out = write_seeds(tmp_path / "runs", [a, b])
    cols = [("len 10", (10, 10), "exact")]
    rows = {}
    for select in (("best_seed",), ("top3",), ("held_out", (10, 10))):
        exp = experiments.Experiment(claim="c", runs=[dict(task="copy", method="rope")], columns=cols, paper={},
                                     scaled="s", select=select, seeds=[0, 1])
        rows[select[0]] = experiments.experiment_table("x", exp, out).splitlines()[-1]
    assert "| this repo, last checkpoint, mean [90 % interval] (min-max) over seeds, 8 examples per point | " \
        "0.700 [0.50-0.90] (0.50-0.90) |" in experiments.experiment_table("x", exp, out)
    assert "best of 2 seeds" in rows["best_seed"] and "(seed 0;" in rows["best_seed"] and "| 0.500 (0.50-0.50) |" in rows["best_seed"]
    assert "with in-distribution exact match > 0.85" in rows["best_seed"]
    assert "mean of the 3 best" in rows["top3"] and f"| {(0.6 + 0.2) / 2:.3f} (0.20-0.60) |" in rows["top3"]
    assert "held-out sequences of lengths 10-10" in rows["held_out"] and "| 0.400 [0.20-0.60] (0.20-0.60) |" in rows["held_out"]
    # a seed without evaluations during training (--eval-from-loss: its loss never fell below the bar) is
    # left out of the top-3 mean, and the cell says so
    out = write_seeds(tmp_path / "runs2", [a, {**b, "history": []}])
    exp = experiments.Experiment(claim="c", runs=[dict(task="copy", method="rope")], columns=cols, paper={},
                                 scaled="s", select=("top3",), seeds=[0, 1])
    assert "| 0.600 (0.60-0.60; 1 of 2 seeds) |" in experiments.experiment_table("x", exp, out).splitlines()[-1]


def test_the_table_names_every_device_its_seeds_ran_on(tmp_path):
    """Seeds trained on different GPUs: the device cell lists each device once, in seed order."""
    seeds = [{**fake_seed(k, 0.9, [1.0, 0.5, 0.1], []), "device": d} for k, d in enumerate(["H100", "H200", "H100"])]
    out = write_seeds(tmp_path / "runs", seeds)
    exp = experiments.Experiment(claim="c", runs=[dict(task="copy", method="rope")], paper={}, scaled="s",
                                 columns=[("len 10", (10, 10), "exact")], seeds=[0, 1, 2])
    assert "| 3 | H100, H200 | 0.0 min |" in experiments.experiment_table("x", exp, out)


def test_best_seed_says_when_no_seed_fits(tmp_path):
    """When no seed reaches 0.85 in distribution, ViPE's rule takes the best of all seeds beyond the
    training length, and the row says that none passed the bar instead of claiming it."""
    a = fake_seed(0, 0.5, [0.6, 0.1, 0.0], [])
    b = fake_seed(1, 0.4, [0.5, 0.3, 0.0], [])
    assert not experiments.fits(a) and experiments.best_seed([a, b])["seed"] == 1
    out = write_seeds(tmp_path / "runs", [a, b])
    exp = experiments.Experiment(claim="c", runs=[dict(task="copy", method="rope")],
                                 columns=[("len 10", (10, 10), "exact")], paper={}, scaled="s", select=("best_seed",),
                                 seeds=[0, 1])
    row = experiments.experiment_table("x", exp, out).splitlines()[-1]
    assert "(none exceeds in-distribution exact match 0.85) (seed 1;" in row and "| 0.300 (0.30-0.30) |" in row
    assert "> 0.85" not in row


def test_a_columns_range_is_the_seeds_own_lowest_and_highest_value():
    """Two seeds, each right at one of two lengths beyond the training length and wrong at the other: each
    seed's value beyond is 0.5, so the column reads 0.500 (0.50-0.50); each length's lowest and highest seed,
    averaged over the lengths, would read (0.00-1.00), a spread no seed has. In brackets the 90 % bootstrap
    interval of the mean: of two seeds' values x and y the resampled means are x, (x + y) / 2 and y, with
    probabilities 1/4, 1/2, 1/4, so it runs from the lower to the higher; one seed has none."""
    def rows(a, b):
        return [{"name": str(L), "length": L, "variant": None, "n": 10, "exact": e, "token": e}
                for L, e in ((11, a), (12, b))]
    assert experiments.column_value([rows(1.0, 0.0), rows(0.0, 1.0)], 10, "beyond", "exact") == "0.500 [0.50-0.50] (0.50-0.50)"
    assert experiments.column_value([rows(1.0, 1.0), rows(0.0, 0.5)], 10, "beyond", "exact") == \
        "0.625 [0.25-1.00] (0.25-1.00)"
    assert experiments.column_value([rows(1.0, 1.0)], 10, "beyond", "exact") == "1.000 (1.00-1.00)"
    assert experiments.column_value([rows(1.0, 1.0)], 12, "beyond", "exact") == "-"      # no point beyond 12


def test_a_column_counts_each_length_by_its_examples():
    """SCAN's lengths have as many examples as commands: a range's value is over examples."""
    points = [{"name": str(L), "length": L, "variant": None, "n": n, "exact": e, "exact_min": e, "exact_max": e}
              for L, n, e in ((24, 1, 0.0), (25, 3, 1.0))]
    assert experiments.column_numbers({"eval": points, "train_max_length": 22}, (24, 25), "exact")[0] == 0.75


def tiny_seeded(tmp_path, monkeypatch):
    """An experiment of four runs: nope and rope, seeds 0 and 1 (run list: nope/0, nope/1, rope/0, rope/1)."""
    exp = experiments.Experiment(
        claim="tiny", runs=[dict(task="copy", method=m, steps=6, batch_size=8, d_model=32, n_layers=1, n_heads=2,
                                 n_eval=8, train_lengths=[1, 2], test_lengths=[2]) for m in ("nope", "rope")],
        columns=[("len 2", (2, 2), "exact")], paper={}, scaled="tiny", seeds=[0, 1])
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", exp)
    return tmp_path / "runs"


def present(out):
    return sorted(str(p.parent.relative_to(out)) for p in out.glob("copy/*/seed*/metrics.json"))


def test_every_experiment_runs_command_makes_the_same_run():
    """--commands: each run of every experiment, at both budgets and under both presets, written as a train.py
    command and read back by the command line, is the same run (every field of what it computes)."""
    import shlex
    parser, n = cli.build_parser(), 0
    for name, exp in experiments.EXPERIMENTS.items():
        for budget in ("quick", "full") if exp.full else ("quick",):
            for preset in ("gpu", "cpu"):
                for cfg in cli.experiment_configs(experiments.at_budget(exp, budget), "cpu", "runs", preset):
                    words = shlex.split(cli.command_of(cfg))
                    assert words[:2] == ["python", "train.py"]
                    read = parser.parse_args(words[2:])
                    again, = cli.configs_of(read, "cpu", read.preset)
                    assert {k: getattr(again, k) for k in jobs.RUN_KEYS} == {k: getattr(cfg, k) for k in jobs.RUN_KEYS}, \
                        (name, budget, preset, cfg.run_dir())
                    n += 1
    assert n > 200


def test_a_runs_command_trains_the_run_its_experiment_would(capsys, tmp_path, monkeypatch):
    """--commands prints each picked run's command and trains nothing; that command run by hand makes a run
    that --reproduce then counts as present (not as one with other options). A flag that sets what a run
    computes (--lr) is refused with --reproduce, in one line that points to --commands, and writes nothing."""
    import shlex
    out = tiny_seeded(tmp_path, monkeypatch)
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", dataclasses.replace(
        experiments.EXPERIMENTS["tiny"], runs=[{**r, "lr": 3e-3, "train_lengths": [1, 2, 4]}
                                                for r in experiments.EXPERIMENTS["tiny"].runs]))
    args = ["--reproduce", "tiny", "--out", str(out), "--device", "cpu"]
    code, _, err = run_cli(capsys, *args, "--lr", "1e-3")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--commands" in err and not out.exists()
    code, _, err = run_cli(capsys, "--task", "copy", "--method", "rope", "--commands")
    assert code == 2 and "--reproduce" in err
    code, stdout, _ = run_cli(capsys, *args, "--runs", "3", "--commands")
    lines = stdout.strip().splitlines()
    assert code == 0 and not out.exists() and lines[-2] == f"# run 3: {out}/copy/rope/seed1", stdout
    words = shlex.split(lines[-1])
    assert words[:2] == ["python", "train.py"] and "--lr" in words
    assert words[words.index("--train-lengths") + 1] == "1-2,4"
    code, _, _ = run_cli(capsys, *words[2:])
    assert code == 0 and present(out) == ["copy/rope/seed1"]
    code, stdout, _ = run_cli(capsys, *args, "--plan")
    assert code == 0 and "3 present" in stdout and "other setup" not in stdout and "3 to train" in stdout


def test_output_cut_short_by_its_reader_is_no_error():
    """`train.py --reproduce all --commands | head -1`: once the reader has gone, the command stops quietly
    (status 0, nothing on stderr), not with "cannot write the results"."""
    import subprocess
    driver = ("import sys, cli\n"
              "class Gone:\n"
              "    def write(self, text): raise BrokenPipeError(32, 'Broken pipe')\n"
              "    def flush(self): pass\n"
              "    def fileno(self): return 1\n"
              "sys.stdout = Gone()\n"
              "sys.exit(cli.main(['--reproduce', 'all', '--commands', '--device', 'cuda']))\n")
    done = subprocess.run([sys.executable, "-c", driver], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")


def test_shards_train_exactly_their_runs_and_the_table_waits_for_all(capsys, tmp_path, monkeypatch):
    """--shard 0/2 trains runs 0 and 2 of the fixed list and writes no table; --shard 1/2 trains runs 1
    and 3, whose sibling seed gives a measured time, and writes the table; a plain --reproduce then
    trains nothing and writes the table again."""
    out = tiny_seeded(tmp_path, monkeypatch)
    args = ["--reproduce", "tiny", "--out", str(out), "--device", "cpu"]
    code, stdout, _ = run_cli(capsys, *args, "--shard", "0/2")
    assert code == 0 and present(out) == ["copy/nope/seed0", "copy/rope/seed0"]
    assert "4 runs, shard 0/2: 2 of them; 2 to train" in stdout and stdout.count("time unknown") == 2
    assert "in all: unknown" in stdout
    assert "its table waits for them" in stdout and not (out / "reproduce" / "tiny.md").exists()
    code, stdout, _ = run_cli(capsys, *args, "--shard", "1/2")
    assert code == 0 and len(present(out)) == 4
    assert stdout.count("(measured: seed0)") == 2 and "in all about" in stdout
    assert (out / "reproduce" / "tiny.md").exists()
    (out / "reproduce" / "tiny.md").unlink()
    code, stdout, _ = run_cli(capsys, *args)
    assert code == 0 and "0 to train" in stdout and (out / "reproduce" / "tiny.md").exists()


def test_seeds_pick_some_of_the_experiments_seeds_and_the_table_stands_on_them(capsys, tmp_path, monkeypatch):
    """--seeds 1 trains seed 1 of each run only and writes the table (reproduce/tiny-seeds1.md) from it, saying
    which seeds it stands on, also once seed 0 is present; a seed named twice or not a number is one line and
    trains nothing. The best-seed row and the verdict stand on the same seeds; the experiment's own table is
    tiny.md."""
    out = tiny_seeded(tmp_path, monkeypatch)
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", dataclasses.replace(
        experiments.EXPERIMENTS["tiny"], select=("best_seed",), checks=[("copy/rope", "copy/nope", 0)]))
    args = ["--reproduce", "tiny", "--out", str(out), "--device", "cpu"]
    for bad in ("1,1", "0,x", "99999999999999999999"):
        code, _, err = run_cli(capsys, *args, "--seeds", bad)
        assert code == 2 and len(err.strip().splitlines()) == 1 and not out.exists(), (bad, err)
    code, stdout, _ = run_cli(capsys, *args, "--seeds", "1")
    assert code == 0 and "2 runs; 2 to train" in stdout and present(out) == ["copy/nope/seed1", "copy/rope/seed1"]
    table = (out / "reproduce" / "tiny-seeds1.md").read_text()
    assert "this table: seeds 1 (its seeds are 0, 1)" in table and "| 1 | cpu" in table
    code, stdout, _ = run_cli(capsys, *args, "--seeds", "1,0", "--plan")   # all of them: the experiment as it is
    assert code == 0 and "4 runs; 2 to train" in stdout
    code, stdout, _ = run_cli(capsys, *args)
    assert code == 0 and "| 2 | cpu" in (out / "reproduce" / "tiny.md").read_text()
    code, stdout, _ = run_cli(capsys, *args, "--seeds", "1")                # seed 0 present: left out all the same
    table = (out / "reproduce" / "tiny-seeds1.md").read_text()
    assert code == 0 and "0 to train" in stdout and "| 1 | cpu" in table and "| 2 |" not in table
    assert "best of 1 seeds" in table and "; 1 seeds -- " in table
    assert json.loads((out / "copy" / "nope" / "metrics.json").read_text())["seeds"] == [1]


def test_seeds_outside_the_experiments_train_and_table_exactly_those(capsys, tmp_path, monkeypatch):
    """--seeds 100-101, seeds the experiment never chose: the plan lists exactly those runs, they train into
    seed100/ and seed101/ beside the experiment's own, and the table, reproduce/tiny-seeds100-101.md, stands on
    them alone and says they are not the experiment's; tiny.md is left as it was."""
    out = tiny_seeded(tmp_path, monkeypatch)
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", dataclasses.replace(
        experiments.EXPERIMENTS["tiny"], checks=[("copy/rope", "copy/nope", 0)]))
    args = ["--reproduce", "tiny", "--out", str(out), "--device", "cpu"]
    code, stdout, _ = run_cli(capsys, *args, "--seeds", "100-101", "--plan")
    planned = sorted(Path(line.split()[2]).relative_to(out).as_posix() for line in stdout.splitlines() if "/seed" in line)
    assert code == 0 and "4 runs; 4 to train" in stdout and not out.exists(), stdout
    assert planned == ["copy/nope/seed100", "copy/nope/seed101", "copy/rope/seed100", "copy/rope/seed101"], planned
    code, _, _ = run_cli(capsys, *args, "--seeds", "100-101")
    assert code == 0 and present(out) == ["copy/nope/seed100", "copy/nope/seed101", "copy/rope/seed100",
                                          "copy/rope/seed101"]
    table = (out / "reproduce" / "tiny-seeds100-101.md").read_text()
    assert "this table: seeds 100, 101 (100, 101 not the experiment's own: its seeds are 0, 1)" in table
    assert "| 2 | cpu" in table and "; 2 seeds -- " in table and not (out / "reproduce" / "tiny.md").exists()


def test_labels_pick_some_of_the_experiments_runs_and_the_verdict_stands_on_them(capsys, tmp_path, monkeypatch):
    """--labels rope trains rope's runs only and writes the table from them: no nope row, and the verdict
    keeps the threshold on rope but drops the comparison with nope (with all of the experiment's runs,
    a check on a missing run reads "not run"). A label the experiment does not have, or one named twice,
    is one line and trains nothing; task/label and the full budget's suffix name a run as well.
    reproduce/tiny-copy.png draws the experiment's runs alone, beside the task's figure of every run."""
    out = tiny_seeded(tmp_path, monkeypatch)
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", dataclasses.replace(
        experiments.EXPERIMENTS["tiny"], checks=[("copy/rope", "copy/nope", 0), ("copy/rope", 2.0, 0)]))
    args = ["--reproduce", "tiny", "--out", str(out), "--device", "cpu"]
    for bad in ("alibi", "rope,rope", "scan/rope", "copy/"):
        code, _, err = run_cli(capsys, *args, "--labels", bad)
        assert code == 2 and len(err.strip().splitlines()) == 1 and not out.exists(), (bad, err)
    code, _, err = run_cli(capsys, "--task", "copy", "--method", "rope", "--labels", "rope")
    assert code == 2 and "--labels applies with --reproduce NAME only" in err
    code, stdout, _ = run_cli(capsys, *args, "--labels", "copy/rope")
    assert code == 0 and "2 runs; 2 to train" in stdout and present(out) == ["copy/rope/seed0", "copy/rope/seed1"]
    table = (out / "reproduce" / "tiny.md").read_text()
    assert "this table: the runs copy/rope alone" in table and "copy/nope" not in table
    assert "0 of 1 checks hold, 1 inconclusive (2 seeds)**" in table and "- copy/rope above 2 in len 2" in table
    figure = out / "reproduce" / "tiny-copy.png"                   # the experiment's runs, here rope's alone
    rope_alone = figure.read_bytes()
    assert rope_alone == (out / "copy" / "extrapolation.png").read_bytes()
    code, _, _ = run_cli(capsys, *args)                                            # nope's runs too
    assert code == 0 and figure.read_bytes() != rope_alone
    code, stdout, _ = run_cli(capsys, *args, "--labels", "rope")
    assert code == 0 and "0 to train" in stdout and figure.read_bytes() == rope_alone
    assert (out / "copy" / "extrapolation.png").read_bytes() != rope_alone       # the task's figure: both
    code, stdout, _ = run_cli(capsys, *args, "--labels", "rope,nope", "--plan")   # all of them: as it is
    assert code == 0 and "4 runs; 0 to train" in stdout
    full = dataclasses.replace(experiments.EXPERIMENTS["tiny"], full=dict(
        runs=experiments.EXPERIMENTS["tiny"].runs, seeds=[0], scaled="tiny full"))
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", full)
    code, stdout, _ = run_cli(capsys, *args, "--budget", "full", "--labels", "nope", "--plan")
    assert code == 0 and "1 runs; 1 to train" in stdout and "copy/nope-full/seed0" in stdout
    code, stdout, _ = run_cli(capsys, *args, "--budget", "full", "--labels", "nope-full,rope", "--plan")
    assert code == 0 and "2 runs; 2 to train" in stdout


def test_partial_builds_the_table_from_the_runs_present_and_trains_nothing(capsys, tmp_path, monkeypatch):
    """--partial with one run of four missing: nothing trains, the table stands on the runs present, each
    over its own seeds (nope 1, rope 2), says so, and gives no verdict on one common seed; the missing run
    reads "missing" in the plan. With --shard, --runs, --force or --plan, or without --reproduce, it is
    one line and trains nothing. A plain --reproduce then trains the missing run and drops the note."""
    out = tiny_seeded(tmp_path, monkeypatch)
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", dataclasses.replace(
        experiments.EXPERIMENTS["tiny"], select=("best_seed",), checks=[("copy/rope", "copy/nope", 0)]))
    args = ["--reproduce", "tiny", "--out", str(out), "--device", "cpu"]
    code, stdout, _ = run_cli(capsys, *args, "--runs", "0,2,3")
    assert code == 0 and "--partial builds it from those present" in stdout
    before = present(out)
    for bad in (["--runs", "1"], ["--shard", "1/2"], ["--force"], ["--plan"]):
        code, _, err = run_cli(capsys, *args, "--partial", *bad)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "--partial" in err, (bad, err)
    code, _, err = run_cli(capsys, "--task", "copy", "--method", "rope", "--partial")
    assert code == 2 and "--partial applies with --reproduce NAME only" in err
    code, stdout, _ = run_cli(capsys, *args, "--partial")
    assert code == 0 and present(out) == before and len(before) == 3
    assert "4 runs, 3 present (--partial trains nothing); 0 to train" in stdout and "missing     " in stdout
    table = (out / "reproduce" / "tiny.md").read_text()
    assert "this table: the 3 runs present of its 4, each over its seeds present (--partial)" in table
    rows = {r.split(" | ")[0]: r for r in table.splitlines() if "| this repo, last checkpoint" in r}
    assert "| 1 | cpu" in rows["| copy/nope"]
    assert "| 2 | cpu" in rows["| copy/rope"] and "best of 2 seeds" in table and "best of 1 seeds" in table
    assert "inconclusive: 0 of 1 checks hold, 1 inconclusive (1 seeds)" in table and "; 1 seeds -- " in table
    code, stdout, _ = run_cli(capsys, *args)
    table = (out / "reproduce" / "tiny.md").read_text()
    assert code == 0 and "1 to train" in stdout and len(present(out)) == 4 and "--partial" not in table
    assert "| 2 | cpu" in table.split("copy/nope | this repo, last checkpoint")[1].splitlines()[0]


def test_plan_trains_nothing_and_times_only_from_the_same_kind_of_device(capsys, tmp_path, monkeypatch):
    """--plan prints the run list and stops; a run present on a GPU gives no time for the CPU's runs."""
    out = tiny_seeded(tmp_path, monkeypatch)
    args = ["--reproduce", "tiny", "--out", str(out), "--device", "cpu"]
    code, stdout, _ = run_cli(capsys, *args, "--shard", "0/2")
    code, stdout, _ = run_cli(capsys, *args, "--plan")
    assert code == 0 and "4 runs; 2 to train" in stdout and stdout.count("(measured: seed0)") == 2
    assert present(out) == ["copy/nope/seed0", "copy/rope/seed0"] and "== tiny" not in stdout
    for path in out.glob("copy/*/seed0/metrics.json"):            # as if they had run on a GPU
        path.write_text(json.dumps({**json.loads(path.read_text()), "device": "NVIDIA H100 80GB HBM3"}))
    code, stdout, _ = run_cli(capsys, *args, "--plan")
    assert code == 0 and stdout.count("time unknown (no run of this task and method on this kind of device") == 2
    gpu = ["--reproduce", "tiny", "--out", str(out), "--device", "cuda", "--plan"]
    code, stdout, _ = run_cli(capsys, *gpu)           # a GPU's plan on any machine: the GPU's times
    assert code == 0 and stdout.count("(measured: seed0)") == 2 and present(out) == ["copy/nope/seed0", "copy/rope/seed0"]
    if not torch.cuda.is_available():                 # without --plan a missing GPU is still an error
        code, _, err = run_cli(capsys, *gpu[:-1])
        assert code == 2 and "no CUDA GPU is available" in err


def test_runs_present_from_another_setup_are_named_and_not_taken_for_the_new_one(capsys, tmp_path, monkeypatch):
    """After the experiment's setup changes (rope's steps 6 -> 7), its present rope runs read "other setup"
    in the plan with what differs, and a command that would train or build the table stops with one line
    before anything is written; --force with --runs retrains them. A run is judged under the preset it was
    made with (GPU runs are not "other" to a table built on a CPU), and runs from when ViPE's fine-tuning
    was a field of the run (finetune_steps) are not "other" either."""
    out = tiny_seeded(tmp_path, monkeypatch)
    args = ["--reproduce", "tiny", "--out", str(out), "--device", "cpu"]
    assert run_cli(capsys, *args)[0] == 0
    exp = experiments.EXPERIMENTS["tiny"]
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", dataclasses.replace(
        exp, runs=[exp.runs[0], {**exp.runs[1], "steps": 7}]))
    code, stdout, _ = run_cli(capsys, *args, "--plan")
    assert code == 0 and stdout.count("other setup") == 2 and "  (steps: 6 -> 7)" in stdout
    assert "present     " + str(out / "copy" / "nope" / "seed1") in stdout
    (out / "reproduce" / "tiny.md").unlink()
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "2 run(s) present were made with other options" in err
    assert not (out / "reproduce" / "tiny.md").exists()
    # --partial of several experiments tables those free of such runs, keeps the other's table, and exits 1
    (out / "reproduce" / "tiny.md").write_text("the table as it was\n")
    every, nope_only = experiments.EXPERIMENTS, dataclasses.replace(exp, runs=[exp.runs[0]])
    monkeypatch.setattr(experiments, "EXPERIMENTS", {"tiny": every["tiny"], "nope": nope_only})
    code, _, err = run_cli(capsys, "--reproduce", "all", "--partial", "--out", str(out), "--device", "cpu")
    assert code == 1 and "tiny: not tabled, its table left as it was: 2 of its runs present" in err
    assert (out / "reproduce" / "tiny.md").read_text() == "the table as it was\n"
    assert "copy/nope | this repo" in (out / "reproduce" / "nope.md").read_text()
    text = (out / "reproduce" / "all.md").read_text()          # every table, the kept one marked
    assert "the table as it was\n\n(This table was left as it was: 2 of its runs" in text and "copy/nope | this" in text
    monkeypatch.setattr(experiments, "EXPERIMENTS", every)
    (out / "reproduce" / "tiny.md").unlink()
    code, stdout, _ = run_cli(capsys, *args, "--runs", "2,3", "--force")
    assert code == 0 and "2 to train" in stdout and (out / "reproduce" / "tiny.md").exists()
    assert json.loads((out / "copy" / "rope" / "seed0" / "metrics.json").read_text())["config"]["steps"] == 7
    assert "other setup" not in run_cli(capsys, *args, "--plan")[1]
    # a run made with the GPU preset, whose other settings differ from the CPU preset's
    run0 = out / "copy" / "nope" / "seed0" / "metrics.json"
    gpu = train.asdict(make_config({**exp.runs[0], "seed": 0, "out": str(out)}, "gpu"))
    gpu["model"].update({k: json.loads(run0.read_text())["config"]["model"][k] for k in ("vocab_size", "causal")})
    assert jobs.saved_diff(gpu, make_config({**exp.runs[0], "seed": 0}, "cpu"), ["lr", "n_eval"])
    run0.write_text(json.dumps({"config": gpu}))
    assert "other setup" not in run_cli(capsys, *args, "--plan")[1]
    # a ViPE run of the time when its fine-tuning steps were a field of the run
    new = make_config(dict(task="parity", method="vipe", opts={"vipe_finetune": 200}), "cpu")
    old = train.asdict(new)
    old["model"].update(opts={}, vocab_size=len(cli.TASKS["parity"].vocab))   # train() sets the vocabulary
    old.update(finetune_steps=200, s_rule="fixed")
    assert jobs.saved_diff(old, new, ["steps", "model"]) == ""
    old["finetune_steps"] = 100
    assert jobs.saved_diff(old, new, ["model"]) == "model.opts: {'vipe_finetune': 100} -> {'vipe_finetune': 200}"
    # ViPE's experiments name the fresh fine-tuning optimiser: runs from before it was the default (the run's Adam
    # state continued) are another setup for them, those made with it (their config says so) are not
    vipe = next(r for r in experiments.EXPERIMENTS["vipe-parity"].runs if r["method"] == "vipe")
    setup = make_config({**vipe, "seed": 0}, "cpu")
    before = train.asdict(setup)
    before["model"].update(opts={"vipe_finetune": 200}, vocab_size=len(cli.TASKS["parity"].vocab))
    assert "vipe_ft_optim" in jobs.saved_diff(before, setup, jobs.RUN_KEYS)
    before["model"]["opts"]["vipe_ft_optim"] = "fresh"
    assert jobs.saved_diff(before, setup, jobs.RUN_KEYS) == ""


def test_runs_trains_the_picked_runs_and_a_stopped_run_continues_from_its_checkpoint(capsys, tmp_path, monkeypatch):
    """--runs 1,3 trains runs 1 and 3 of the fixed list only. A run that a signal stopped after its
    third step (a preempted Slurm task, the end of a GPU visit) continues from its checkpoint under
    --reproduce, which the plan says, and ends with the weights and losses of a run never stopped."""
    out = tiny_seeded(tmp_path, monkeypatch)
    args = ["--reproduce", "tiny", "--out", str(out), "--device", "cpu"]
    code, stdout, _ = run_cli(capsys, *args, "--runs", "1,3")
    assert code == 0 and present(out) == ["copy/nope/seed1", "copy/rope/seed1"]
    assert "4 runs, --runs 1,3: 2 of them; 2 to train" in stdout and stdout.count("not picked") == 2
    assert "its table waits for them" in stdout and not (out / "reproduce" / "tiny.md").exists()
    assert "present already" not in stdout
    code, stdout, _ = run_cli(capsys, *args, "--runs", "1,2,3", "--plan")   # 1 and 3 are present: the plan says so
    assert code == 0 and "--runs: run(s) 1, 3 present already, not trained again (--force reruns them)" in stdout
    real, calls = train.Step.__call__, {"n": 0}

    def stop_after_3(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)     # the loop stops before its next step, with a checkpoint
        return real(self, batch)
    monkeypatch.setattr(train.Step, "__call__", stop_after_3)
    code, _, err = run_cli(capsys, *args, "--runs", "0")
    run0 = out / "copy" / "nope" / "seed0"
    assert code == 130 and "with --reproduce, the same command" in err and not (run0 / "metrics.json").exists()
    assert torch.load(run0 / "checkpoint.pt", weights_only=False)["step"] == 3
    calls["n"] = 0

    def count(self, batch):
        calls["n"] += 1
        return real(self, batch)
    monkeypatch.setattr(train.Step, "__call__", count)
    code, stdout, _ = run_cli(capsys, *args, "--plan")
    assert code == 0 and "0 train       " + str(run0) in stdout and "from its checkpoint at step 3" in stdout
    code, stdout, _ = run_cli(capsys, *args)
    assert code == 0 and len(present(out)) == 4 and (out / "reproduce" / "tiny.md").exists()
    assert f"continuing {run0} from its checkpoint" in stdout and calls["n"] == 3 + 6   # run 0's last 3, run 2's 6
    again = tmp_path / "again"
    code, _, _ = run_cli(capsys, "--reproduce", "tiny", "--out", str(again), "--device", "cpu", "--runs", "0")
    a, b = torch.load(run0 / "model.pt"), torch.load(again / "copy" / "nope" / "seed0" / "model.pt")
    assert code == 0 and all(torch.equal(a[k], b[k]) for k in a)
    loss = [json.loads((d / "copy" / "nope" / "seed0" / "metrics.json").read_text())["loss"] for d in (out, again)]
    assert loss[0] == loss[1] and len(loss[0]) == 6


def test_a_checkpoint_with_other_options_is_not_continued(capsys, tmp_path, monkeypatch):
    """--reproduce continues a stopped run only if its checkpoint has the experiment's options: after
    the experiment's learning rate changed, the run fails with the options that differ and the
    checkpoint is kept; --force starts it over."""
    out = tiny_seeded(tmp_path, monkeypatch)
    args = ["--reproduce", "tiny", "--out", str(out), "--device", "cpu", "--runs", "0"]
    real = train.Step.__call__

    def stop_at_once(self, batch):
        os.kill(os.getpid(), signal.SIGINT)
        return real(self, batch)
    monkeypatch.setattr(train.Step, "__call__", stop_at_once)
    assert run_cli(capsys, *args)[0] == 130
    monkeypatch.setattr(train.Step, "__call__", real)
    ckpt = out / "copy" / "nope" / "seed0" / "checkpoint.pt"
    kept = ckpt.read_bytes()
    for run in experiments.EXPERIMENTS["tiny"].runs:
        run["lr"] = 5e-3
    code, stdout, err = run_cli(capsys, *args)
    assert code == 1 and "holds a started run (its checkpoint) with other options (lr: 0.002 -> 0.005)" in stdout + err
    assert ckpt.read_bytes() == kept and not (ckpt.parent / "metrics.json").exists()
    code, _, _ = run_cli(capsys, *args, "--force")
    assert code == 0 and (ckpt.parent / "metrics.json").exists()


def test_reproduce_passes_compile_to_its_runs(capsys, tmp_path, monkeypatch):
    """--compile reaches the experiment's runs (on the CPU, where it cannot run, it is refused before
    anything is written)."""
    out = tiny_seeded(tmp_path, monkeypatch)
    code, _, err = run_cli(capsys, "--reproduce", "tiny", "--out", str(out), "--device", "cpu", "--compile")
    assert code == 2 and "--compile needs a CUDA GPU" in err and not out.exists()


@pytest.mark.parametrize("runs", ["4", "0,0", "-1", "a", "2-1"])
def test_bad_runs_are_one_line_and_write_nothing(capsys, tmp_path, monkeypatch, runs):
    out = tiny_seeded(tmp_path, monkeypatch)
    code, _, err = run_cli(capsys, "--reproduce", "tiny", "--out", str(out), "--device", "cpu", f"--runs={runs}")
    assert code == 2 and err.startswith("error: --runs") and len(err.strip().splitlines()) == 1
    assert not out.exists()
    code, _, err = run_cli(capsys, "--reproduce", "tiny", "--out", str(out), "--device", "cpu", "--runs", "0",
                           "--shard", "0/2")
    assert code == 2 and err.strip() == "error: give --shard or --runs, not both" and not out.exists()


@pytest.mark.parametrize("shard", ["2/2", "1/0", "a/2", "-1/2", "1", "0/2/3"])
def test_a_bad_shard_is_one_line_and_writes_nothing(capsys, tmp_path, monkeypatch, shard):
    out = tiny_seeded(tmp_path, monkeypatch)
    code, stdout, err = run_cli(capsys, "--reproduce", "tiny", "--out", str(out), "--device", "cpu", f"--shard={shard}")
    assert code == 2 and err.strip() == f"error: --shard takes I/N with 0 <= I < N (e.g. 0/8), got {shard!r}"
    assert not out.exists()


def test_shard_without_reproduce_is_refused(capsys, tmp_path):
    code, _, err = run_cli(capsys, "--task", "copy", "--method", "rope", "--device", "cpu", "--shard", "0/2",
                           "--out", str(tmp_path / "runs"))
    assert code == 2 and "--shard applies with --reproduce NAME only" in err
    assert not (tmp_path / "runs").exists()
    code, _, err = run_cli(capsys, "--task", "copy", "--method", "rope", "--device", "cpu", "--plan",
                           "--out", str(tmp_path / "runs"))
    assert code == 2 and "--plan applies with --reproduce NAME only" in err


def test_the_full_budget_trains_the_papers_setup_beside_the_quick_one(capsys, tmp_path, monkeypatch):
    """--budget full: the experiment's full runs and seeds, in folders tagged "full" (the quick runs'
    folders untouched), the paper's cells on the full rows, and a table of its own."""
    tiny = dict(task="copy", steps=3, batch_size=8, d_model=32, n_layers=1, n_heads=2, n_eval=8,
                train_lengths=[1, 2], test_lengths=[2])
    exp = experiments.Experiment(
        claim="tiny", runs=[dict(tiny, method="rope")], columns=[("len 2", (2, 2), "exact")],
        paper={"rope": ["0.9"]}, scaled="tiny", seeds=[0],
        full=dict(runs=[dict(tiny, method="rope", steps=4, train_set=16)], seeds=[3, 5], scaled="the paper's"))
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", exp)
    out = tmp_path / "runs"
    code, stdout, _ = run_cli(capsys, "--reproduce", "tiny", "--budget", "full", "--out", str(out), "--device", "cpu")
    assert code == 0 and present(out) == ["copy/rope-full/seed3", "copy/rope-full/seed5"]
    m = json.loads((out / "copy" / "rope-full" / "seed3" / "metrics.json").read_text())
    assert m["config"]["train_set"] == 16 and m["config"]["steps"] == 4
    table = (out / "reproduce" / "tiny-full.md").read_text()
    assert "| copy/rope-full | paper | 0.9 |" in table and "Scaled: the paper's" in table
    assert not (out / "reproduce" / "tiny.md").exists()


def test_a_budget_an_experiment_lacks_is_one_line(capsys, tmp_path, monkeypatch):
    out = tiny_seeded(tmp_path, monkeypatch)
    code, _, err = run_cli(capsys, "--reproduce", "tiny", "--budget", "full", "--out", str(out), "--device", "cpu")
    assert code == 2 and err.strip().startswith("error: experiment tiny has no full setup yet; --budget full is "
                                                "defined for: ") and "vipe-parity" in err
    assert not out.exists()
    code, _, err = run_cli(capsys, "--task", "copy", "--method", "rope", "--budget", "full", "--out", str(out))
    assert code == 2 and "--budget applies with --reproduce NAME only" in err and not out.exists()


def test_every_full_setup_is_valid_and_apart_from_the_quick_runs():
    for name, exp in experiments.EXPERIMENTS.items():
        if exp.full:
            full = experiments.at_budget(exp, "full")
            for run in full.runs:
                validate(make_config({**run, "device": "cpu"}, "gpu"))
                assert run["tag"].endswith("full")
            assert len(full.seeds) >= 3


def test_a_full_setup_reports_its_own_selection_rule_or_the_quick_one():
    """prism-more's quick runs are not evaluated during training, its full runs every 1k steps as in the paper:
    only the full table has the paper's top-3 rule. A full setup that names no rule keeps the quick one, and
    every top-3 rule stands on runs evaluated during training."""
    more = experiments.EXPERIMENTS["prism-more"]
    assert more.select is None and experiments.at_budget(more, "full").select == ("top3",)
    parity = experiments.EXPERIMENTS["vipe-parity"]
    assert "select" not in parity.full and experiments.at_budget(parity, "full").select == ("best_seed",)
    for name, exp in experiments.EXPERIMENTS.items():
        for e in [exp] + ([experiments.at_budget(exp, "full")] if exp.full else []):
            if e.select == ("top3",):
                assert all(make_config({**run, "device": "cpu"}, "gpu").eval_every for run in e.runs), name


def test_prism_more_lengths_and_test_set_are_the_papers_at_both_budgets():
    """SPEC: reverse, odds-first and stack train to 40 and are tested to 150 (reverse's task tests to 100 by
    default, so its runs name their lengths). The full runs' evaluations during training take the paper's
    1,000 examples over the run's own test lengths (7 a length for 150), not over the task's."""
    from tasks import TASKS
    exp = experiments.EXPERIMENTS["prism-more"]
    for e in (exp, experiments.at_budget(exp, "full")):
        for run in e.runs:
            if run["task"] in ("reverse", "odds_first", "stack"):
                cfg = make_config({**run, "device": "cpu"}, "gpu")
                train = cfg.train_lengths or TASKS[run["task"]].train_lengths
                test = cfg.test_lengths or TASKS[run["task"]].test_lengths
                assert (max(train), max(test)) == (40, 150), (run["task"], max(train), max(test))
                if e is not exp:
                    assert 1000 <= cfg.n_eval_during * len(test) < 1000 + len(test), (run["task"], cfg.n_eval_during)


def test_every_full_curriculum_trains_at_its_longest_length_for_a_quarter_of_its_steps():
    """The full budget takes fewer steps than the paper where they do not fit; a run cut so short that
    the paper's curriculum (5k steps a stage) never reaches its longest training length, or only at the
    end, would not be the paper's setup. The quick runs scale their curriculum to their steps instead, and
    so do the full runs of prism-more's reverse, stack and odds-first, which the paper's schedule takes to
    40 at 30k."""
    from tasks import curriculum_lengths
    seen = 0
    for name, exp in experiments.EXPERIMENTS.items():
        for run in experiments.at_budget(exp, "full").runs if exp.full else []:
            cfg = make_config({**run, "device": "cpu"}, "gpu")
            if not cfg.curriculum:
                continue
            assert cfg.curriculum_steps or run["task"] in experiments.PRISM_MORE_SCALED, (name, run["task"])
            lengths = cfg.train_lengths or validate(cfg).train_lengths
            first = next(step for step in range(0, cfg.steps, 500)
                         if max(curriculum_lengths(step, cfg.steps, lengths, cfg.curriculum_steps)) == max(lengths))
            assert first <= 0.75 * cfg.steps, (name, run["task"], first, cfg.steps)
            seen += 1
    assert seen >= 9        # prism-copy and prism-add (PRISM and APE), prism-more's five curriculum tasks


def test_reproduce_all_puts_every_experiments_runs_in_one_queue(capsys, tmp_path, monkeypatch):
    """--reproduce all --jobs 2 with two experiments of one run each: one pool trains both at once
    (one experiment at a time would train each run alone, leaving a job, or a GPU, idle), and each
    experiment's table is then written from its own run."""
    out = two_tiny_experiments(monkeypatch, tmp_path)
    code, stdout, _ = run_cli(capsys, "--reproduce", "all", "--jobs", "2", "--out", str(out), "--device", "cpu")
    assert code == 0 and stdout.count("2 runs, 2 at a time") == 1, stdout
    assert stdout.count(" (1 of 2): ") == 1 and stdout.count(" (2 of 2): ") == 1         # the count of runs ended
    assert (out / "copy" / "nope" / "seed0" / "train.log").exists() and (out / "copy" / "rope" / "seed0" / "train.log").exists()
    assert "| copy/nope | this repo, last checkpoint" in (out / "reproduce" / "one.md").read_text()
    assert "| copy/rope | this repo, last checkpoint" in (out / "reproduce" / "two.md").read_text()


def test_jobs_spread_evenly_over_every_visible_gpu(capsys, tmp_path, monkeypatch):
    """With two GPUs visible, --jobs 4 starts four processes, two on each GPU (CUDA_VISIBLE_DEVICES
    set in each before CUDA starts there); every run's log says which process and GPU ran it."""
    import re
    monkeypatch.setattr(jobs, "visible_gpus", lambda: ["0", "1"])
    tiny = ["--task", "copy", "--methods", "nope,rope", "--seeds", "0,1", "--d-model", "16", "--n-layers", "1",
            "--n-heads", "2", "--steps", "3", "--batch-size", "4", "--n-eval", "4", "--train-lengths", "1-3",
            "--test-lengths", "2", "--device", "cpu", "--out", str(tmp_path)]
    code, stdout, _ = run_cli(capsys, *tiny, "--jobs", "4")
    assert code == 0 and "4 runs, 4 at a time over GPUs 0, 1" in stdout
    seen = {}
    for log in tmp_path.glob("copy/*/seed*/train.log"):
        pid, gpu = re.search(r"process (\d+), \d+ CPU threads[^,]*, CUDA_VISIBLE_DEVICES=(\S+)", log.read_text()).groups()
        assert seen.setdefault(pid, gpu) == gpu                  # a process keeps its GPU
    assert len(list(tmp_path.glob("copy/*/seed*/train.log"))) == 4 and set(seen.values()) <= {"0", "1"}
    per_gpu = [sum(g == gpu for g in seen.values()) for gpu in ("0", "1")]
    assert max(per_gpu) <= 2                                   # all on one GPU would be 3 or 4 here


FAKE_MPS = """#!/bin/sh
# the control daemon's life as jobs.mps_daemon sees it: -f opens the control pipe and runs until told to quit
d="$CUDA_MPS_PIPE_DIRECTORY"
if [ "$1" = "-f" ]; then
  [ -n "$FAKE_MPS_FAIL" ] && { echo "$FAKE_MPS_FAIL"; exit 1; }
  echo $$ > "$CUDA_MPS_LOG_DIRECTORY/pid"; echo "$CUDA_VISIBLE_DEVICES" > "$CUDA_MPS_LOG_DIRECTORY/visible"
  : > "$d/control"
  while [ ! -e "$d/quit" ]; do sleep 0.05; done
  rm -f "$d/control"; exit 0
fi
read cmd; [ "$cmd" = quit ] && [ -z "$FAKE_MPS_HANG" ] && : > "$d/quit"; exit 0
"""


def fake_mps(tmp_path, monkeypatch):
    """A stand-in nvidia-cuda-mps-control first on PATH; returns where its pid file will be."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / jobs.MPS_CONTROL).write_text(FAKE_MPS)
    (bin_dir / jobs.MPS_CONTROL).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(jobs, "MPS_WAIT", 2.0)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (it may leave /proc between any two reads)."""
    try:
        os.kill(pid, 0)
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False


TINY_JOBS = ["--task", "copy", "--methods", "nope,rope", "--d-model", "16", "--n-layers", "1", "--n-heads", "2",
             "--steps", "3", "--batch-size", "4", "--n-eval", "4", "--train-lengths", "1-3", "--test-lengths", "2",
             "--device", "cpu", "--jobs", "2"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stand-in daemon is a POSIX shell script")
def test_jobs_sharing_a_gpu_run_under_an_mps_daemon_that_ends_with_the_command(capsys, tmp_path, monkeypatch):
    """Two jobs on one (faked) GPU: the command starts the daemon with its folders under the output,
    both runs see it, and it has quit when the command returns."""
    fake_mps(tmp_path, monkeypatch)
    monkeypatch.setattr(jobs, "visible_gpus", lambda: ["0"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    code, stdout, _ = run_cli(capsys, *TINY_JOBS, "--out", str(tmp_path / "runs"))
    assert code == 0 and "MPS: daemon started" in stdout, stdout
    for log in (tmp_path / "runs").glob("copy/*/seed0/train.log"):
        assert "under CUDA MPS" in log.read_text()
    pid = int((tmp_path / "runs" / ".mps" / str(os.getpid()) / "log" / "pid").read_text())
    assert not alive(pid) and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stand-in daemon is a POSIX shell script")
@pytest.mark.parametrize("visible", ["1", "2,3"])
def test_jobs_under_mps_name_the_gpus_as_the_daemon_numbers_them(capsys, tmp_path, monkeypatch, visible):
    """The daemon runs on the command's GPUs ("2,3") and shows them to its clients as 0, 1, ...: a job
    that kept "2" would find no GPU. The jobs get the daemon's numbering; the command's own
    CUDA_VISIBLE_DEVICES is back when it returns."""
    import re
    fake_mps(tmp_path, monkeypatch)
    gpus = visible.split(",")
    monkeypatch.setattr(jobs, "visible_gpus", lambda: gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    out = tmp_path / "runs"
    code, stdout, _ = run_cli(capsys, *TINY_JOBS[:-1], str(2 * len(gpus) + 1), "--seeds", "0,1", "--out", str(out))
    assert code == 0 and "MPS: daemon started" in stdout, stdout
    assert (out / ".mps" / str(os.getpid()) / "log" / "visible").read_text().strip() == visible
    seen = {re.search(r"CUDA_VISIBLE_DEVICES=(\S+),", log.read_text()).group(1)
            for log in out.glob("copy/*/seed*/train.log")}
    assert seen and seen <= {str(i) for i in range(len(gpus))}      # which process took which run may vary
    assert os.environ["CUDA_VISIBLE_DEVICES"] == visible and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stand-in daemon is a POSIX shell script")
def test_mps_daemon_is_ended_on_ctrl_c_and_when_it_ignores_quit(tmp_path, monkeypatch):
    fake_mps(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_MPS_HANG", "1")                 # quit is ignored: the daemon is killed instead
    monkeypatch.setattr(jobs, "MPS_WAIT", 0.5)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        with jobs.mps_daemon(tmp_path / "out" / ".mps", ["0"], log=lines.append):
            assert (Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"]) / "control").exists()
            pid = int((tmp_path / "out" / ".mps" / str(os.getpid()) / "log" / "pid").read_text())
            assert alive(pid)
            raise KeyboardInterrupt
    assert not alive(pid) and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert len(lines) == 2 and lines[1] == "MPS: the daemon had not quit 0.5 s after it was asked to: killed"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stand-in daemon is a POSIX shell script")
def test_two_commands_on_one_output_folder_each_end_only_their_own_mps_daemon(tmp_path, monkeypatch):
    """Two `--jobs` commands at once writing to one --out (two tasks' runs on one GPU): the one that ends
    first must leave the other's daemon running, or the other's runs lose their MPS server mid-run."""
    fake_mps(tmp_path, monkeypatch)
    folder = tmp_path / "runs" / ".mps"
    other = ("import sys, jobs; from pathlib import Path\n"
             "with jobs.mps_daemon(Path(sys.argv[1]), ['0'], log=print): pass")
    with jobs.mps_daemon(folder, ["0"], log=lambda line: None):
        pid = int(next(folder.glob("**/pid")).read_text())          # the one daemon so far
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS")}   # a command of its own
        done = subprocess.run([sys.executable, "-c", other, str(folder)], cwd=Path(jobs.__file__).parent, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "MPS: daemon started" in done.stdout, done.stdout + done.stderr
        assert alive(pid)                                    # the other command's daemon has come and gone
    assert not alive(pid)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or shutil.which(jobs.MPS_CONTROL) is None,
                    reason="needs a CUDA GPU and nvidia-cuda-mps-control")
def test_two_jobs_commands_at_once_on_one_gpu_each_under_its_own_mps_daemon(tmp_path):
    """The real daemon: two `--jobs 2` commands on one GPU and one --out. While the first trains, the second
    runs to its end and stops its daemon; the first's runs must go on training (with one shared daemon they
    died with it) and stop cleanly at Ctrl-C, each with its checkpoint."""
    base = [sys.executable, "train.py", *TINY_JOBS[:-4], "--device", "cuda", "--jobs", "2", "--out",
            str(tmp_path / "runs")]
    root = Path(jobs.__file__).parent
    first = subprocess.Popen(base + ["--steps", "10000000", "--seeds", "0"], cwd=root, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    logs = [tmp_path / "runs" / "copy" / m / "seed0" / "train.log" for m in ("nope", "rope")]
    deadline = time.time() + 180
    while not all(log.exists() and "step " in log.read_text() for log in logs) and time.time() < deadline:
        assert first.poll() is None, first.communicate()[0]
        time.sleep(1)
    second = subprocess.run(base + ["--steps", "20", "--seeds", "1"], cwd=root, capture_output=True, text=True,
                            timeout=300)
    time.sleep(10)                                           # the first's runs, after the second's daemon quit
    alive_after = first.poll() is None
    first.send_signal(signal.SIGINT)
    out = first.communicate(timeout=120)[0]
    assert second.returncode == 0 and "MPS: daemon started" in second.stdout, second.stdout + second.stderr
    assert alive_after and "MPS: daemon started" in out, out
    assert first.returncode == 130 and out.count("stopped, checkpoint written") == 2 and "failed" not in out, out
    assert len(list((tmp_path / "runs").glob("copy/*/seed1/metrics.json"))) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stand-in daemon is a POSIX shell script")
def test_without_mps_the_jobs_run_and_one_line_says_what_it_costs(capsys, tmp_path, monkeypatch):
    """No daemon program, or one that fails to start: one line each, and the runs still finish."""
    monkeypatch.setattr(jobs, "visible_gpus", lambda: ["0"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(jobs, "MPS_CONTROL", "no-such-mps-control-program")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    code, stdout, _ = run_cli(capsys, *TINY_JOBS, "--out", str(tmp_path / "a"))
    line = [x for x in stdout.splitlines() if x.startswith("MPS:")]
    assert code == 0 and len(line) == 1 and "not found; the runs sharing a GPU take turns" in line[0]
    assert len(list((tmp_path / "a").glob("copy/*/seed0/metrics.json"))) == 2
    monkeypatch.setattr(jobs, "MPS_CONTROL", "nvidia-cuda-mps-control")
    fake_mps(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_MPS_FAIL", "An instance of this daemon is already running")
    code, stdout, _ = run_cli(capsys, *TINY_JOBS, "--out", str(tmp_path / "b"))
    line = [x for x in stdout.splitlines() if x.startswith("MPS:")]
    assert code == 0 and len(line) == 1 and "did not start (An instance of this daemon is already running)" in line[0]
    assert len(list((tmp_path / "b").glob("copy/*/seed0/metrics.json"))) == 2
    code, stdout, _ = run_cli(capsys, *TINY_JOBS, "--out", str(tmp_path / "c"), "--no-mps")
    assert code == 0 and "MPS" not in stdout


def _leave_a_thread_running(seconds: float) -> int:
    """A job that returns but leaves a non-daemon thread behind, so its process cannot exit."""
    import threading
    import time
    threading.Thread(target=time.sleep, args=(seconds,)).start()
    return os.getpid()


def test_a_job_process_that_does_not_exit_is_killed_once_the_runs_have_ended():
    """end_pool waits a bounded time for the pool's processes; one that is still there is killed and
    named, where the pool's own shutdown would wait for it (here 600 s)."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))   # one: no process still
    stuck = pool.submit(_leave_a_thread_running, 600).result(timeout=120)            # starting when it ends
    lines, t0 = [], time.time()
    jobs.end_pool(pool, wait=2.0, log=lines.append)
    while alive(stuck) and time.time() - t0 < 20:   # a killed process closes its sentinel before it is a
        time.sleep(0.05)                            # zombie: /proc may show it running for a moment
    assert time.time() - t0 < 30 and not alive(stuck)
    assert lines[0] == f"  killed 1 job process (pid {stuck}) still there 2 s after the runs ended"
    assert lines[1:] == [] or lines[1].startswith(f"    pid {stuck} was ") and "no child processes" in lines[1]
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    pool.submit(os.getpid).result(timeout=120)                 # processes that exit: no line, no wait
    t0, before = time.time(), len(lines)
    jobs.end_pool(pool, wait=60.0, log=lines.append)
    assert time.time() - t0 < 30 and len(lines) == before


def _ignore_sigterm_and_sleep(ready, seconds: float):
    import signal
    import time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(seconds)


def _leave_a_child_that_ignores_sigterm(seconds: float) -> tuple[int, int]:
    """A job that returns but leaves a forked daemon child that ignores SIGTERM, as the data workers
    do: at exit its process sends such children SIGTERM and then waits for them, forever."""
    import multiprocessing
    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    child = fork.Process(target=_ignore_sigterm_and_sleep, args=(ready, seconds), daemon=True)
    child.start()
    assert ready.wait(60)
    return os.getpid(), child.pid


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_a_job_process_waiting_for_its_child_is_killed_with_it_and_the_wait_is_named():
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    job, child = pool.submit(_leave_a_child_that_ignores_sigterm, 600).result(timeout=120)
    assert jobs.child_pids(job) == [child]
    lines = []
    jobs.end_pool(pool, wait=3.0, log=lines.append)
    time.sleep(0.5)
    assert not alive(job) and not alive(child), lines
    assert lines[0] == f"  killed 1 job process (pid {job}) still there 3 s after the runs ended"
    assert lines[1].startswith(f"    pid {job} was ") and f"children: {child} S" in lines[1], lines


def test_a_job_kills_the_processes_its_run_left_behind_and_says_so(tmp_path, monkeypatch):
    """run_logged (a --jobs job) ends the processes that its run started and left running (a data
    worker that ignores SIGTERM), and only those, with a line in the run's train.log."""
    import multiprocessing
    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    older = fork.Process(target=_ignore_sigterm_and_sleep, args=(ready, 600), daemon=True)
    older.start()                                  # a child from before the run: left alone
    assert ready.wait(60)
    left = {}

    def a_run_that_leaves_a_worker(cfg, resume=False, log=print, force=False):
        ready.clear()
        left["p"] = fork.Process(target=_ignore_sigterm_and_sleep, args=(ready, 600), daemon=True)
        left["p"].start()
        assert ready.wait(60)
        return {"eval": [{"length": 1, "variant": None, "exact": 1.0, "n": 1}], "train_max_length": 1}
    monkeypatch.setattr(cli, "run", a_run_that_leaves_a_worker)
    cfg = cli.make_config({"task": "copy", "method": "rope", "out": str(tmp_path)}, "cpu")
    try:
        jobs.run_logged(cli.run, cfg)
        assert not left["p"].is_alive() and older.is_alive()
        log = (cfg.run_dir() / "train.log").read_text()
        assert f"killed 1 process that the run started and left behind (pid {left['p'].pid})" in log
    finally:
        older.kill()
        older.join(5)


def test_a_job_stops_the_data_workers_of_a_loader_its_run_left_open(tmp_path, monkeypatch):
    """A run that returns with its data loader still open (its workers registered with torch, whose
    SIGCHLD handler raises when one of them is killed): run_logged stops the workers as the loader
    would (they exit by themselves, code 0, not killed: a worker killed while it holds the loader's
    lock would leave the process waiting on that lock for ever once the loader is dropped) and hands
    back the run's own outcome."""
    from tasks import TASKS, TrainBatches
    kept, workers = [], []

    def a_run_that_keeps_its_loader(cfg, resume=False, log=print, force=False):
        before = set(multiprocessing.active_children())
        stream = TrainBatches(TASKS["parity"], [2, 3], 4, 0, 1000).loader(0, 1000, workers=2)
        next(stream)
        kept.append(stream)                            # still open: its workers still run
        workers.extend(p for p in multiprocessing.active_children() if p not in before)
        return {"eval": [{"length": 1, "variant": None, "exact": 1.0, "n": 1}], "train_max_length": 1}
    monkeypatch.setattr(cli, "run", a_run_that_keeps_its_loader)
    cfg = cli.make_config({"task": "copy", "method": "rope", "out": str(tmp_path)}, "cpu")
    before = set(multiprocessing.active_children())
    assert jobs.run_logged(cli.run, cfg).startswith("exact")
    assert len(workers) == 2 and [p.exitcode for p in workers] == [0, 0]
    assert not [p for p in multiprocessing.active_children() if p not in before]
    log = (cfg.run_dir() / "train.log").read_text()
    assert "stopped the data workers of 1 loader that the run left open" in log and "killed" not in log
    kept.clear()                                       # the loader dropped: nothing left to wait on


@pytest.mark.parametrize("whole_group", [False, True], ids=["kill-parent", "ctrl-c-group"])
def test_a_signal_stops_every_job_with_a_checkpoint_and_starts_no_queued_run(tmp_path, whole_group):
    """--jobs 2 over three runs, then SIGTERM to the command alone (`kill PID`: it passes the signal
    on) or to its whole group (Ctrl-C, `timeout`): the two running runs write their checkpoints,
    the third never starts, the command says so and exits 130, and no job process is left."""
    import re
    import signal
    import subprocess
    import time
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "train.py", "--task", "copy", "--methods", "nope,rope,alibi",
                             "--steps", "100000", "--d-model", "16", "--n-layers", "1", "--n-heads", "2",
                             "--batch-size", "4", "--device", "cpu", "--jobs", "2", "--out", str(tmp_path)],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    logs = [tmp_path / "copy" / m / "seed0" / "train.log" for m in ("nope", "rope")]
    deadline = time.time() + 120
    while not all(p.exists() and "/ seed 0:" in p.read_text() for p in logs) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    (os.killpg if whole_group else os.kill)(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out[-2000:]
    assert "stopped by signal 15: 2 of 3 runs wrote a checkpoint (" in out and "alibi/seed0: not started" in out
    for log in logs:
        assert 1 <= torch.load(log.parent / "checkpoint.pt", weights_only=False)["step"] < 100000
        assert "checkpoint written" in log.read_text()
        pid = int(re.search(r"process (\d+)", log.read_text()).group(1))
        time.sleep(0.5)
        assert not alive(pid), f"job process {pid} is still running"
    assert not (tmp_path / "copy" / "alibi" / "seed0" / "checkpoint.pt").exists()


def test_a_signal_while_a_job_process_waits_for_work_breaks_no_run(tmp_path):
    """--jobs 3 over three runs, one of them short: its job process is idle when SIGTERM reaches the
    whole group (`timeout`, Ctrl-C). The idle process must live on: a pool process that dies breaks
    the pool, and every run still going would read "failed" although each wrote its checkpoint."""
    import signal
    import subprocess
    import time
    root = Path(__file__).resolve().parents[1]
    script = (f"import sys; sys.path.insert(0, {str(root)!r}); import cli, jobs, train\n"
              f"cfgs = [cli.make_config(dict(task='copy', method=m, steps=s, d_model=16, n_layers=1, n_heads=2, "
              f"batch_size=4, n_eval=4, out={str(tmp_path)!r}), 'cpu') "
              f"for m, s in (('nope', 5), ('rope', 100000), ('alibi', 100000))]\n"
              "try:\n    jobs.run_many(cfgs, cli.run, jobs=3)\nexcept train.Interrupted as e:\n    print(e); sys.exit(130)\n")
    out_file = tmp_path / "out.txt"
    with open(out_file, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    logs = [tmp_path / "copy" / m / "seed0" / "train.log" for m in ("rope", "alibi")]
    deadline = time.time() + 120
    while not ("done" in out_file.read_text() and all(p.exists() and "step" in p.read_text() for p in logs)) \
            and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    text = out_file.read_text()
    assert proc.returncode == 130 and "nope/seed0 (1 of 3): exact" in text, text[-2000:]
    assert "stopped by signal 15: 2 of 3 runs wrote a checkpoint, 1 finished (" in text, text[-2000:]
    assert "failed" not in text, text[-2000:]
    for log in logs:
        assert 1 <= torch.load(log.parent / "checkpoint.pt", weights_only=False)["step"] < 100000


def write_seed(out, run, seed, exact_beyond, token=None):
    """A seed's metrics with exact match 1 at length 1 (the training length) and `exact_beyond` at 2."""
    rows = [{"name": str(L), "length": L, "variant": None, "n": 10, "exact": e, "token": e if token is None else token}
            for L, e in ((1, 1.0), (2, exact_beyond))]
    path = out / run / f"seed{seed}" / "metrics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"seed": seed, "eval": rows, "train_max_length": 1}))


def test_a_check_holds_when_its_bootstrap_interval_excludes_zero():
    """The rule on hand-made seeds: a clear win holds, a tie and a win by less than the spread between seeds are
    inconclusive (the second says how many seeds its spread suggests), a clear loss fails, one seed is
    inconclusive whatever its value; a threshold holds when the whole interval of the mean clears it; errors
    compare the other way round."""
    win, lose, tie = [0.9, 0.8, 0.85, 0.95, 0.9], [0.1, 0.2, 0.15, 0.05, 0.1], [0.5, 0.4, 0.6, 0.5, 0.45]
    assert experiments.check_outcome(win, lose)[0] == "holds"
    assert experiments.check_outcome(lose, win)[0] == "fails"
    outcome, (lo, hi), need = experiments.check_outcome(tie, [0.45, 0.55, 0.5, 0.4, 0.6])
    assert outcome == "inconclusive" and lo < 0 < hi and need == "the means do not favour the claim"
    close = [0.52, 0.4, 0.6, 0.5, 0.45]          # 0.014 above tie's mean, spread 0.07-0.08: about 155 seeds a run
    outcome, _, need = experiments.check_outcome(close, tie)
    assert outcome == "inconclusive" and need.startswith("about ") and int(need.split()[1]) > 50, need
    assert experiments.check_outcome([1.0], [0.0])[0] == "inconclusive"                   # 1 seed
    assert experiments.check_outcome([0.9, 0.95], [0.1, 0.05])[0] == "inconclusive"       # below MIN_SEEDS
    assert experiments.check_outcome(win, 0.7)[0] == "holds" and experiments.check_outcome(win, 0.85)[0] == "inconclusive"
    assert experiments.check_outcome(0.5, lose)[0] == "holds" and experiments.check_outcome(0.12, lose)[0] == "inconclusive"
    assert experiments.check_outcome(lose, win, lower=True)[0] == "holds"                 # errors: lower wins
    assert experiments.check_outcome(lose, 0.5, lower=True)[0] == "holds"
    lo, hi = experiments.bootstrap(win, lose)
    assert lo == pytest.approx(0.7, abs=0.03) and hi == pytest.approx(0.83, abs=0.03)   # 0.77 +- about 1.6 SE


def test_verdict_follows_the_bootstrap_rule(tmp_path):
    """An experiment's verdict: yes when every check holds, partly when some do, no when none holds and one
    fails, inconclusive when none holds and none fails; no verdict with a run missing; each check's line gives
    the means, the interval and its outcome; seeds outside the experiment's are left out."""
    for seed, (a, b, e) in enumerate([(0.9, 0.1, 0.3), (0.8, 0.2, 0.1), (0.85, 0.3, 0.2)]):
        write_seed(tmp_path, "t/a", seed, a)   # a clearly above b
        write_seed(tmp_path, "t/b", seed, b)
        write_seed(tmp_path, "t/e", seed, e)   # e level with b
    exp = lambda checks, metric="exact": experiments.Experiment(  # noqa: E731
        claim="", runs=[], columns=[("beyond", (2, 2), metric)], paper={}, scaled="", checks=checks, seeds=[0, 1, 2])
    word, lines = experiments.verdict(exp([("t/a", "t/b", 0)]), tmp_path)
    assert word == "yes: 1 of 1 checks hold" and lines[0].startswith("t/a above t/b in beyond: mean 0.850 vs 0.200")
    assert lines[0].endswith("; 3 seeds -- holds") and "[90 %: +0.5" in lines[0], lines
    assert experiments.verdict(exp([("t/b", "t/a", 0)]), tmp_path)[0] == "no: 0 of 1 checks hold"
    word, lines = experiments.verdict(exp([("t/a", "t/b", 0), ("t/a", 0.9, 0), ("t/e", "t/b", 0)]), tmp_path)
    assert word == "partly: 1 of 3 checks hold, 1 inconclusive (3 seeds)", word
    assert "t/a above 0.9 in beyond: mean 0.850, minus 0.9" in lines[1] and lines[1].endswith("-- fails")
    assert "-- inconclusive (" in lines[2]
    word, _ = experiments.verdict(exp([("t/e", "t/b", 0)]), tmp_path)
    assert word == "inconclusive: 0 of 1 checks hold, 1 inconclusive (3 seeds)"
    word, lines = experiments.verdict(exp([("t/a", "t/b", 0), ("t/b", "t/a", 0)], "error"), tmp_path)
    assert word == "partly: 1 of 2 checks hold" and lines[1].startswith("t/b below t/a in beyond: mean 80.000 vs 15.000")
    assert experiments.verdict(exp([("t/a", "t/missing", 0)]), tmp_path)[0].startswith("no verdict (a run missing)")
    write_seed(tmp_path, "t/two", 0, 1.0)
    write_seed(tmp_path, "t/two", 1, 1.0)
    assert experiments.verdict(exp([("t/two", "t/b", 0)]), tmp_path)[0].startswith("inconclusive")   # 2 seeds
    for seed, v in ((0, 0.0), (1, 0.0), (2, 0.0), (3, 1.0)):   # seed 3 is not the experiment's: left out
        write_seed(tmp_path, "t/f", seed, v)
    assert experiments.verdict(exp([("t/b", "t/f", 0)]), tmp_path)[0].startswith("yes: 1 of 1")


def test_a_relative_check_reads_each_seed_against_its_own_accuracy_in_training(tmp_path):
    """Kept(0.9, (1, 1)): run a's value beyond training against 0.9 x its own at length 1, seed by seed. A run
    that keeps 0.95 of 1.0 holds; one at 0.6 fails; one that fits nothing (0.02 in training, 0.0 beyond) keeps
    nothing and fails by as little as its training accuracy."""
    for seed, (good, bad, unfit) in enumerate([(0.95, 0.6, 0.0), (0.96, 0.55, 0.0), (0.94, 0.62, 0.0)]):
        write_seed(tmp_path, "t/good", seed, good)
        write_seed(tmp_path, "t/bad", seed, bad)
        rows = [{"name": str(L), "length": L, "variant": None, "n": 10, "exact": e, "token": e}
                for L, e in ((1, 0.02), (2, unfit))]
        path = tmp_path / "t/unfit" / f"seed{seed}" / "metrics.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"seed": seed, "eval": rows, "train_max_length": 1}))
    kept = experiments.Kept(0.9, (1, 1))
    exp = lambda run: experiments.Experiment(claim="", runs=[], columns=[("beyond", (2, 2), "exact")], paper={},  # noqa: E731
                                             scaled="", checks=[(run, kept, 0)], seeds=[0, 1, 2])
    word, lines = experiments.verdict(exp("t/good"), tmp_path)
    assert word == "yes: 1 of 1 checks hold", (word, lines)
    assert lines[0].startswith("t/good above 0.9 x its own 1-1 in beyond: mean 0.950 vs 0.900, difference"), lines
    assert experiments.verdict(exp("t/bad"), tmp_path)[0] == "no: 0 of 1 checks hold"
    word, lines = experiments.verdict(exp("t/unfit"), tmp_path)
    assert word == "no: 0 of 1 checks hold" and "mean 0.000 vs 0.018" in lines[0], lines
    full_checks = experiments.at_budget(experiments.EXPERIMENTS["upe-mul"], "full").checks
    assert [c for c in full_checks if isinstance(c[1], experiments.Kept)] == \
        [(f"mul_padded/upe-{tag}-full", kept.__class__(0.9, (1, 5)), 3) for tag in ("m3", "m3low")]


def test_verdict_compares_two_runs_over_the_seeds_both_ran(tmp_path):
    """With more seeds in one run than in the other (--partial), a comparison is over the seeds both have:
    a's two extra seeds would lift its mean over all of its own seeds (0.600) above b's (0.567)."""
    for seed, v in enumerate([0.5, 0.5, 0.0, 1.0, 1.0]):
        write_seed(tmp_path, "t/a", seed, v)
    for seed, v in enumerate([0.4, 0.4, 0.9]):
        write_seed(tmp_path, "t/b", seed, v)
    exp = experiments.Experiment(claim="", runs=[], columns=[("beyond", (2, 2), "exact")], paper={}, scaled="",
                                 checks=[("t/a", "t/b", 0), ("t/a", 0.55, 0)], seeds=[0, 1, 2, 3, 4])
    word, lines = experiments.verdict(exp, tmp_path)
    assert lines[0].startswith("t/a above t/b in beyond: mean 0.333 vs 0.567, difference"), lines
    assert lines[1].startswith("t/a above 0.55 in beyond: mean 0.600, minus 0.55"), lines  # all of a's seeds
    assert "; 5 seeds -- " in lines[1] and "; 3 seeds -- " in lines[0]


def test_verdict_prints_the_digits_that_tell_two_close_means_apart(tmp_path):
    """Means that round to the same three decimals print with more, so a holding check never reads as a tie."""
    for seed in range(3):
        write_seed(tmp_path, "t/a", seed, 1.0)
        write_seed(tmp_path, "t/b", seed, 0.9997 - 0.0001 * seed)
        write_seed(tmp_path, "t/c", seed, 1.0)
    exp = experiments.Experiment(claim="", runs=[], columns=[("beyond", (2, 2), "exact")], paper={}, scaled="",
                                 checks=[("t/a", "t/b", 0), ("t/a", "t/c", 0)], seeds=[0, 1, 2])
    lines = experiments.verdict(exp, tmp_path)[1]
    assert lines[0].startswith("t/a above t/b in beyond: mean 1.0000 vs 0.9996, difference [90 %: +0.0003"), lines
    assert lines[0].endswith("-- holds"), lines
    assert lines[1].startswith("t/a above t/c in beyond: mean 1.000 vs 1.000"), lines
    assert lines[1].endswith("-- inconclusive (the means do not favour the claim)"), lines


def test_every_experiment_states_its_claim_as_checks_of_its_own_runs():
    """Each check names runs of the experiment (at both budgets) and one of its columns."""
    for name, exp in experiments.EXPERIMENTS.items():
        for budget in ("quick", "full") if exp.full else ("quick",):
            e = experiments.at_budget(exp, budget)
            labels = {f"{r['task']}/{r['method']}" + (f"-{r['tag']}" if r.get("tag") else "") for r in e.runs}
            assert e.checks, name
            for a, b, col in e.checks:
                assert 0 <= col < len(e.columns), (name, col)
                for x in (a, b):
                    assert isinstance(x, (float, experiments.Kept)) or x in labels, (name, budget, x)


def test_every_experiment_has_three_seeds_at_both_budgets():
    """At least 3 seeds per configuration, quick and full."""
    for name, exp in experiments.EXPERIMENTS.items():
        assert len(exp.seeds) >= 3, name
        assert exp.full is None or len(exp.full["seeds"]) >= 3, name


def test_readme_verdicts_are_those_of_the_committed_metrics():
    """README's "the rule's verdict" column, row by row and budget by budget, against experiments.verdict
    on docs/results; a full budget reads "not run" unless its runs are there, and one built with --labels
    names its runs ("checks of vipe-L3, nope-L3") and is checked on them."""
    import re
    root = Path(__file__).resolve().parents[1]
    rows = [line for line in (root / "README.md").read_text().splitlines() if line.startswith(("| `", "| [`"))
            and re.search(r"checks(; \d+ inconclusive)?\) / [^|]+\|\s*$", line)]
    assert len(rows) == len(experiments.EXPERIMENTS)

    def cell(exp, labels=None):
        word, _ = experiments.verdict(exp, root / "docs" / "results")
        head, held, total, open_ = re.match(r"(.*?): (\d+) of (\d+) checks hold(?:, (\d+) inconclusive)?",
                                            word).groups()
        head = head if head in ("yes", "no", "partly", "inconclusive") else "no verdict"
        return f"{head} ({held}/{total} checks" + (f" of {labels}" if labels else "") + \
            (f"; {open_} inconclusive" if open_ else "") + ")"
    for line in rows:
        name = line.split("`")[1]
        exp = experiments.EXPERIMENTS[name]
        quick, full = line.rstrip(" |").rsplit("| ", 1)[1].split(" / ")
        assert quick == cell(exp), (name, quick)
        if exp.full is None:
            assert full == "no full setup", name
        elif full == "not run":
            assert cell(experiments.at_budget(exp, "full")).startswith("no verdict"), name
        else:                                  # "no (0/2 checks of vipe-L3, nope-L3)": a table of some runs
            full_exp = experiments.at_budget(exp, "full")
            labels = re.search(r" checks of ([^;)]+)", full)
            if labels:
                full_exp = experiments.on_labels(full_exp, name, labels.group(1).replace(" ", "").split(","))
            assert full == cell(full_exp, labels and labels.group(1)), (name, full)


def test_a_runs_time_is_estimated_from_the_most_similar_run_present(tmp_path):
    """No other seed of the run: its time comes from the run of its task and method whose settings
    differ least (per step, scaled by the batch), not from the first one in folder order; nothing of
    the same kind of device: unknown."""
    base = dict(task="copy", method="rope", device="cpu", out=str(tmp_path), steps=100, batch_size=8, d_model=32)

    def present(tag, wall, **values):
        cfg = make_config({**base, "tag": tag, **values}, "cpu")
        metrics = {"config": train.asdict(cfg), "wall_s": wall, "final_eval_s": 0.0, "device": "cpu (2 cores)"}
        (cfg.run_dir()).mkdir(parents=True)
        (cfg.run_dir() / "metrics.json").write_text(json.dumps(metrics))
    present("a", 10.0, n_layers=1, lr=1e-3, steps=50)              # differs in depth, lr and steps
    present("b", 30.0, n_layers=4, batch_size=16)                   # differs in the batch only
    cfg = make_config({**base, "tag": "c", "n_layers": 4}, "cpu")
    seconds, how = jobs.time_of(cfg)
    assert how == "estimate: from rope-b" and seconds == pytest.approx(30.0 / 100 * 100 * 8 / 16)
    cfg = make_config({**base, "tag": "c", "n_layers": 1, "lr": 1e-3}, "cpu")
    assert jobs.time_of(cfg) == (pytest.approx(10.0 / 50 * 100), "estimate: from rope-a")
    gpu = make_config({**base, "tag": "c", "device": "cuda"}, "cpu")
    assert jobs.time_of(gpu) == (None, "")


def test_times_come_from_the_committed_runs_where_out_has_none(tmp_path, monkeypatch):
    """A fresh --out folder: a run's time is measured on the committed runs (jobs.RESULTS) of the same
    setup, and says so; a run present in --out is preferred."""
    base = dict(task="copy", method="rope", device="cpu", steps=100, batch_size=8, d_model=32)

    def present(root, wall):
        cfg = make_config({**base, "out": str(root), "seed": 1}, "cpu")
        cfg.run_dir().mkdir(parents=True)
        (cfg.run_dir() / "metrics.json").write_text(json.dumps({"config": train.asdict(cfg), "wall_s": wall,
                                                                "final_eval_s": 0.0,
                                                                "device": "cpu (2 cores)"}))
    monkeypatch.setattr(jobs, "RESULTS", tmp_path / "committed")
    present(tmp_path / "committed", 50.0)
    cfg = make_config({**base, "out": str(tmp_path / "fresh")}, "cpu")
    assert jobs.time_of(cfg) == (pytest.approx(50.0), "measured in docs/results: seed1")
    present(tmp_path / "fresh", 20.0)
    assert jobs.time_of(cfg) == (pytest.approx(20.0), "measured: seed1")


def test_a_runs_time_is_the_median_of_its_other_seeds(tmp_path):
    """Seeds of one setup that ran beside different loads: the time is their median, not the first
    seed's, and says how many seeds it stands on."""
    base = dict(task="copy", method="rope", device="cpu", out=str(tmp_path), steps=100, batch_size=8, d_model=32)
    for seed, wall in ((0, 90.0), (1, 10.0), (2, 20.0)):
        cfg = make_config({**base, "seed": seed}, "cpu")
        cfg.run_dir().mkdir(parents=True)
        (cfg.run_dir() / "metrics.json").write_text(json.dumps({"config": train.asdict(cfg), "wall_s": wall,
                                                                "final_eval_s": 0.0,
                                                                "device": "cpu (2 cores)"}))
    cfg = make_config({**base, "seed": 3, "steps": 200}, "cpu")
    assert jobs.time_of(cfg) == (pytest.approx(40.0), "measured: median of 3 seeds")


def test_a_runs_time_counts_its_final_evaluation(capsys, tmp_path, monkeypatch):
    """A run records its final evaluation's seconds (final_eval_s) beside its loop's (wall_s); a planned
    run's time adds them to its loop's at its own steps and batch, both scaled by the device's sharing;
    a run from before the record gives its loop's alone, and the label says so."""
    real, calls = train.evaluate, []

    def slow(*a, **k):
        calls.append(1)
        time.sleep(0.3)
        return real(*a, **k)
    monkeypatch.setattr(train, "evaluate", slow)
    out = tmp_path / "real"
    code, _, err = run_cli(capsys, "--task", "copy", "--method", "rope", "--d-model", "32", "--n-layers", "1",
                           "--steps", "3", "--batch-size", "8", "--n-eval", "4", "--test-lengths", "2,4",
                           "--device", "cpu", "--out", str(out))
    m = json.loads((out / "copy" / "rope" / "seed0" / "metrics.json").read_text())
    assert code == 0 and calls and 0.3 * len(calls) <= m["final_eval_s"] < m["wall_s"] + 0.3 * len(calls) + 30, err
    base = dict(task="copy", method="rope", device="cpu", out=str(tmp_path), steps=100, batch_size=8, d_model=32)
    cfg = make_config({**base, "runs_at_once": 2}, "cpu")
    cfg.run_dir().mkdir(parents=True)
    (cfg.run_dir() / "metrics.json").write_text(json.dumps({"config": train.asdict(cfg), "wall_s": 40.0,
                                                            "final_eval_s": 6.0, "device": "cpu (2 cores)"}))
    planned = make_config({**base, "seed": 1, "steps": 200}, "cpu")               # alone, twice the steps
    assert jobs.time_of(planned) == (pytest.approx((80.0 + 6.0) / 2), "measured: seed0, 2 at once there, 1 here")
    other = make_config({**base, "tag": "x", "lr": 3e-4, "batch_size": 16}, "cpu")  # twice the batch: an estimate
    assert jobs.time_of(other) == (pytest.approx((80.0 + 6.0) / 2), "estimate: from rope, 2 at once there, 1 here")
    legacy = make_config({**base, "tag": "old", "runs_at_once": 1}, "cpu")
    legacy.run_dir().mkdir(parents=True)
    (legacy.run_dir() / "metrics.json").write_text(json.dumps({"config": train.asdict(legacy), "wall_s": 30.0,
                                                               "device": "cpu (2 cores)"}))
    assert jobs.time_of(dataclasses.replace(legacy, seed=1)) == (
        pytest.approx(30.0), "measured: seed0, final evaluation not timed there")
    fast = dataclasses.replace(legacy, seed=1, compile=True)                      # a speed setting differs
    assert jobs.time_of(fast)[1] == "measured: seed0, final evaluation not timed there, without --compile there"
    assert jobs.time_of(dataclasses.replace(fast, compile=False, tf32=True))[1].endswith(", without --tf32 there")
    tf32 = make_config({**base, "tag": "tf32", "runs_at_once": 1}, "cpu")          # made with --tf32, planned without
    tf32.run_dir().mkdir(parents=True)
    (tf32.run_dir() / "metrics.json").write_text(json.dumps({"config": {**train.asdict(tf32), "tf32": True},
                                                             "wall_s": 30.0, "final_eval_s": 0.0, "device": "cpu"}))
    assert jobs.time_of(dataclasses.replace(tf32, seed=1)) == (pytest.approx(30.0), "measured: seed0, with --tf32 there")


def test_a_time_measured_beside_other_runs_is_scaled_to_the_runs_sharing_the_device_now(tmp_path, monkeypatch):
    """A run that shared its device with 3 others took 4 times its time alone; planned 2 to a device, a
    run takes twice that; a run that recorded no sharing counts as it ran, labelled so. --jobs spreads over the GPUs
    (ceil(jobs / GPUs) to each); a CPU is one device."""
    base = dict(task="copy", method="rope", device="cpu", out=str(tmp_path), steps=100, batch_size=8, d_model=32)
    cfg = make_config({**base, "runs_at_once": 4}, "cpu")
    cfg.run_dir().mkdir(parents=True)
    (cfg.run_dir() / "metrics.json").write_text(json.dumps({"config": train.asdict(cfg), "wall_s": 40.0,
                                                            "final_eval_s": 0.0,
                                                            "device": "cpu (2 cores)"}))
    planned = make_config({**base, "seed": 1, "runs_at_once": 2}, "cpu")
    assert jobs.time_of(planned) == (pytest.approx(20.0), "measured: seed0, 4 at once there, 2 here")
    assert jobs.time_of(dataclasses.replace(planned, runs_at_once=4)) == (pytest.approx(40.0), "measured: seed0")
    other = make_config({**base, "seed": 1, "tag": "x", "lr": 3e-4}, "cpu")    # another setup: an estimate
    assert jobs.time_of(other) == (pytest.approx(10.0), "estimate: from rope, 4 at once there, 1 here")
    legacy = make_config({**base, "tag": "old"}, "cpu")                      # a run from before the record
    saved = {k: v for k, v in train.asdict(legacy).items() if k != "runs_at_once"}
    legacy.run_dir().mkdir(parents=True)
    (legacy.run_dir() / "metrics.json").write_text(json.dumps({"config": saved, "wall_s": 30.0, "final_eval_s": 0.0,
                                                               "device": "cpu"}))
    assert jobs.time_of(dataclasses.replace(legacy, seed=1, runs_at_once=3)) == (
        pytest.approx(30.0), "measured: seed0, sharing not recorded there")
    args = cli.build_parser().parse_args(["--jobs", "5"])
    assert jobs.speed(args, "cpu", 9)["runs_at_once"] == 5 and jobs.speed(args, "cpu", 3)["runs_at_once"] == 3
    monkeypatch.setattr(jobs, "visible_gpus", lambda: ["0", "1"])
    assert jobs.speed(args, "cuda", 9)["runs_at_once"] == 3 and jobs.speed(args, "cuda", 2)["runs_at_once"] == 1


def test_the_queue_starts_with_the_longest_runs_and_those_of_unknown_time(capsys, tmp_path, monkeypatch):
    """--reproduce trains its runs longest first by their planned time, those without one first of
    all, whatever their place in the run list (which --shard and --runs number)."""
    tiny = dict(task="copy", steps=2, batch_size=4, d_model=16, n_layers=1, n_heads=2, n_eval=4,
                train_lengths=[1, 2], test_lengths=[2])
    exp = experiments.Experiment(claim="c", runs=[dict(tiny, method=m) for m in ("nope", "rope", "alibi")],
                                 paper={}, scaled="tiny", columns=[("len 2", (2, 2), "exact")], seeds=[0])
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", exp)
    planned = {"nope": (1.0, "measured: seed1"), "rope": (None, ""), "alibi": (5.0, "measured: seed1")}
    monkeypatch.setattr(jobs, "time_of", lambda cfg: planned[cfg.method])
    order = []
    real = cli.run

    def record(cfg, *a, **k):
        order.append(cfg.method)
        return real(cfg, *a, **k)
    monkeypatch.setattr(cli, "run", record)
    code, stdout, _ = run_cli(capsys, "--reproduce", "tiny", "--out", str(tmp_path), "--device", "cpu", "--jobs", "1")
    assert code == 0 and order == ["rope", "alibi", "nope"]
    assert stdout.index("copy/nope/seed0") < stdout.index("copy/rope/seed0") < stdout.index("copy/alibi/seed0")


def test_older_vipe_metrics_name_their_rules_as_newer_ones_do(tmp_path):
    """ViPE metrics written before the rules were named key their rows "per_length" and "one": the
    summary (and so the table) names them as newer runs do, and seeds of either kind combine."""
    import vipe
    rows = fake_rows([1.0, 0.5, 0.0])
    old = {**fake_seed(0, 0.9, [1.0, 0.4, 0.0], []), "eval_ablations": {"per_length": rows, "one": rows}}
    new = {**fake_seed(1, 0.9, [1.0, 0.6, 0.0], []),
           "eval_ablations": {vipe.ablation_label("per_length"): rows, vipe.ablation_label("one"): rows}}
    out = write_seeds(tmp_path / "runs", [old, new])
    summary = json.loads((out / "copy" / "rope" / "metrics.json").read_text())
    assert list(summary["ablations"]) == ["s = L / L_train_max per length, no fine-tuning", "s = 1, no fine-tuning"]
    exp = experiments.Experiment(claim="c", runs=[dict(task="copy", method="rope")], paper={}, scaled="s",
                                 columns=[("len 10", (10, 10), "exact")], seeds=[0, 1])
    assert "| copy/rope | this repo, s = 1, no fine-tuning | 0.500 [0.50-0.50] (0.50-0.50) |" in experiments.experiment_table("x", exp, out)


def test_a_task_of_one_test_length_is_drawn_as_bars_of_token_accuracy(tmp_path, monkeypatch):
    """MQRAR tests one length: its figure has a bar a run at the mean token accuracy, the min-max over
    seeds as the error bar, and the runs' labels under the bars (a line plot would be one point each)."""
    import matplotlib.pyplot as plt
    for label, tok in (("path-N2", [1.0, 0.98]), ("rope-N2", [0.5, 0.7])):
        (tmp_path / label).mkdir()
        point = {"length": 384, "variant": None, "name": "384", "exact": 0.1, "exact_min": 0.0, "exact_max": 0.2,
                 "token": float(np.mean(tok)), "token_min": min(tok), "token_max": max(tok)}
        (tmp_path / label / "metrics.json").write_text(json.dumps(
            {"task": "mqrar", "eval": [point], "label": label, "seeds": [0, 1], "train_max_length": 384}))
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    assert experiments.plot_task(tmp_path) == tmp_path / "extrapolation.png"
    ax = drawn[0].axes[0]
    assert [round(b.get_height(), 6) for b in ax.patches] == [0.99, 0.6]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["path-N2 (2)", "rope-N2 (2)"]
    assert "token accuracy at length 384" in ax.get_ylabel()


def test_runs_kept_gzipped_read_as_they_were(capsys, tmp_path, monkeypatch):
    """docs/perf/compact_results.py gzips each run's metrics.json and train.log in place: the experiment's runs
    then count as present (nothing trains again, no "other setup"), and its table and verdict are the same bytes
    as before; a plain metrics.json written beside a gzipped one (a run made again) is the one read."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "perf"))
    import compact_results
    out = tiny_seeded(tmp_path, monkeypatch)
    monkeypatch.setitem(experiments.EXPERIMENTS, "tiny", dataclasses.replace(
        experiments.EXPERIMENTS["tiny"], checks=[("copy/rope", "copy/nope", 0)]))
    args = ["--reproduce", "tiny", "--out", str(out), "--device", "cpu"]
    assert run_cli(capsys, *args)[0] == 0
    table = (out / "reproduce" / "tiny.md").read_text()
    (out / "copy" / "nope" / "seed0" / "train.log").write_text("a run's log\n" * 100)   # as --jobs writes one
    files, before, after = compact_results.compact(out)
    assert files == 4 + 2 and after < before and not list(out.rglob("metrics.json"))   # 4 runs, 2 summaries
    assert not list(out.rglob("train.log*"))                                             # the log in its metrics
    assert evaluation.read_stored(out / "copy" / "nope" / "seed0" / "train.log") == "a run's log\n" * 100
    with pytest.raises(FileNotFoundError, match="train.log"):                            # a run without a log
        evaluation.read_stored(out / "copy" / "nope" / "seed1" / "train.log")
    code, stdout, _ = run_cli(capsys, *args)
    assert code == 0 and "4 runs; 0 to train" in stdout and "other setup" not in stdout
    assert (out / "reproduce" / "tiny.md").read_text() == table
    assert [m["seed"] for m in experiments.seed_metrics(out / "copy" / "rope")] == [0, 1]
    assert compact_results.compact(out)[0] == 2            # the summaries just written again, plain
    plain = out / "copy" / "rope" / "seed1" / "metrics.json"
    m = json.loads(evaluation.read_stored(plain))
    plain.write_text(json.dumps({**m, "eval": [{**r, "exact": 0.25} for r in m["eval"]]}))
    assert [r["exact"] for r in experiments.seed_metrics(out / "copy" / "rope")[1]["eval"]] == [0.25]
    assert evaluation.glob_stored(out / "copy" / "rope", "seed*/metrics.json") == \
        [out / "copy" / "rope" / "seed0" / "metrics.json", plain]


def test_compaction_moves_a_stored_runs_log_into_its_metrics(tmp_path):
    """compact_results.merge_log: a run stored before, metrics.json.gz beside train.log.gz, becomes one file
    holding both, and the log reads as it did; a study's log with no run's metrics beside it stays a file; a
    run made since (plain metrics.json) does not take an older gzipped log; a summary over seeds takes none."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "perf"))
    import compact_results
    old, study, rerun = tmp_path / "old", tmp_path / "study", tmp_path / "rerun"
    for d in (old, study, rerun):
        d.mkdir()
    run = {"config": {"seed": 0}, "eval": [{"name": "1", "exact": 0.5}]}
    (old / "metrics.json.gz").write_bytes(gzip.compress(json.dumps(run).encode()))
    (old / "train.log.gz").write_bytes(gzip.compress(b"step 1 | loss 2.0\n"))
    (study / "train.log").write_text("a study's log\n")
    (rerun / "metrics.json").write_text(json.dumps(run))
    (rerun / "train.log.gz").write_bytes(gzip.compress(b"an older run's log\n"))
    compact_results.compact(tmp_path)
    assert sorted(p.name for p in old.iterdir()) == ["metrics.json.gz"]
    assert evaluation.read_stored(old / "train.log") == "step 1 | loss 2.0\n"
    assert json.loads(evaluation.read_stored(old / "metrics.json"))["eval"] == run["eval"]
    assert sorted(p.name for p in study.iterdir()) == ["train.log.gz"]
    assert evaluation.read_stored(study / "train.log") == "a study's log\n"
    assert sorted(p.name for p in rerun.iterdir()) == ["metrics.json.gz", "train.log.gz"]
    assert "train_log" not in json.loads(evaluation.read_stored(rerun / "metrics.json"))
    summary = tmp_path / "summary"
    summary.mkdir()
    (summary / "metrics.json").write_text(json.dumps({"seeds": [0, 1], "eval": []}))
    (summary / "train.log").write_text("not a run's\n")
    assert not compact_results.merge_log(summary)
