"""kernels/bench.py builds the right callables: each case of each op runs forward and backward at a
tiny size (on the CPU the Triton cases go through the interpreter; the timing itself needs a GPU)."""
import pytest
import torch

import kernels.bench as bench


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


def test_bench_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # the message a CPU-only machine gets
    assert bench.main([]) == 2 and "no CUDA device" in capsys.readouterr().err
