"""bench.py builds the right callables: each case of each op runs forward and backward at a
tiny size (on the CPU the Triton cases go through the interpreter; the timing itself needs a GPU)."""
import pytest
import torch

import bench


@pytest.mark.parametrize("op", list(bench.OPS))
def test_every_case_runs(op, monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    B, H, T, D = (2, 2, 16, 16) if op != "prism" else (2, 3, 8, 6)
    if op == "upe":
        cases = bench.upe_cases(B, H, T, D, torch.float32, K=4)
    else:
        cases = bench.OPS[op]["cases"](B, H, T, D, torch.float32)
    assert len(cases) >= 2
    for name, fn in cases.items():
        out = fn()
        grads = torch.autograd.grad(out.float().sum(), fn.inputs, allow_unused=True)
        assert torch.isfinite(out).all() and any(g is not None for g in grads), name


def test_path_fox_case_trains_the_gate(monkeypatch):
    """--gate: the PaTH cases take the forget gate g, and g gets a gradient (it changes the output)."""
    monkeypatch.setattr(bench, "DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    cases = bench.path_cases(2, 2, 16, 16, torch.float32, gate=True)
    assert set(cases) == {"SDPA (no PE)", "PaTH-FoX Triton", "PaTH-FoX PyTorch (UT)"}
    fn = cases["PaTH-FoX Triton"]
    g = fn.inputs[-1]
    assert g.shape == (2, 2, 16)
    (grad,) = torch.autograd.grad(fn().float().sum(), [g])
    assert grad.abs().max() > 0


def test_gate_needs_the_path_op(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.main(["--op", "vipe", "--gate"]) == 2 and "--op path only" in capsys.readouterr().err


def test_bench_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # the message a CPU-only machine gets
    assert bench.main([]) == 2 and "no CUDA device" in capsys.readouterr().err


def test_train_throughput_table(tmp_path):
    """--op train's table and figure from real (tiny, CPU) runs of train.train in two modes."""
    modes = {"in the loop": dict(workers=0, graphs=False), "2 workers": dict(workers=2, graphs=False)}
    rows = bench.run_train(3, tmp_path, runs=[("copy", "rope")], modes=modes, device="cpu")
    assert [r["mode"] for r in rows] == list(modes) and all(r["steps_per_s"] > 0 for r in rows)
    table = (tmp_path / "train.md").read_text()
    assert "| copy rope | 64 | in the loop | 0 |" in table and "| 1.00x |" in table and "| add_cot |" in table
    assert (tmp_path / "train.png").stat().st_size > 1000


def test_every_task_makes_a_batch_of_256_quickly():
    """Data generation, a batch of 256 at the longest training length on one core: a bound about 10x
    the slowest task measured on a 2-core CPU machine (mqrar, 4.4 ms; the target is 2 ms), so it
    cannot flake; it catches a generator that falls back to Python loops over tokens. The loop
    hides this time with worker processes (--op train reports the time the loop waits for data)."""
    from tasks import TASKS
    slow = {name: ms for name, task in TASKS.items() if (ms := bench.data_ms(task, repeats=3)) > 45}
    assert not slow, slow


def test_jobs_throughput_table(tmp_path):
    """--op jobs from real (tiny, CPU) train.py commands: one run, then two at once (twice: the
    second with --no-mps); each row sums the runs' own steps/s."""
    tiny = ["--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--batch-size", "4", "--train-lengths", "1-3"]
    rows = bench.run_jobs(5, tmp_path, runs=[("copy", "rope")], counts=(1, 2), extra=tiny, device="cpu")
    assert [(r["n"], len(r["rates"])) for r in rows] == [(1, 1), (2, 2), (2, 2)]
    assert all(r["total"] == pytest.approx(sum(r["rates"])) and min(r["rates"]) > 0 for r in rows)
    table = (tmp_path / "jobs.md").read_text()
    assert "| copy rope | 1 | - |" in table and "| 1.00x | 1.00 |" in table
    assert table.count("| copy rope | 2 | no |") == 2


@pytest.mark.parametrize("args", [["--counts", "4,x"], ["--counts", "4,8"], ["--runs", "a5"]])
def test_jobs_options_are_checked_before_anything_runs(args, capsys):
    """--runs takes task:method pairs; --counts whole numbers that include the one-run baseline."""
    assert bench.main(["--op", "jobs", *args]) == 2
    assert "--" in capsys.readouterr().err
