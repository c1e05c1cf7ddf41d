"""PaTH attention: the naive reference against explicit matrix products, the blockwise UT path and
the Triton kernel against the naive reference (forward and every gradient), decoding, and the
reductions to softmax attention and to FoX.

Tolerances: float64 paths agree to rounding (1e-9). float32 kernels are compared with the float64
reference; their error is float32 rounding summed over the blocks a query crosses (~1e-6 seen,
1e-4 allowed). fp16 inputs are rounded to 11 bits before the reference sees them, and the kernel
rounds the carried keys and probabilities to fp16 for the tensor-core products: errors ~3e-3 seen,
2e-2 allowed (relative to the largest reference value, at least 1). bf16 (GPU only) has 8 bits:
6e-2 allowed."""
import math

import pytest
import torch
import torch.nn.functional as F

import path_attention as pa
from path_attention import (FoxAttention, PathAttention, path_attention, path_attention_carry, path_attention_naive,
                            path_attention_torch, path_attention_triton, path_decode_step)
from model import ModelConfig

triton = pytest.importorskip("triton")
tl = triton.language
from kernels.path_attention import _carry, _row_scale  # noqa: E402  (needs triton)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"  # where the Triton kernel runs (compiled, or the interpreter on CPU)
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
NAMES = ["q", "k", "v", "w", "beta", "g"]


def make_inputs(B, H, T, D, gate=True, dtype=torch.float64, device="cpu", seed=0, beta_scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, B, H, T, D, generator=gen, dtype=torch.float64)
    w = F.normalize(torch.randn(B, H, T, D, generator=gen, dtype=torch.float64), dim=-1)
    beta = beta_scale * torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, H, T, generator=gen, dtype=torch.float64) + 2) if gate else None
    lowp = lambda x: x.to(dtype).to(device)  # noqa: E731  q, k, v in the input dtype
    full = lambda x: x.to(torch.float32 if dtype != torch.float64 else dtype).to(device)  # noqa: E731
    xs = [lowp(q), lowp(k), lowp(v), full(w), full(beta), None if g is None else full(g)]
    return [None if x is None else x.requires_grad_(True) for x in xs]


def run(fn, xs, do, **kw):
    """Output and the gradients of every given input for upstream gradient do."""
    live = [x for x in xs if x is not None]
    o = fn(*xs, **kw)
    grads = torch.autograd.grad(o, live, do.to(o.dtype), allow_unused=True)
    return [o] + [torch.zeros_like(x) if gr is None else gr for x, gr in zip(live, grads)]


def reference(xs, do):
    """The naive path in float64 on the same (already rounded) inputs. Beyond T = 256 the blockwise
    UT path in float64 instead: it matches the naive one to rounding (test_torch_path_matches_naive)
    and takes seconds where the explicit D x D products per token pair take a minute at T = 1100."""
    xs64 = [None if x is None else x.detach().double().requires_grad_(True) for x in xs]
    T = xs[0].shape[2]
    fn = path_attention_naive if T <= 32 else path_attention_carry if T <= 256 else path_attention_torch
    return run(fn, xs64, do.double())


def check(got, want, names, tol):
    for name, a, b in zip(["out"] + names, got, want):
        diff = (a.double() - b.double()).abs()
        bound = tol * max(1.0, b.abs().max().item())
        assert diff.max().item() <= bound, (f"{name}: max diff {diff.max().item():.3e}, "
                                            f"mean {diff.mean().item():.3e}, allowed {bound:.3e}")


def check_with(monkeypatch, options, T, D, dtype, tol, seed, gate=True, device=None, **kw):
    """With kernels.path_attention's module options set (name -> value), the Triton path's output and
    gradients against the float64 reference on one random input of batch 1 and 2 heads."""
    import kernels.path_attention as kp
    for name, value in options.items():
        monkeypatch.setattr(kp, name, value)
    device = device or DEV
    xs = make_inputs(1, 2, T, D, gate=gate, dtype=dtype, device=device, seed=seed)
    do = torch.randn(1, 2, T, D, device=device)
    check(run(path_attention_triton, xs, do, **kw), reference(xs, do), names_for(xs), tol)


def plain(xs, dtype=None):
    return [None if x is None else x.detach().to(dtype or x.dtype) for x in xs]


def names_for(xs):
    return [n for n, x in zip(NAMES, xs) if x is not None]


# ---- the reference itself -----------------------------------------------------------------------

def explicit_logits(q, k, w, beta, g):
    """(B, H, T, T) logits q_i^T H_i ... H_{j+1} k_j / sqrt(D) + G_i - G_j written out, -inf above the diagonal."""
    B, H, T, D = q.shape
    G = g.cumsum(-1)
    eye = torch.eye(D, dtype=torch.float64)
    Hs = eye - beta[..., None, None] * w[..., :, None] * w[..., None, :]      # (B, H, T, D, D)
    logits = torch.full((B, H, T, T), -math.inf, dtype=torch.float64)
    for i in range(T):
        for j in range(i + 1):
            P = eye.expand(B, H, D, D)
            for t in range(i, j, -1):                                           # H_i H_{i-1} ... H_{j+1}
                P = P @ Hs[:, :, t]
            qPk = (q[:, :, i, None, :] @ P @ k[:, :, j, :, None])[..., 0, 0]
            logits[:, :, i, j] = qPk / math.sqrt(D) + G[:, :, i] - G[:, :, j]
    return logits


def test_naive_equals_explicit_householder_products():
    q, k, v, w, beta, g = plain(make_inputs(1, 2, 6, 4))
    want = explicit_logits(q, k, w, beta, g).softmax(-1) @ v
    got = path_attention_naive(q, k, v, w, beta, g)
    assert torch.allclose(got, want, atol=1e-12), (got - want).abs().max()


def test_torch_path_reports_its_largest_logit_once(monkeypatch):
    """The PyTorch path builds its logits per query block; the logit probe (model.largest_logits)
    still gets one value per call: the largest |logit| of all, with a padded last block (T = 13,
    blocks of 4) whose padded queries are not counted (a strong gate would give them the largest)."""
    import model as M
    q, k, v, w, beta, g = plain(make_inputs(1, 2, 13, 4))
    g = 20 * g
    logits = explicit_logits(q, k, w, beta, g)
    monkeypatch.setattr(M, "_probe", [])
    path_attention_torch(q, k, v, w, beta, g, block=4)
    want = float(logits[logits.isfinite()].abs().max())
    assert M._probe == [pytest.approx(want, rel=1e-6)]          # the probe reads in float32


def test_carry_equals_naive():
    """The vectorised reference against the literal one, forward and every gradient, float64."""
    xs = make_inputs(2, 2, 13, 5)
    do = torch.randn(2, 2, 13, 5, dtype=torch.float64)
    check(run(path_attention_carry, xs, do), run(path_attention_naive, xs, do), names_for(xs), 1e-12)


def test_naive_gradcheck():
    xs = make_inputs(1, 1, 5, 3)
    assert torch.autograd.gradcheck(lambda *a: path_attention_naive(*a), xs, eps=1e-6, atol=1e-7)


def test_ut_product_formula():
    """H_{L-1} ... H_0 = I - W^T A W with A = (I + strictLower(diag(beta) W W^T))^{-1} diag(beta)."""
    L, D = 9, 5
    _, _, _, w, beta, _ = plain(make_inputs(1, 1, L, D))
    w, beta = w[0, 0], beta[0, 0]
    P = torch.eye(D, dtype=torch.float64)
    for t in range(L):
        P = (torch.eye(D, dtype=torch.float64) - beta[t] * torch.outer(w[t], w[t])) @ P
    Tm = torch.eye(L, dtype=torch.float64) + (beta[:, None] * (w @ w.T)).tril(-1)
    A = torch.linalg.solve(Tm, torch.diag(beta))
    assert torch.allclose(P, torch.eye(D, dtype=torch.float64) - w.T @ A @ w, atol=1e-12)


# ---- blockwise UT path ----------------------------------------------------------------------------

@pytest.mark.parametrize("T,D,block", [(1, 16, 16), (7, 32, 4), (97, 16, 16), (130, 64, 32), (130, 32, 64)])
@pytest.mark.parametrize("gate", [False, True])
def test_torch_path_matches_naive(T, D, block, gate):
    xs = make_inputs(2, 2, T, D, gate=gate, seed=T)
    do = torch.randn(2, 2, T, D, dtype=torch.float64)
    check(run(path_attention_torch, xs, do, block=block), reference(xs, do), names_for(xs), 1e-9)


# ---- Triton kernel (interpreter on CPU, compiled on GPU) --------------------------------------------

# (T, D, block BL, chunk R): chunks of 1, 2 and 3 blocks exercise the chunk level (step 3 of the
# kernel) at these small T, with a last chunk that is full or partial; R = 8 only the block level
INTERP = [(1, 16, 16, 8), (7, 32, 16, 8), (97, 16, 16, 2), (97, 16, 16, 3), (130, 32, 32, 1),
          (70, 64, 64, 8), (40, 128, 32, 8), (128, 16, 16, 4)]


@pytest.mark.parametrize("T,D,block,chunk", INTERP)
@pytest.mark.parametrize("gate", [False, True])
def test_triton_matches_naive_fp32(T, D, block, chunk, gate):
    device = "cuda" if GPU else "cpu"
    xs = make_inputs(1, 2, T, D, gate=gate, dtype=torch.float32, device=device, seed=T + D)
    do = torch.randn(1, 2, T, D, device=device)
    check(run(path_attention_triton, xs, do, block=block, chunk=chunk), reference(xs, do), names_for(xs), 1e-4)


@pytest.mark.parametrize("T,D,block,chunk,dtype,tol", [(*c, torch.float32, 1e-4) for c in INTERP if c[3] < 8]
                         + [(40, 128, 16, 2, torch.float16, 2e-2)])
@pytest.mark.parametrize("gate", [False, True])
def test_triton_with_the_later_chunks_in_their_own_kernel(T, D, block, chunk, dtype, tol, gate, monkeypatch):
    """kernels.path_attention.SPLIT_DKL: `_bwd_dkl` scores the later chunks' query blocks for tiles of
    two key blocks (chunks of 2 and 4; one block for chunks of 1 and 3), with a last tile that passes
    the last block (T = 97 at BL = 16: 7 blocks), and `_bwd_dkv` adds what it wrote (and, in 16 bits,
    folds it through the Triton chunk products)."""
    check_with(monkeypatch, {"SPLIT_DKL": {D}}, T, D, dtype, tol, T + D, gate, block=block, chunk=chunk)


@pytest.mark.parametrize("T,D,block,chunk", [(97, 32, 16, 8), (97, 32, 16, 3), (97, 32, 16, 2), (40, 64, 16, 4),
                                             (40, 128, 16, 4)])
@pytest.mark.parametrize("gate", [False, True])
def test_triton_carrying_the_states_by_w_and_u(T, D, block, chunk, gate, monkeypatch):
    """kernels.path_attention.CARRY_WU: for 16-bit inputs the states of a chunk go through each block's W
    and U in fp16 (Q~ - (Q~ W^T) U forward, X - (X U^T) W backward) instead of M; the outputs and every
    gradient still match the float64 reference (chunks of 8 blocks: the block level alone; of 3 and 4: both)."""
    check_with(monkeypatch, {"CARRY_WU": {D}}, T, D, torch.float16, 2e-2, T + D + 1, gate, block=block, chunk=chunk)


@pytest.mark.parametrize("T,D,block,chunk", [(97, 32, 16, 3), (40, 128, 16, 2), (40, 128, 16, 4)])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("fwd,bwd", [(True, False), (False, True), (True, True)])
def test_triton_with_the_chunk_products_by_w_and_u(T, D, block, chunk, gate, fwd, bwd, monkeypatch):
    """kernels.path_attention.CHUNK_WU (with CARRY_WU): `_chunk_fwd` carries the suffix products through each
    block's W and U in fp16, all D rows in one program, and forms kL in fp16; CHUNK_WU_BWD: `_chunk_bwd`
    carries dS through them (row-scaled). The outputs and every gradient still match the float64 reference
    (the chunk kernels run for 16-bit inputs at D = 32, 64 and 128)."""
    check_with(monkeypatch, {"CARRY_WU": {D}, "CHUNK_WU": {D} if fwd else set(), "CHUNK_WU_BWD": {D} if bwd else set()},
               T, D, torch.float16, 2e-2, T + D + 3, gate, block=block, chunk=chunk)


@pytest.mark.parametrize("bwd", [False, True])
def test_triton_forms_m_only_where_it_is_read(bwd, monkeypatch):
    """With the states and both chunk kernels carried by W and U (CARRY_WU, CHUNK_WU, CHUNK_WU_BWD) nothing reads
    the block products M: the UT step leaves them out (a zero-stride stand-in carries M's gradient), and the
    output and every gradient still match the reference; with CHUNK_WU_BWD off, `_chunk_bwd` reads M: formed."""
    import kernels.path_attention as kp
    seen = []
    apply = kp.UTBlocks.apply
    monkeypatch.setattr(kp.UTBlocks, "apply", lambda *a: seen.append(apply(*a)) or seen[-1])
    check_with(monkeypatch, {"CARRY_WU": {32}, "CHUNK_WU": {32}, "CHUNK_WU_BWD": {32} if bwd else set()}, 97, 32,
               torch.float16, 2e-2, 131, block=16, chunk=2)
    mb = seen[0][2]
    assert (mb.stride() == (0, 0, 0, 0)) == bwd and kp.m_read(32, torch.float16) != bwd
    assert kp.m_read(32, torch.float32)                     # float32: the PyTorch chunk products read M


@pytest.mark.parametrize("T,D,block,chunk,dtype,tol", [(97, 16, 16, 3, torch.float32, 1e-4),
                                                     (97, 32, 16, 2, torch.float16, 2e-2),
                                                     (40, 128, 16, 4, torch.float16, 2e-2)])
@pytest.mark.parametrize("gate,split", [(False, False), (True, False), (True, True)])
def test_triton_with_the_d_x_d_sums_in_their_own_kernel(T, D, block, chunk, dtype, tol, gate, split, monkeypatch):
    """kernels.path_attention.SPLIT_DM: `_bwd_dm` forms each block's dM and its share of dPL, `_bwd_dkv` the
    rest; with the later chunks in `_bwd_dkl` as well (SPLIT_DKL) and the Triton chunk backward (16 bits),
    `_bwd_dm` also folds dkL through the suffix products. Every gradient still matches the float64
    reference (several chunks: dPL's shares are summed)."""
    check_with(monkeypatch, {"SPLIT_DM": {D}, "SPLIT_DKL": {D} if split else set()}, T, D, dtype, tol, T + D + 2,
               gate, block=block, chunk=chunk)


# D = 128 in 16 bits: the fused UT step, then the PyTorch chunk products (3 blocks, 2 chunks)
@pytest.mark.parametrize("T,D,block,chunk", [(7, 16, 16, 8), (97, 32, 16, 2), (40, 128, 16, 2)])
def test_triton_matches_naive_fp16(T, D, block, chunk):
    device = "cuda" if GPU else "cpu"
    xs = make_inputs(1, 2, T, D, dtype=torch.float16, device=device, seed=T)
    do = torch.randn(1, 2, T, D, device=device)
    check(run(path_attention_triton, xs, do, block=block, chunk=chunk), reference(xs, do), names_for(xs), 2e-2)


# BL = 64 (four 16 x 16 pieces of T^-1) in float32 only in the interpreter: compiled for a GPU, the
# exact float32 products at BL = 64 spill registers and the build takes minutes (and float32 inputs
# never use this kernel).
@pytest.mark.parametrize("T,D,BL,dtype,tol",
                         [(T, D, BL, dt, tol) for T, D, BL in [(16, 16, 16), (64, 32, 16), (64, 16, 32), (128, 32, 64)]
                          for dt, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2))
                          if not (GPU and BL == 64 and dt == torch.float32)])
def test_fused_ut_preprocessing_matches_ut_blocks(T, D, BL, dtype, tol):
    """kernels.path_attention.UTBlocks (used for 16-bit inputs) against path_attention.ut_blocks in
    float64: the four outputs (qh, kh, M = W^T U per block, sd), the gradients of q, k, w, beta
    for random upstream gradients, and U (stored for CARRY_WU). With float32 inputs its products are
    exact float32; with fp16 they round their operands to fp16 (M's too)."""
    from kernels.path_attention import UTBlocks
    q, k, v, w, beta, _ = make_inputs(1, 3, T, D, gate=False, dtype=dtype, device=DEV, seed=T + BL)
    flat = lambda x: x.detach().reshape(3, T, -1).contiguous().requires_grad_(True)  # noqa: E731
    xs = [flat(q), flat(k), flat(w), beta.detach().reshape(3, T).contiguous().requires_grad_(True)]
    *outs, u16 = UTBlocks.apply(*xs, 0.3, BL, True)
    ups = [torch.randn_like(o) for o in outs]
    got = list(outs) + list(torch.autograd.grad(outs, xs, ups)) + [u16]
    ref = [x.detach().double().requires_grad_(True) for x in xs]
    qh, kh, wb, u, sd = pa.ut_blocks(*(x[None] for x in ref), 0.3, BL)
    mb = wb[0].view(3, T // BL, BL, D).mT @ u[0].view(3, T // BL, BL, D)        # (3, T / BL, D, D)
    want_outs = [qh[0], kh[0], mb, sd[0]]
    want = want_outs + list(torch.autograd.grad(want_outs, ref, [g.double() for g in ups])) + [u[0].detach()]
    for name, a, b in zip(["qh", "kh", "M", "sd", "dq", "dk", "dw", "dbeta", "U"], got, want, strict=True):
        err = (a.double() - b).abs().max().item() / max(1.0, b.abs().max().item())
        assert err <= tol, f"{name}: relative error {err:.2e}, allowed {tol:.0e}"


@pytest.mark.parametrize("T,D,BL,R,panel", [(64, 16, 16, 2, 16), (112, 16, 16, 3, 16), (48, 32, 16, 8, 32),
                                             (64, 16, 16, 1, 16), (48, 32, 16, 8, 16), (112, 32, 16, 3, 16)])
def test_chunk_product_kernels_match_chunk_products(T, D, BL, R, panel, monkeypatch):
    """kernels.path_attention.chunk_products_fwd / _bwd against autograd through chunk_products in
    float64: kL, PL and the gradients of kh and M (P = I - M per block), with a short last chunk
    (T = 112, R = 3) and one block per chunk. The backward takes dkL as dkL^T kh per block (kh's own
    gradient, dkL S with the suffix products S that the forward returns, is left to the attention
    kernel), dPL as one share per block, which it sums per chunk, and the attention kernels' dM.
    `panel` rows of S per program: below D, the panels of D = 128 (two of 64 rows) at a size the
    interpreter runs in seconds."""
    import kernels.path_attention as kp
    from kernels.path_attention import chunk_products, chunk_products_bwd, chunk_products_fwd
    monkeypatch.setattr(kp, "chunk_panel", lambda D: panel)
    gen = torch.Generator().manual_seed(T + R)
    kh = torch.randn(3, T, D, generator=gen)
    n = T // BL
    w = 0.5 * F.normalize(torch.randn(3, n, BL, D, generator=gen), dim=-1)
    mb = w.mT @ (0.1 * torch.randn(3, n, BL, D, generator=gen))  # M = W^T U per block
    dkl = torch.randn(3, T, D, generator=gen)
    shares = torch.randn(3, n, D, D, generator=gen)              # each block's share of dPL
    dpl = F.pad(shares, (0, 0, 0, 0, 0, -(-n // R) * R - n)).view(3, -1, R, D, D).sum(2)
    dm0 = torch.randn(3, n, D, D, generator=gen)                 # dM of each block from elsewhere
    kl, pl, suf = chunk_products_fwd(kh.to(DEV), mb.to(DEV), BL, R)
    dsk = dkl.view(3, n, BL, D).mT @ kh.view(3, n, BL, D)        # dkL^T kh per block
    dm = chunk_products_bwd(mb.to(DEV), suf, dsk.to(DEV), shares.to(DEV), dm0.to(DEV), BL, R)
    dkh = (dkl.view(3, n, BL, D).to(DEV) @ suf).view(3, T, D)    # what _bwd_dkv adds to kh's gradient
    ref = [x.double().requires_grad_(True) for x in (kh, mb)]
    want_kl, want_pl = chunk_products(*ref, BL, R)
    want_dkh, want_dm = torch.autograd.grad((want_kl, want_pl), ref, (dkl.double(), dpl.double()))
    tol = 1e-5 if not GPU else 5e-3            # TF32 products on a GPU; exact in the interpreter
    got, want = [kl, pl, dkh, dm], [want_kl, want_pl, want_dkh, want_dm + dm0.double()]
    for name, a, b in zip(["kL", "PL", "dkh", "dM"], got, want):
        err = (a.double().cpu() - b.detach()).abs().max().item() / max(1.0, b.abs().max().item())
        assert err <= tol, f"{name}: relative error {err:.2e}, allowed {tol:.0e}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [1, 97, 130, 333])
@pytest.mark.parametrize("D,dtype,tol", [(D, dt, tol) for D in (16, 32, 64, 128)
                                         for dt, tol in ((torch.float32, 1e-4), (torch.bfloat16, 6e-2))]
                         + [(64, torch.float16, 2e-2)])
@pytest.mark.parametrize("gate", [False, True])
def test_triton_gpu_default_blocks(T, D, dtype, tol, gate):
    xs = make_inputs(2, 3, T, D, gate=gate, dtype=dtype, device="cuda", seed=T * D)
    do = torch.randn(2, 3, T, D, device="cuda")
    check(run(path_attention_triton, xs, do), reference(xs, do), names_for(xs), tol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("split", [False, True])
def test_triton_gpu_chunk_level(D, dtype, tol, split, monkeypatch):
    """T = 1100 with the default blocks: full chunks and a partial one, so the chunk level runs
    (2 chunks of 512 tokens at D <= 64, 4 of 256 at D = 128); with `split`, the later chunks'
    query blocks are scored in `_bwd_dkl` (SPLIT_DKL)."""
    check_with(monkeypatch, {"SPLIT_DKL": {D} if split else set()}, 1100, D, dtype, tol, D, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T", [97, 1100])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 6e-2), (torch.float16, 2e-2)])
def test_triton_gpu_carrying_the_states_by_w_and_u(D, T, dtype, tol, monkeypatch):
    """D = 64 and 128 with the default blocks, compiled, the carry the default does not take (CARRY_WU flipped:
    by M where the default carries by W and U), so that both are tested on the GPU: the block level alone
    (T = 97) and with the chunk level (T = 1100), gated."""
    import kernels.path_attention as kp
    check_with(monkeypatch, {"CARRY_WU": kp.CARRY_WU ^ {D}}, T, D, dtype, tol, T + 3, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 6e-2), (torch.float16, 2e-2)])
def test_triton_gpu_chunk_products_by_w_and_u(dtype, tol, monkeypatch):
    """The chunk products' ways the defaults do not take, at D = 128 compiled, T = 1100 with the default blocks
    (3 chunks of 8 blocks of 64, the last partial), gated: CHUNK_WU flipped (the suffix carried by M) with
    CHUNK_WU_BWD on (dS carried by W and U)."""
    import kernels.path_attention as kp
    check_with(monkeypatch, {"CHUNK_WU": kp.CHUNK_WU ^ {128}, "CHUNK_WU_BWD": kp.CHUNK_WU_BWD ^ {128}}, 1100, 128,
               dtype, tol, 131, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("D,chunk_wu", [(64, False), (128, False), (128, True)])
def test_triton_gpu_small_gradients_in_bf16(D, chunk_wu, monkeypatch):
    """bf16 training's gradients lie far below fp16's normal range, where the carries of CARRY_WU (the default
    at D = 64 and 128; and with chunk_wu those of CHUNK_WU_BWD) compute: with an upstream gradient of 1e-7 every
    gradient, divided by 1e-7, matches the reference as closely as with one of size 1."""
    import kernels.path_attention as kp
    monkeypatch.setattr(kp, "CHUNK_WU_BWD", {D} if chunk_wu else set())
    xs = make_inputs(1, 2, 1100, D, gate=True, dtype=torch.bfloat16, device="cuda", seed=7)
    do = torch.randn(1, 2, 1100, D, device="cuda")
    for size in (1.0, 1e-7):
        got, want = run(path_attention_triton, xs, do * size), reference(xs, do * size)
        check([got[0]] + [g / size for g in got[1:]], [want[0]] + [g / size for g in want[1:]], names_for(xs), 6e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
def test_triton_gpu_d_x_d_sums_in_their_own_kernel(D, dtype, tol, monkeypatch):
    """SPLIT_DM flipped (the way the default does not take: `_bwd_dm` at D = 64, dM inside `_bwd_dkv` at 128),
    compiled, T = 1100 with the default blocks (chunk level, gated), beside SPLIT_DKL's default."""
    import kernels.path_attention as kp
    check_with(monkeypatch, {"SPLIT_DM": kp.SPLIT_DM ^ {D}}, 1100, D, dtype, tol, D + 5, device="cuda")


def test_ut_kernels_take_a_register_limit(monkeypatch):
    """UT_MAXNREG reaches both UT launches as Triton's maxnreg (here through the interpreter, which
    ignores it): the same outputs and gradients as without it. The GPU test checks the compiled ones."""
    import kernels.path_attention as kp
    q, k, _, w, beta, _ = make_inputs(1, 2, 16, 16, gate=False, dtype=torch.float16, device=DEV, seed=5)
    xs = [x.detach().reshape(2, 16, -1).squeeze(-1).contiguous().requires_grad_(True) for x in (q, k, w, beta)]
    got = {}
    for limit in (None, 128):
        monkeypatch.setattr(kp, "UT_MAXNREG", limit)
        assert kp.ut_registers() == ({} if limit is None else {"maxnreg": 128})
        *outs, _ = kp.UTBlocks.apply(*xs, 0.3, 16)                   # qh, kh, M, sd
        got[limit] = outs + list(torch.autograd.grad([o.float().sum() for o in outs], xs))
    assert all(torch.equal(a, b) for a, b in zip(got[None], got[128], strict=True))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("D", [64, 128])
def test_triton_gpu_ut_kernels_under_a_register_limit_give_the_same_bits(D, monkeypatch):
    """UT_MAXNREG (ptxas' register limit for `_ut_fwd` and `_ut_bwd`, spilling what does not fit) changes where
    values live, not what is computed: the output and every gradient equal the default's bit for bit (bf16,
    T = 1100 with the chunk level, gated)."""
    import kernels.path_attention as kp
    xs = make_inputs(1, 2, 1100, D, gate=True, dtype=torch.bfloat16, device="cuda", seed=D + 11)
    do = torch.randn(1, 2, 1100, D, device="cuda")
    want = run(path_attention_triton, xs, do)
    monkeypatch.setattr(kp, "UT_MAXNREG", 128)
    got = run(path_attention_triton, xs, do)
    for name, a, b in zip(["out"] + names_for(xs), got, want):
        assert torch.equal(a, b), name


def test_triton_rejects_other_head_dims():
    xs = make_inputs(1, 1, 8, 24, dtype=torch.float32)
    with pytest.raises(ValueError, match="head dims 16, 32, 64 or 128"):
        path_attention_triton(*xs)


def test_backend_switch(monkeypatch):
    xs = plain(make_inputs(1, 2, 20, 16, dtype=torch.float32, device=DEV))
    want = path_attention_naive(*xs)
    for backend in ("naive", "torch", "triton"):
        monkeypatch.setattr(pa, "BACKEND", backend)
        assert torch.allclose(path_attention(*xs), want, atol=1e-5), backend
    monkeypatch.setattr(pa, "BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="unknown BACKEND"):
        path_attention(*xs)


# ---- reductions and decoding ----------------------------------------------------------------------

@pytest.mark.parametrize("fn", [path_attention_naive, path_attention_torch, path_attention_triton])
def test_beta_zero_is_causal_softmax_attention(fn):
    q, k, v, w, beta, _ = plain(make_inputs(2, 2, 33, 16, gate=False, device=DEV), torch.float32)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = fn(q, k, v, w, torch.zeros_like(beta))
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_reflections_change_the_logits():
    """Guard against a path that ignores w: with beta = 1 the output differs from softmax attention."""
    q, k, v, w, beta, _ = plain(make_inputs(1, 1, 12, 8, gate=False))
    softmax_only = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (path_attention_naive(q, k, v, w, torch.ones_like(beta)) - softmax_only).abs().max() > 1e-2


def test_decoding_step_by_step_equals_full_forward():
    B, H, T, D = 2, 3, 11, 8
    q, k, v, w, beta, g = plain(make_inputs(B, H, T, D))
    full = path_attention_naive(q, k, v, w, beta, g)
    cache, k_before = {}, k.clone()
    outs = [path_decode_step(cache, q[:, :, t], k[:, :, t], v[:, :, t], w[:, :, t], beta[:, :, t], g[:, :, t])
            for t in range(T)]
    assert torch.allclose(torch.stack(outs, 2), full, atol=1e-12)
    assert torch.equal(k, k_before)                                   # the caller's keys are untouched
    # the cache holds every key carried to the last position: H_{T-1} ... H_{j+1} k_j
    j = 3
    carried = k[:, :, j]
    for t in range(j + 1, T):
        carried = carried - beta[:, :, t, None] * (carried * w[:, :, t]).sum(-1, keepdim=True) * w[:, :, t]
    assert torch.allclose(cache["k"][:, :, j], carried, atol=1e-12)


def layer_cfg(**kw):
    return ModelConfig(vocab_size=10, d_model=32, n_heads=2, causal=True, **kw)


def test_layer_decoding_equals_layer_forward():
    torch.manual_seed(0)
    layer = PathAttention(layer_cfg(), forget_gate=True).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    full = layer(x, {})
    cache = {}
    steps = torch.stack([layer.step(x[:, t], cache) for t in range(9)], 1)
    assert torch.allclose(steps, full, atol=1e-10), (steps - full).abs().max()


def test_path_fox_with_orthogonal_w_is_fox():
    """When every w_t is orthogonal to all queries and keys, each H_t acts as the identity on
    them and PaTH-FoX computes exactly FoX. Head coordinate 0 is reserved for w: q and k have
    none of it, and w has nothing else."""
    torch.manual_seed(0)
    cfg = layer_cfg()
    path, fox = PathAttention(cfg, forget_gate=True).double(), FoxAttention(cfg).double()
    with torch.no_grad():
        for h in range(2):
            path.qkv.weight[h * 16] = 0                   # q coordinate 0 of head h
            path.qkv.weight[32 + h * 16] = 0              # k coordinate 0 of head h
        keep = torch.zeros(32, dtype=torch.bool)
        keep[[0, 16]] = True
        path.w_proj[1].weight[~keep] = 0                  # w only along coordinate 0 of each head
        fox.qkv.load_state_dict(path.qkv.state_dict())
        fox.out.load_state_dict(path.out.state_dict())
        fox.gate.load_state_dict(path.gate.state_dict())
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    w, beta, _ = path.gates(x)
    assert (w[..., 0].abs() > 0.99).all() and beta.min() > 0.01     # real reflections, not H = I
    assert torch.allclose(path(x, {}), fox(x, {}), atol=1e-10)


def test_fox_gate_is_a_decaying_bias():
    """FoX with the gate forced open (g = 0) is plain causal softmax attention."""
    torch.manual_seed(0)
    fox = FoxAttention(layer_cfg())
    with torch.no_grad():
        fox.gate.weight.zero_()
        fox.gate.bias.fill_(30.0)                         # logsigmoid(30) ~ -1e-13
    x = torch.randn(2, 7, 32)
    q, k, v = fox.qkv(x).view(2, 7, 3, 2, 16).permute(2, 0, 3, 1, 4)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(fox(x, {}), fox.out(o.transpose(1, 2).reshape(2, 7, 32)), atol=1e-5)


def test_layers_refuse_bidirectional_models():
    with pytest.raises(ValueError, match="causal"):
        PathAttention(ModelConfig(d_model=32, n_heads=2, causal=False))


@triton.jit
def _carry_probe(X, DO, W, U, Y, BL: tl.constexpr, D: tl.constexpr, SCALED: tl.constexpr):
    """One backward carry by W and U (CARRY_WU) of the gradient X, held as `_bwd_dq` holds it: times the row
    scales of dO (SCALED) or as it is."""
    rc, rd = tl.arange(0, BL), tl.arange(0, D)
    x = tl.load(X + rc[:, None] * D + rd[None, :])
    rs = _row_scale(tl.load(DO + rc[:, None] * D + rd[None, :])) if SCALED else 1.0
    y = _carry(x * rs, X, W, U, 0, rc, rd, D, "tf32", True, True) * (1.0 / rs)
    tl.store(Y + rc[:, None] * D + rd[None, :], y)


def test_carry_by_w_and_u_keeps_a_small_gradient():
    """The backward's fp16 carry (X - (X U^T) W) takes X times a power of two per row, from the same row of
    dO (`_row_scale`): a gradient of 1e-7 per entry, as bf16 training gives (below fp16's smallest normal,
    6e-5), comes through with the relative error of one of size 1; unscaled it would lose most of its bits."""
    BL, D = 16, 32
    gen = torch.Generator().manual_seed(0)
    w = F.normalize(torch.randn(BL, D, generator=gen, dtype=torch.float64), dim=-1)
    u = torch.randn(BL, D, generator=gen, dtype=torch.float64) / 4
    x = torch.randn(BL, D, generator=gen, dtype=torch.float64)
    want = x - (x @ u.T) @ w                                         # X (I - W^T U)^T

    def carried(size, scaled):
        dev = DEV
        y = torch.empty(BL, D, device=dev)
        _carry_probe[(1,)]((x * size).float().to(dev), (x * size).float().to(dev), w.half().to(dev),
                           u.half().to(dev), y, BL=BL, D=D, SCALED=scaled)
        return (y.double().cpu() / size - want).abs().max().item() / want.abs().max().item()
    assert carried(1.0, True) < 2e-3
    assert carried(1e-7, True) < 2e-3
    assert carried(1e-7, False) > 2e-2                               # what the scale is there for
