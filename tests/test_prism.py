"""PRISM's histogram filter: the vectorised step and scan against Algorithm 1 bin by bin (outputs
and gradients), and the behaviours the update rule promises.

Tolerances: float64 agrees to rounding (1e-10); float32 to 1e-5 (a few hundred products and one
power per step)."""
import pytest
import torch

import prism
from prism import histogram_scan, histogram_scan_naive, histogram_step, histogram_step_naive, reachable_bins


def gates(B, N, T, dtype=torch.float64, seed=0, copy_P=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    p_reset = r(B, N, T) * 0.5
    move = torch.softmax(3 * torch.randn(B, N, T, 3, generator=gen, dtype=torch.float64), -1).to(dtype)
    gamma = (1 + r(B, N) * 2).requires_grad_(True)
    xs = [p_reset, *move.unbind(-1)]
    copy = None
    if copy_P is not None:
        copy = torch.softmax(2 * torch.randn(B, N, T, copy_P + 1, generator=gen, dtype=torch.float64), -1).to(dtype)
        copy = copy.requires_grad_(True)
    return [x.detach().requires_grad_(True) for x in xs] + [gamma], copy


def test_step_example_by_hand():
    """P = 3, all mass at bin 1: keep 0.5, inc 0.3, dec 0.2, reset 0.1, gamma = 1 (no sharpening)."""
    h = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    one = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    got = histogram_step_naive(h, one(0.1), one(0.3), one(0.2), one(0.5), one(1.0), eps=0.0)
    # reset: bin 1 += 0.1 * 0.3, bin 0 += 0.1 * 0.7; moves: 0.9 * (0.2 to bin 0, 0.5 stays, 0.3 to bin 2)
    want = torch.tensor([0.07 + 0.18, 0.03 + 0.45, 0.27], dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-12)
    assert torch.allclose(histogram_step(h, one(0.1), one(0.3), one(0.2), one(0.5), one(1.0), eps=0.0), want)


@pytest.mark.parametrize("P", [2, 3, 8])
@pytest.mark.parametrize("copy", [False, True])
def test_step_matches_naive(P, copy):
    (p_reset, p_inc, p_dec, p_keep, gamma), p_copy = gates(2, 3, 1, copy_P=P if copy else None)
    h = torch.softmax(torch.randn(2, 3, P, dtype=torch.float64), -1).requires_grad_(True)
    args = (h, p_reset[..., 0], p_inc[..., 0], p_dec[..., 0], p_keep[..., 0], gamma,
            None if p_copy is None else p_copy[:, :, 0])
    a, b = histogram_step_naive(*args), histogram_step(*args)
    assert torch.allclose(a, b, atol=1e-12)
    assert torch.allclose(a.sum(-1), torch.ones(2, 3, dtype=torch.float64))
    leaves = [x for x in (h, p_reset, p_inc, p_dec, p_keep, gamma, p_copy) if x is not None]
    up = torch.randn_like(a)
    for ga, gb in zip(torch.autograd.grad(a, leaves, up), torch.autograd.grad(b, leaves, up)):
        assert torch.allclose(ga, gb, atol=1e-10)


def test_step_gradcheck():
    (p_reset, p_inc, p_dec, p_keep, gamma), p_copy = gates(1, 2, 1, copy_P=4)
    h = torch.softmax(torch.randn(1, 2, 4, dtype=torch.float64), -1).requires_grad_(True)
    f = lambda h, r, i, d, k, g, c: histogram_step_naive(h, r, i, d, k, g, c)  # noqa: E731
    assert torch.autograd.gradcheck(f, (h, p_reset[..., 0], p_inc[..., 0], p_dec[..., 0], p_keep[..., 0], gamma,
                                        p_copy[:, :, 0]), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("T,P", [(1, 4), (7, 8), (30, 16)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("copy", [False, True])
def test_scan_matches_naive(T, P, dtype, tol, copy):
    xs, p_copy = gates(2, 3, T, dtype=dtype, seed=T, copy_P=P if copy else None)
    leaves = xs + ([p_copy] if copy else [])
    a = histogram_scan_naive(*xs, P, p_copy)
    b = histogram_scan(*xs, P, p_copy)
    assert a.shape == (2, 3, T, P)
    assert (a - b).abs().max() <= tol, (a - b).abs().max()
    assert torch.allclose(b.sum(-1), torch.ones_like(b[..., 0]), atol=tol)
    up = torch.randn_like(a)
    for name, ga, gb in zip(["reset", "inc", "dec", "keep", "gamma", "copy"], torch.autograd.grad(a, leaves, up),
                            torch.autograd.grad(b, leaves, up)):
        diff = (ga - gb).abs()
        assert diff.max() <= tol * max(1.0, ga.abs().max().item()), f"{name}: max {diff.max():.2e} mean {diff.mean():.2e}"


GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


@pytest.mark.parametrize("B,N,T,P", [(2, 3, 1, 2), (2, 3, 9, 5), (1, 2, 40, 16), (1, 1, 20, 33)])
@pytest.mark.parametrize("copy", [False, True])
def test_triton_scan_matches_naive(B, N, T, P, copy):
    """Through the interpreter on CPU (compiled on a GPU): float32 kernel vs the float64 reference,
    output and the gradients of all four gates, gamma and the copy distribution; float32 rounding
    ~1e-6 seen, 1e-4 allowed."""
    from kernels.prism_scan import histogram_scan_triton
    xs, p_copy = gates(B, N, T, seed=T + P, copy_P=P if copy else None)
    leaves = xs + ([p_copy] if copy else [])
    x32 = [x.detach().float().to(DEV).requires_grad_(True) for x in leaves]
    a = histogram_scan_triton(*x32[:5], P, x32[5] if copy else None)
    b = histogram_scan_naive(*xs, P, p_copy)
    assert (a.double().cpu() - b).abs().max() < 1e-5
    up = torch.randn_like(b)
    for name, ga, gb in zip(["reset", "inc", "dec", "keep", "gamma", "copy"],
                            torch.autograd.grad(a, x32, up.float().to(DEV)), torch.autograd.grad(b, leaves, up)):
        diff = (ga.double().cpu() - gb).abs()
        bound = 1e-4 * max(1.0, gb.abs().max().item())
        assert diff.max() <= bound, f"{name}: max {diff.max():.2e} mean {diff.mean():.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_triton_scan_gpu_large():
    from kernels.prism_scan import histogram_scan_triton
    xs, _ = gates(4, 8, 300, seed=1)
    x32 = [x.detach().float().cuda().requires_grad_(True) for x in xs]
    a = histogram_scan_triton(*x32, 256)
    b = prism._scan(histogram_step, *[x.detach().float().cuda() for x in xs], 256)   # the vectorised step
    assert (a - b).abs().max() < 1e-4
    a.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in x32)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_triton_scan_gpu_large_with_copy():
    """The copy branch at a training size: the kernel against the vectorised step, and its gradients."""
    from kernels.prism_scan import histogram_scan_triton
    xs, p_copy = gates(4, 8, 300, seed=2, copy_P=256)
    x32 = [x.detach().float().cuda().requires_grad_(True) for x in xs + [p_copy]]
    a = histogram_scan_triton(*x32[:5], 256, x32[5])
    b = prism._scan(histogram_step, *[x.detach().float().cuda() for x in xs], 256, p_copy.detach().float().cuda())
    assert (a - b).abs().max() < 1e-4
    a.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in x32)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("P", [128, 600])
def test_triton_scan_gives_the_same_at_any_warps(P, monkeypatch):
    """The warps a program runs with split each row's sums differently and nothing else: outputs and
    gradients at 1, 2, 4 and 8 warps agree to float32 rounding (P = 600: a block of 1024 bins, 4 warps
    by default)."""
    from kernels import prism_scan
    xs, p_copy = gates(3, 5, 120, seed=P, copy_P=P)
    leaves = [x.detach().float().cuda() for x in xs + [p_copy]]
    out = {}
    for w in (1, 2, 4, 8):
        monkeypatch.setattr(prism_scan, "WARPS", w)
        x32 = [x.clone().requires_grad_(True) for x in leaves]
        h = prism_scan.histogram_scan_triton(*x32[:5], P, x32[5])
        out[w] = [h] + list(torch.autograd.grad(h, x32, torch.linspace(-1, 1, h.numel(), device="cuda").view_as(h)))
    for w in (2, 4, 8):
        for a, b in zip(out[1], out[w]):
            assert (a - b).abs().max() <= 1e-5 * max(1.0, a.abs().max().item())


def test_the_copy_branch_takes_the_triton_scan_on_cuda(monkeypatch):
    """The dispatcher sends the copy branch to the kernel (forced here; on CUDA by default) with the
    same result as the PyTorch loop."""
    xs, copy = gates(1, 2, 6, dtype=torch.float32, copy_P=4)
    monkeypatch.setattr(prism, "BACKEND", "torch")
    want = histogram_scan(*xs, 4, copy)
    monkeypatch.setattr(prism, "BACKEND", "triton")
    got = histogram_scan(*xs, 4, copy)
    assert (got - want).abs().max() < 1e-5
    asked = []
    monkeypatch.setattr(prism, "BACKEND", None)
    monkeypatch.setattr(prism, "pick_backend", lambda *a, **k: asked.append(a) or "torch")
    histogram_scan(*xs, 4, copy)
    assert asked[0][3] is True                       # has_kernel: CUDA would take the kernel


def test_counting_tokens_gives_absolute_position():
    """p_reset = 0, p_inc = 1, gamma = 1: the mode moves one bin per token."""
    B, N, T, P = 1, 2, 10, 16
    z, one = torch.zeros(B, N, T), torch.ones(B, N, T)
    hist = histogram_scan(z, one, z, z, torch.ones(B, N), P)
    assert hist.argmax(-1).tolist() == [[list(range(1, T + 1))] * N]


def test_reset_and_keep_stays_at_zero():
    B, N, T, P = 1, 1, 6, 8
    z, one = torch.zeros(B, N, T), torch.ones(B, N, T)
    hist = histogram_scan(one, z, z, one, torch.full((B, N), 2.0), P)
    assert (hist.argmax(-1) == 0).all() and (hist[..., 0] > 0.999).all()


def test_counting_clamps_at_the_last_bin():
    z, one = torch.zeros(1, 1, 12), torch.ones(1, 1, 12)
    hist = histogram_scan(z, one, z, z, torch.ones(1, 1), 5)
    assert hist.argmax(-1)[0, 0].tolist() == [1, 2, 3, 4] + [4] * 8


def test_copy_one_hot_jumps_to_that_bin():
    B, N, T, P = 1, 1, 3, 8
    z, one = torch.zeros(B, N, T), torch.ones(B, N, T)
    copy = torch.zeros(B, N, T, P + 1)
    copy[..., P] = 1                                                   # no copy ...
    copy[0, 0, 1] = 0
    copy[0, 0, 1, 5] = 1                                               # ... except at token 1: jump to bin 5
    hist = histogram_scan(z, one, z, z, torch.ones(B, N), P, copy)
    assert hist.argmax(-1)[0, 0].tolist() == [1, 5, 6]


def test_sharpening_concentrates_mass():
    h = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    z, one = torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    soft = histogram_step(h, z, z, z, one, one, eps=0.0)
    sharp = histogram_step(h, z, z, z, one, torch.tensor(2.0, dtype=torch.float64), eps=0.0)
    assert torch.allclose(soft, h) and sharp[1] > soft[1] and torch.allclose(sharp.sum(), one)


def test_one_bin_is_an_error():
    with pytest.raises(ValueError, match="at least 2 bins"):
        histogram_step(torch.ones(1), *(torch.tensor(0.5),) * 5)


def test_naive_backend_switch(monkeypatch):
    xs, _ = gates(1, 1, 4)
    monkeypatch.setattr(prism, "BACKEND", "naive")
    assert torch.allclose(histogram_scan(*xs, 5), histogram_scan_naive(*xs, 5))


# ---- superposition, scores and the layer ------------------------------------------------------------

import math  # noqa: E402

from prism import (PRISM, PrismAttention, PrismHooks, alpha_group, cursor_scores,  # noqa: E402
                   mix_cursors, normalise, position_scores, sides_first, sinusoid_table, superpose)
from model import Model, ModelConfig  # noqa: E402


def test_superposition_of_a_one_hot_histogram_is_the_table_row():
    table = sinusoid_table(16, 8)
    hist = torch.zeros(2, 16)
    hist[0, 3], hist[1, 7] = 1, 1
    assert torch.allclose(superpose(hist, table), table[[3, 7]])
    mix = 0.25 * table[3] + 0.75 * table[7]                              # and is linear in the histogram
    assert torch.allclose(superpose(0.25 * hist[0] + 0.75 * hist[1], table), mix, atol=1e-6)


def test_normalise_scales_each_head_position_to_sqrt_d():
    g = torch.randn(2, 3 * 4, 5, 8)                                      # H = 3 heads, O = 4 cursors
    n = normalise(g, 3)
    assert n.shape == (2, 3, 4, 5, 8)
    assert torch.allclose(n.pow(2).sum((2, 4)), torch.full((2, 3, 5), 8.0), atol=1e-4)


def test_position_scores_by_hand():
    gq, gk, alpha = torch.randn(1, 2, 3, 4, 5), torch.randn(1, 2, 3, 4, 5), torch.randn(2, 3)
    want = torch.zeros(1, 2, 4, 4)
    for h in range(2):
        for c in range(3):
            want[0, h] += alpha[h, c].abs() * gq[0, h, c] @ gk[0, h, c].T
    assert torch.allclose(position_scores(gq, gk, alpha), want / math.sqrt(15), atol=1e-5)


def reference_scores(hist, table, H, alpha):
    """Algorithms 2-4 as written: superpose, normalise the query and the key side, score. hist (2, B, H O, T, P)."""
    g = superpose(hist, table)
    return position_scores(normalise(g[0], H), normalise(g[1], H), alpha)


def test_scores_through_the_gram_matrix_are_algorithms_2_to_4():
    """The model's path (each cursor's scores from the histograms through F F^T, once, then each
    block's |alpha|) against Algorithms 2-4 as written: values and gradients, float32 rounding; an
    odd width d and nearly one-hot histograms (sharpened ones) included."""
    torch.manual_seed(0)
    H, O, T, P, d = 3, 4, 9, 16, 7
    table = sinusoid_table(P, d)
    hist = (4 * torch.randn(2, 2, H * O, T, P)).softmax(-1).requires_grad_()   # (sides, B, H O, T, P)
    alphas = [torch.randn(H, O, requires_grad=True) for _ in range(2)]          # two blocks
    scores = cursor_scores(hist, table @ table.T, H, d)
    fast = [mix_cursors(scores, a) for a in alphas]
    ref = [reference_scores(hist, table, H, a) for a in alphas]
    for f, r in zip(fast, ref):
        assert f.shape == (2, H, T, T) and torch.allclose(f, r, atol=1e-5)
    w = torch.randn(2, H, T, T)
    grads = [torch.autograd.grad(sum((x * w).sum() for x in out), [hist, *alphas]) for out in (fast, ref)]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4)


def test_scores_kept_in_float16_are_the_float32_scores_rounded_and_mix_in_float32(monkeypatch):
    """prism.SCORES_DTYPE (a speed measurement's switch): the scores come out in it, rounded from the float32
    ones; a block's mix of them is float32, and the histograms' gradient flows through them."""
    torch.manual_seed(0)
    H, O, T, P, d = 2, 4, 9, 16, 7
    table = sinusoid_table(P, d)
    hist = (4 * torch.randn(2, 2, H * O, T, P)).softmax(-1).requires_grad_()
    alpha = torch.randn(H, O)
    full = cursor_scores(hist, table @ table.T, H, d)
    monkeypatch.setattr(prism, "SCORES_DTYPE", torch.float16)
    half = cursor_scores(hist, table @ table.T, H, d)
    assert half.dtype == torch.float16 and torch.equal(half, full.half()) and not torch.equal(half.float(), full)
    mixed = mix_cursors(half, alpha)
    assert mixed.dtype == torch.float32 and torch.allclose(mixed, mix_cursors(full, alpha), atol=5e-3)
    (grad,) = torch.autograd.grad(mixed.sum(), hist)
    (want,) = torch.autograd.grad(mix_cursors(full, alpha).sum(), hist)
    assert torch.allclose(grad, want, rtol=1e-2, atol=1e-3 * want.abs().max())


INTERPRETER_ONLY = pytest.mark.skipif(GPU, reason="float32 through the interpreter; on a GPU the kernels compute in "
                                      "TF32, compared by test_scores_through_the_gram_matrix_on_cuda_at_the_papers_size")


@INTERPRETER_ONLY
@pytest.mark.parametrize("T, P", [(70, 24), (9, 128)])
def test_triton_cursor_scores_match_the_pytorch_path(monkeypatch, T, P):
    """kernels/prism_scores.py (through the interpreter on CPU) against the PyTorch path of cursor_scores: the
    scores and the gradient of the histograms, for T over two token blocks and P not a power of 2, and for
    a short T at the most bins the kernel takes. Beyond those bins cursor_scores takes the PyTorch path."""
    from kernels import prism_scores
    torch.manual_seed(0)
    H, O, d = 2, 2, 8
    table = sinusoid_table(P, d)
    hist = (3 * torch.randn(2, 2, H * O, T, P)).softmax(-1).requires_grad_()
    w = torch.randn(2, H, O, T, T)
    got = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(prism, "SCORES_BACKEND", backend)
        scores = cursor_scores(hist, table @ table.T, H, d)
        got[backend] = (scores.detach(), torch.autograd.grad((scores * w).sum(), hist)[0])
    for a, b in zip(got["triton"], got["torch"]):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5
    assert prism.SCORES_KERNEL_BINS == prism_scores.MAX_BINS
    monkeypatch.setattr(prism_scores, "cursor_dots_triton", None)            # not called past its bins
    wide = (3 * torch.randn(2, 1, H * O, 3, 130)).softmax(-1)
    table = sinusoid_table(130, d)
    assert cursor_scores(wide, table @ table.T, H, d).shape == (1, H, O, 3, 3)


@INTERPRETER_ONLY
@pytest.mark.parametrize("copy", [False, True])
def test_a_model_with_the_triton_cursor_scores_trains_as_with_the_pytorch_path(monkeypatch, copy):
    """The whole PRISM model (two position streams, reachable bins of a wider histogram, with and without the
    copy branch): its loss and every parameter's gradient are those of the PyTorch path, with the cursor scores
    from kernels/prism_scores.py through the interpreter."""
    from kernels import prism_scores
    calls, real = [], prism_scores.cursor_dots_triton
    monkeypatch.setattr(prism_scores, "cursor_dots_triton", lambda *a: calls.append(1) or real(*a))
    cfg = prism_cfg(prism_bins=64, prism_blocks=[0, 1], prism_copy=copy)
    x = torch.randint(0, 10, (2, 21))
    got = {}
    for path in ("torch", "triton"):
        monkeypatch.setattr(prism, "SCORES_BACKEND", path)
        torch.manual_seed(0)
        model = Model(cfg, PRISM)
        loss = model(x).float().logsumexp(-1).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        got[path] = [loss.detach()] + [g for g in grads if g is not None]
    assert len(got["torch"]) == len(got["triton"]) > 10 and len(calls) == 2             # a call per stream
    for a, b in zip(got["triton"], got["torch"]):
        assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(b.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("path, tf32, tol", [("torch", False, 1e-4), ("torch", True, 5e-3), ("triton", True, 5e-3)])
def test_scores_through_the_gram_matrix_on_cuda_at_the_papers_size(monkeypatch, path, tf32, tol):
    """The same comparison on the GPU at the paper's size (35 heads x 4 cursors, width 340, 128 reachable
    bins of 256, length 64), where the float32 matrix products run in cuBLAS's own order: relative to the
    largest value, within 1e-4 (about 2e-6 measured on an H200). With TF32 products (--tf32; the Triton
    kernels' only precision on a GPU) within 5e-3: TF32 keeps 10 of float32's 23 mantissa bits (its rounding
    emulated on the CPU at this size: at most 9e-4 of the largest value, scores and both gradients)."""
    from kernels import prism_scores
    calls, real = [], prism_scores.cursor_dots_triton
    monkeypatch.setattr(prism_scores, "cursor_dots_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(prism, "SCORES_BACKEND", path)
    torch.manual_seed(0)
    H, O, T, P, d = 35, 4, 64, 128, 340
    table = sinusoid_table(256, d, device="cuda")[:P]
    hist = (4 * torch.randn(2, 4, H * O, T, P, device="cuda")).softmax(-1).requires_grad_()
    alpha = (torch.rand(H, O, device="cuda") + 0.5).requires_grad_()
    ref = reference_scores(hist, table, H, alpha)                        # float32 products
    w = torch.randn_like(ref)
    want = torch.autograd.grad((ref * w).sum(), [hist, alpha])
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", tf32)
    fast = mix_cursors(cursor_scores(hist, table @ table.T, H, d), alpha)
    got = torch.autograd.grad((fast * w).sum(), [hist, alpha])
    for a, b in [(fast, ref), *zip(got, want)]:
        assert float((a - b).abs().max() / b.abs().max()) < tol
    assert len(calls) == (path == "triton")


@pytest.mark.parametrize("copy", [False, True])
def test_the_scores_from_the_reachable_bins_equal_those_from_all_bins(copy):
    """The hooks scan only the bins a cursor can reach in T tokens (T + 1, rounded up to 8), the copy
    branch included: the scores equal Algorithms 2-4 on the scan over all P = 128 bins, float32 rounding."""
    torch.manual_seed(0)
    hooks = PrismHooks(prism_cfg(prism_bins=128, prism_copy=copy))
    h, ctx = torch.randn(2, 20, 32), {}
    hooks.before_block(0, h, ctx)
    assert ctx["prism_hist"].shape[-1] == 24                      # 21 reachable bins, rounded up to 8
    gamma = 1 + torch.nn.functional.softplus(hooks.gamma_raw[0])[None]
    p_copy = hooks.copy_probs(0, h, 128) if copy else None                    # (2 B, H O, T, 129)
    gates = [sides_first(x) for x in (*ctx["prism_gates"], gamma.expand(2, -1))]
    full = histogram_scan(*gates, 128, p_copy).view(2, 2, 8, 20, 128)          # (sides, B, H O, T, 128)
    assert float(full[..., 24:].sum(-1).max().detach()) < 1e-8    # the eps mass alone, ~eps^gamma a bin
    alpha = torch.rand(2, 4) + 0.5
    want = reference_scores(full, sinusoid_table(128, 8), 2, alpha)
    assert torch.allclose(mix_cursors(ctx["prism_scores"], alpha), want, atol=1e-4)


def test_reachable_bins_count_every_bin_a_cursor_can_reach():
    """T tokens reach bins 0..T (T + 1 of them), rounded up to 8 and at most the bins there are: a batch padded
    to 96 tokens takes 104 bins, not 128."""
    assert [reachable_bins(256, T) for T in (7, 8, 20, 95, 96, 127)] == [8, 16, 24, 96, 104, 128]
    assert reachable_bins(100, 127) == 100 and reachable_bins(1280, 1000) == 1008


def prism_cfg(causal=True, **opts):
    return ModelConfig(vocab_size=10, d_model=32, n_layers=2, n_heads=2, causal=causal, method="prism",
                       opts={"prism_bins": 32, "prism_dim": 8, **opts})


def test_hooks_write_position_streams_before_the_chosen_blocks():
    torch.manual_seed(0)
    hooks = PrismHooks(prism_cfg(prism_blocks=[1]))
    h, ctx = torch.randn(2, 7, 32), {}
    hooks.before_block(0, h, ctx)
    assert "prism_scores" not in ctx
    hooks.before_block(1, h, ctx)
    assert ctx["prism_scores"].shape == (2, 2, 4, 7, 7)                     # (B, H, O, T, T)
    assert torch.allclose(ctx["prism_hist"].sum(-1), torch.ones(2, 2, 8, 7), atol=1e-5)   # (sides, B, H O, T)
    assert torch.allclose(1 + torch.nn.functional.softplus(hooks.gamma_raw), torch.full_like(hooks.gamma_raw, 2.0))


def test_position_path_stays_float32_under_bf16_autocast():
    """Neighbouring bins' scores differ by less than bfloat16 resolves: under autocast the
    superposition and the position scores still run in float32 (the gates may be bf16)."""
    torch.manual_seed(0)
    cfg = prism_cfg()
    layer, hooks = PrismAttention(cfg), PrismHooks(cfg)
    with torch.no_grad():
        layer.mu_logit.fill_(-50.0)                                      # mu = 0: position scores only
    x, ctx = torch.randn(2, 9, 32), {}
    q, k, _ = layer.qkv(x).view(2, 9, 3, 2, 16).permute(2, 0, 3, 1, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hooks.before_block(0, x, ctx)
        got = layer.weights(q, k, ctx)
    assert ctx["prism_scores"].dtype == torch.float32 and got.dtype == torch.float32
    want = reference_scores(ctx["prism_hist"].float(), sinusoid_table(16, 8), 2, layer.alpha)  # float32, 16 bins
    assert torch.allclose(mix_cursors(ctx["prism_scores"], layer.alpha), want, atol=1e-5)
    assert torch.allclose(got, layer.weights(q, k, ctx), atol=1e-6)


def test_mu_one_is_plain_attention():
    torch.manual_seed(0)
    cfg = prism_cfg()
    layer, hooks = PrismAttention(cfg), PrismHooks(cfg)
    with torch.no_grad():
        layer.mu_logit.fill_(50.0)                                       # mu = 1: content scores only
    x, ctx = torch.randn(2, 6, 32), {}
    hooks.before_block(0, x, ctx)
    q, k, v = layer.qkv(x).view(2, 6, 3, 2, 16).permute(2, 0, 3, 1, 4)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(layer(x, ctx), layer.out(o.transpose(1, 2).reshape(2, 6, 32)), atol=1e-5)


def test_alpha_starts_at_eight_unless_asked():
    assert torch.equal(PrismAttention(prism_cfg()).alpha, torch.full((2, 4), 8.0))
    assert torch.equal(PrismAttention(prism_cfg(prism_alpha=2)).alpha, torch.full((2, 4), 2.0))


def test_alpha_gets_its_own_optimiser_group():
    model = Model(prism_cfg(), PRISM)
    (group,) = alpha_group(model, 1e-3)
    assert group["lr"] == 0.03 and group["betas"] == (0.8, 0.92) and len(group["params"]) == 2   # one per layer


def test_orthogonal_map_is_the_matrix_exponential():
    """OrthogonalExp's fixed-degree exponential against torch.matrix_exp, for a parameter far from
    its zero start (|S| about 20); tolerance: float32 rounding over 14 products."""
    from prism import OrthogonalExp
    torch.manual_seed(0)
    p = OrthogonalExp(30)
    p.right_inverse(torch.randn(30, 10))
    X = 0.3 * torch.randn(30, 10)
    Y = torch.cat([X.tril(), torch.zeros(30, 20)], 1)
    want = p.base @ torch.matrix_exp(Y - Y.T)[:, :10]
    assert torch.allclose(p(X), want, atol=2e-5), (p(X) - want).abs().max()
    assert torch.allclose(p(X).T @ p(X), torch.eye(10), atol=2e-5)


def test_gates_follow_their_weights():
    """Each call runs the GRU on W_hh as its parametrisation gives it then."""
    gates = PrismHooks(prism_cfg()).gates[0]
    h = torch.randn(2, 5, 32)
    first = gates(h)[0]
    with torch.no_grad():
        gates.parametrizations.w_hh.original.add_(0.1)
    assert not torch.allclose(gates(h)[0], first)


def test_fixed_gru_input_ablation_trains_everything_else():
    """prism_fixed_gru_input: an AdamW step leaves the GRU's input weights and biases as they were
    and moves its hidden matrix and the gate head; without the option all of them move."""
    for fixed in (True, False):
        torch.manual_seed(0)
        gates = PrismHooks(prism_cfg(prism_fixed_gru_input=fixed)).gates[0]
        before = {k: v.detach().clone() for k, v in gates.state_dict().items()}
        opt = torch.optim.AdamW([p for p in gates.parameters() if p.requires_grad], lr=1e-2)
        sum(x.square().sum() for x in gates(torch.randn(2, 5, 32))).backward()
        opt.step()
        moved = {k for k, v in gates.state_dict().items() if not torch.equal(v, before[k])}
        frozen = {"w_ih", "b_ih", "b_hh"}
        assert {"parametrizations.w_hh.original", "head.weight"} <= moved
        assert (moved & frozen) == (set() if fixed else frozen), moved


def test_frobenius_scaled_whh_ablation():
    """prism_whh_scale=g: W_hh's Frobenius norm is g sqrt(100) whatever V is; an AdamW step moves g
    and V; a negative scale is refused."""
    torch.manual_seed(0)
    gates = PrismHooks(prism_cfg(prism_whh_scale=0.3)).gates[0]
    assert gates.w_hh.norm().item() == pytest.approx(3.0, rel=1e-5)
    par = gates.parametrizations.w_hh
    g0, v0 = par[0].g.item(), par.original.detach().clone()
    opt = torch.optim.AdamW(gates.parameters(), lr=1e-2)
    sum(x.square().sum() for x in gates(torch.randn(2, 5, 32))).backward()
    opt.step()
    assert par[0].g.item() != g0 and not torch.equal(par.original, v0)
    assert gates.w_hh.norm().item() == pytest.approx(10 * par[0].g.item(), rel=1e-5)
    with pytest.raises(ValueError, match="prism_whh_scale"):
        PrismHooks(prism_cfg(prism_whh_scale=-1))


def test_count_bias_starts_cursors_counting():
    """prism_count_bias=3: at initialisation every cursor resets rarely and mostly increments; with the
    default random biases they reset about half the time."""
    h = torch.randn(2, 7, 32)
    for b, check in ((3.0, lambda r, inc: r.max() < 0.2 and inc.min() > 0.7),
                     (0.0, lambda r, inc: 0.3 < r.mean() < 0.7 and inc.mean() < 0.5)):
        torch.manual_seed(0)
        p_reset, p_inc, _, _ = PrismHooks(prism_cfg(prism_count_bias=b)).gates[0](h)
        assert check(p_reset, p_inc), (b, p_reset.mean().item(), p_inc.mean().item())
    with pytest.raises(ValueError, match="prism_count_bias"):
        PrismHooks(prism_cfg(prism_count_bias=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gates_leave_their_parameters_in_place_on_cuda():
    """A call must not move the parameters to new memory (the nn.GRU module does, into a cuDNN
    buffer, on every call with a parametrised weight): a CUDA graph keeps the addresses of its
    capture."""
    gates = PrismHooks(prism_cfg()).gates[0].cuda()
    where = [p.data_ptr() for p in gates.parameters()]
    gates(torch.randn(2, 5, 32, device="cuda"))[0].sum().backward()
    assert [p.data_ptr() for p in gates.parameters()] == where


def test_gru_hidden_matrix_is_orthogonal():
    hooks = PrismHooks(prism_cfg())
    w = hooks.gates[0].w_hh                                  # (3 * 100, 100): orthonormal columns
    assert torch.allclose(w.T @ w, torch.eye(100), atol=1e-4)


def test_attention_without_hooks_is_an_error():
    with pytest.raises(RuntimeError, match="needs ctx"):
        PrismAttention(prism_cfg())(torch.randn(1, 3, 32), {})


def test_plot_cli(tmp_path, capsys):
    from cli import main as train_main

    import prism as prism_module
    assert train_main(["--task", "copy", "--method", "prism", "--steps", "3", "--n-eval", "2", "--test-lengths", "2",
                       "--out", str(tmp_path), "--device", "cpu"]) == 0
    assert prism_module.main(["--plot", str(tmp_path / "copy" / "prism"), "--length", "6"]) == 0
    assert (tmp_path / "copy" / "prism" / "prism_plots.png").stat().st_size > 10_000
    assert prism_module.main(["--plot", str(tmp_path / "nothing")]) == 2
    assert "no trained model" in capsys.readouterr().err


def test_copy_branch_in_the_model():
    """prism_copy: the key copy cursors count tokens exactly; when the copy head puts all its weight
    on token 2 at every step, the paired query cursor sits at that token's bin (3)."""
    torch.manual_seed(0)
    hooks = PrismHooks(prism_cfg(prism_copy=True))
    h, ctx = torch.randn(1, 8, 32), {}
    hooks.before_block(0, h, ctx)
    modes = ctx["prism_hist"][1, 0].argmax(-1)                           # the key cursors: (H O, T)
    assert modes[0].tolist() == list(range(1, 9)) and modes[4].tolist() == list(range(1, 9))
    head = hooks.copy_heads[0]
    with torch.no_grad():
        head.qk.weight.zero_()
        head.null.weight.zero_()
        head.null.bias.fill_(-1e4)                                       # always copy ...
    original = head.forward

    def onto_token_2(h, P):                                              # ... from token 2 only
        p = original(h, P)
        p.zero_()
        p[..., 3] = 1
        return p

    head.forward = onto_token_2
    ctx = {}
    hooks.before_block(0, h, ctx)
    assert ctx["prism_hist"][0, 0, 0].argmax(-1).tolist() == [3] * 8     # query cursor 0 of head 0


def test_fewer_bins_than_positions_is_refused(capsys, tmp_path):
    """The paper uses as many bins as positions; a task whose sequences are longer than prism_bins
    is a one-line error before training (mul_cot's test sequences have over 1,100 tokens)."""
    from cli import main as train_main
    code = train_main(["--task", "mul_cot", "--method", "prism", "--device", "cpu", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "need at least as many bins (prism_bins = 256)" in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())
