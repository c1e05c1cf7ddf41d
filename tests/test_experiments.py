"""--reproduce: the headline experiments' runs, skips, tables and figures (CPU, tiny settings)."""
import json

import experiments
from train import main, make_config, validate


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
    assert f"| copy/rope | this repo | {s['eval'][0]['exact']:.3f}" in table
    code, stdout, _ = run_cli(capsys, "--reproduce", "tiny", "--out", str(out), "--device", "cpu")
    assert stdout.count("skip ") == 2


def test_reproduce_sweep_figure(capsys, tmp_path, monkeypatch):
    exp = experiments.Experiment(
        claim="tiny sweep", runs=[dict(task="copy", method=m, tag=f"L{n}", n_layers=n, steps=5, batch_size=8,
                                       d_model=32, n_heads=2, n_eval=8, train_lengths=[1, 2], test_lengths=[2])
                                  for n in (1, 2) for m in ("nope", "rope")],
        columns=[("len 2", (2, 2), "exact")], paper={}, scaled="tiny", sweep=("layers", 0))
    monkeypatch.setitem(experiments.EXPERIMENTS, "sweep", exp)
    out = tmp_path / "runs"
    code, stdout, _ = run_cli(capsys, "--reproduce", "sweep", "--out", str(out), "--device", "cpu")
    assert code == 0 and (out / "reproduce" / "sweep.png").stat().st_size > 1000
    assert "| copy/rope-L2 | this repo |" in (out / "reproduce" / "sweep.md").read_text()


def test_reproduce_all_writes_one_table(capsys, tmp_path, monkeypatch):
    tiny = dict(task="copy", steps=3, batch_size=8, d_model=32, n_layers=1, n_heads=2, n_eval=8,
                train_lengths=[1, 2], test_lengths=[2])
    exps = {name: experiments.Experiment(claim=f"claim {name}", runs=[dict(tiny, method=m)], paper={}, scaled="tiny",
                                   columns=[("len 2", (2, 2), "exact")]) for name, m in (("one", "nope"), ("two", "rope"))}
    monkeypatch.setattr(experiments, "EXPERIMENTS", exps)
    out = tmp_path / "runs"
    code, stdout, _ = run_cli(capsys, "--reproduce", "all", "--out", str(out), "--device", "cpu")
    assert code == 0
    text = (out / "reproduce" / "all.md").read_text()
    assert text.index("### one") < text.index("### two")
    assert "| copy/nope | this repo |" in text and "| copy/rope | this repo |" in text


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
    for jobs, out in (("1", tmp_path / "seq"), ("2", tmp_path / "par")):
        code, stdout, _ = run_cli(capsys, *tiny, "--jobs", jobs, "--out", str(out))
        assert code == 0
    assert "2 runs, 2 at a time" in stdout and stdout.count("done ") == 2
    for m in ("nope", "rope"):
        a = torch.load(tmp_path / "seq" / "copy" / m / "seed0" / "model.pt")
        b = torch.load(tmp_path / "par" / "copy" / m / "seed0" / "model.pt")
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert "steps/s" in (tmp_path / "par" / "copy" / m / "seed0" / "train.log").read_text()
