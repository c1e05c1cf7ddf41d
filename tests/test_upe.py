"""RPE and UPE: the naive definition against explicit per-pair sums, the fast path (gathered tables)
against the naive one on output and every gradient, the reductions, and the translation symmetry.

Tolerances: float64 agrees to rounding (1e-10); float32 ~1e-6 seen over softmaxes of <= 97 terms,
1e-4 allowed."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import experiments
import train
import upe
from tasks import TASKS
from model import ModelConfig
from cli import main, make_config
from upe import RPEAttention, UPEAttention, upe_attention, upe_attention_naive, upe_logits

triton = pytest.importorskip("triton")
from kernels.upe_attention import upe_attention_triton  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"

NAMES = ["q", "k", "v", "rel", "uni"]


def make_inputs(B, H, T, D, K, M, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)  # noqa: E731
    q, k, v, rel, uni = r(B, H, T, D), r(B, H, T, D), r(B, H, T, D), r(H, 2 * K + 1, D), r(H, M, D)
    slot = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):                                   # a few slotted keys per row, like a multiplier
        pos = torch.randperm(T, generator=gen)[: min(M, T)]
        slot[b, pos] = torch.arange(len(pos))
    key_mask = torch.ones(B, T, dtype=torch.bool)
    key_mask[0, T - T // 3:] = False                     # padding at the end of one row
    return q, k, v, rel, uni, slot, key_mask


def run(fn, tensors, extra, do):
    o = fn(*tensors, *extra)
    return [o] + list(torch.autograd.grad(o, tensors, do))


def check(got, want, tol):
    for name, a, b in zip(["out"] + NAMES, got, want):
        diff = (a.double() - b.double()).abs()
        bound = tol * max(1.0, b.abs().max().item())
        assert diff.max().item() <= bound, f"{name}: max {diff.max().item():.3e} mean {diff.mean().item():.3e}"


def test_naive_is_the_papers_formula():
    B, H, T, D, K, M = 1, 2, 7, 4, 2, 2
    q, k, v, rel, uni, slot, key_mask = make_inputs(B, H, T, D, K, M)
    q, k, v, rel, uni = (x.detach() for x in (q, k, v, rel, uni))
    want = torch.zeros(B, H, T, D, dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            logits = []
            for j in range(T):
                p = uni[h, slot[0, j]] if slot[0, j] >= 0 else rel[h, max(-K, min(K, i - j)) + K]
                logit = q[0, h, i] @ (k[0, h, j] + p) / math.sqrt(D)
                logits.append(logit if key_mask[0, j] else torch.tensor(-math.inf, dtype=torch.float64))
            want[0, h, i] = torch.stack(logits).softmax(0) @ v[0, h]
    assert torch.allclose(upe_attention_naive(q, k, v, rel, uni, slot, key_mask), want, atol=1e-12)


def test_naive_gradcheck():
    q, k, v, rel, uni, slot, key_mask = make_inputs(1, 1, 5, 3, 1, 2)
    assert torch.autograd.gradcheck(lambda *a: upe_attention_naive(*a, slot, key_mask), (q, k, v, rel, uni),
                                    eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("T,D,K", [(1, 16, 4), (7, 16, 2), (33, 32, 8), (97, 16, 16), (20, 32, 64)])
@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_matches_naive_float64(T, D, K, uniform, causal):
    q, k, v, rel, uni, slot, key_mask = make_inputs(2, 2, T, D, K, 3, seed=T + K)
    key_mask = None if causal else key_mask              # causal models here have no padding mask
    tensors = [q, k, v, rel] + ([uni] if uniform else [])

    def call(fn):
        return lambda q, k, v, rel, uni=None: fn(q, k, v, rel, uni, slot if uniform else None, key_mask, causal)

    do = torch.randn(2, 2, T, D, dtype=torch.float64)
    check(run(call(upe_attention), tensors, (), do), run(call(upe_attention_naive), tensors, (), do), 1e-10)


@pytest.mark.parametrize("T,D,K,block", [(1, 16, 4, 16), (7, 16, 2, 16), (37, 32, 4, 16), (70, 64, 64, 64),
                                         (20, 128, 8, 32), (48, 16, 4, 16), (45, 16, 4, (32, 16)),
                                         (70, 16, 40, (64, 16)), (20, 24, 4, 16), (11, 96, 4, 16)])
@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_matches_naive(T, D, K, block, uniform, causal):
    """Through the interpreter on CPU (compiled on a GPU), float32; the reference in float64. Head dims
    24 and 96 run zero-padded to the kernel's 32 and 128."""
    q, k, v, rel, uni, slot, key_mask = make_inputs(2, 2, T, D, K, 3, dtype=torch.float32, seed=T * D)
    key_mask = None if causal else key_mask.to(DEV)
    tensors = [x.detach().to(DEV).requires_grad_(True) for x in (q, k, v, rel)] + \
        ([uni.detach().to(DEV).requires_grad_(True)] if uniform else [])
    sl = slot.to(DEV) if uniform else None
    do = torch.randn(2, 2, T, D, device=DEV)
    got = run(lambda q, k, v, rel, uni=None: upe_attention_triton(q, k, v, rel, uni, sl, key_mask, causal, block),
              tensors, (), do)
    ref = [x.detach().double().requires_grad_(True) for x in tensors]
    want = run(lambda q, k, v, rel, uni=None: upe_attention_naive(q, k, v, rel, uni, sl, key_mask, causal),
               ref, (), do.double())
    check(got, want, 1e-4)


def test_triton_without_any_mask():
    """T a multiple of the block and no key mask: the kernels skip masking altogether."""
    q, k, v, rel, uni, slot, _ = make_inputs(2, 2, 48, 16, 4, 3, dtype=torch.float32, seed=11)
    tensors = [x.detach().to(DEV).requires_grad_(True) for x in (q, k, v, rel, uni)]
    sl = slot.to(DEV)
    do = torch.randn(2, 2, 48, 16, device=DEV)
    got = run(lambda *a: upe_attention_triton(*a, sl, None, False, 16), tensors, (), do)
    ref = [x.detach().double().requires_grad_(True) for x in tensors]
    check(got, run(lambda *a: upe_attention_naive(*a, sl), ref, (), do.double()), 1e-4)


def test_triton_rejects_head_dims_above_128():
    q = torch.zeros(1, 1, 8, 160, device=DEV)
    with pytest.raises(ValueError, match="head dims up to 128, got 160"):
        upe_attention_triton(q, q, q, torch.zeros(1, 9, 160, device=DEV))


@pytest.mark.parametrize("causal", [False, True])
def test_triton_writes_every_uninitialised_cell(monkeypatch, causal):
    """The Triton path leaves most of its buffers uninitialised (the dQR table gradient is 1 GB at
    T = 4096) and zeroes only the cells its kernels do not write. With every torch.empty filled
    with NaN instead, a missed cell would show up in the output or a gradient."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    q, k, v, rel, uni, slot, key_mask = make_inputs(2, 2, 45, 16, 8, 3, dtype=torch.float32, seed=5)
    key_mask = None if causal else key_mask.to(DEV)
    tensors = [x.detach().to(DEV).requires_grad_(True) for x in (q, k, v, rel, uni)]
    sl = slot.to(DEV)
    do = torch.randn(2, 2, 45, 16, device=DEV)
    got = run(lambda *a: upe_attention_triton(*a, sl, key_mask, causal, 16), tensors, (), do)
    ref = [x.detach().double().requires_grad_(True) for x in tensors]
    check(got, run(lambda *a: upe_attention_naive(*a, sl, key_mask, causal), ref, (), do.double()), 1e-4)


def test_triton_matches_naive_fp16():
    q, k, v, rel, uni, slot, key_mask = make_inputs(1, 2, 45, 32, 6, 3, dtype=torch.float16, seed=3)
    tensors = [x.detach().to(DEV).requires_grad_(True) for x in (q, k, v, rel, uni)]
    sl, km = slot.to(DEV), key_mask.to(DEV)
    do = torch.randn(1, 2, 45, 32, device=DEV, dtype=torch.float16)
    got = run(lambda *a: upe_attention_triton(*a, sl, km, False, 16), tensors, (), do)
    ref = [x.detach().double().requires_grad_(True) for x in tensors]
    # fp16 inputs, fp16 products on tensor cores: ~3e-3 seen, 2e-2 allowed
    check(got, run(lambda *a: upe_attention_naive(*a, sl, km), ref, (), do.double()), 2e-2)


@pytest.mark.parametrize("K", [2, 30, 64])
def test_table_kernel_writes_q_times_r(K, monkeypatch):
    """The position table of the Triton path: every column 0 ... 2K of every row is q . R[2K - c],
    the padding columns are zeros (the band loads read them unclipped), and the clipped copy holds
    columns 0 and 2K. K = 30 puts column 2K in the first or the second 64-column step of the kernel
    depending on the row (it writes rows from column -(i mod 8)). torch.empty gives NaN here, so a
    cell the kernel leaves unwritten fails."""
    from kernels.upe_attention import build_table, table_width
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    B, H, T, D = 2, 3, 40, 16                        # T: a multiple of 8, as the caller pads it
    gen = torch.Generator().manual_seed(K)
    q = torch.randn(B * H, T, D, generator=gen).to(DEV)
    rel = torch.randn(H, 2 * K + 1, D, generator=gen).to(DEV)
    NG = table_width(K) - 1
    tr, te = build_table(q, F.pad(rel.flip(1), (0, 0, 0, NG - 2 * K - 1)), H, K)
    want = (q.double().view(B, H, T, D) @ rel.double().flip(1).transpose(-1, -2)).view(B * H, T, 2 * K + 1)
    assert tr.shape == (B * H, T, NG + 1) and (NG + 1) % 8 == 1 and NG + 1 >= 2 * K + 8
    torch.testing.assert_close(tr[..., :2 * K + 1].double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(tr[..., 2 * K + 1:], torch.zeros_like(tr[..., 2 * K + 1:]))
    torch.testing.assert_close(te.double(), want[..., [0, 2 * K]], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 130, 333])
@pytest.mark.parametrize("D", [16, 32, 64, 96, 128])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
def test_triton_gpu(T, D, dtype, tol):
    q, k, v, rel, uni, slot, key_mask = make_inputs(2, 3, T, D, 16, 3, dtype=dtype, seed=T + D)
    tensors = [x.detach().cuda().requires_grad_(True) for x in (q, k, v, rel, uni)]
    sl, km = slot.cuda(), key_mask.cuda()
    do = torch.randn(2, 3, T, D, device="cuda", dtype=dtype)
    got = run(lambda *a: upe_attention_triton(*a, sl, km), tensors, (), do)
    ref = [x.detach().double().requires_grad_(True) for x in tensors]
    check(got, run(lambda *a: upe_attention_naive(*a, sl, km), ref, (), do.double()), tol)


def test_fast_matches_naive_float32():
    q, k, v, rel, uni, slot, key_mask = make_inputs(2, 3, 61, 16, 8, 3, dtype=torch.float32, seed=1)
    do = torch.randn(2, 3, 61, 16)
    ref = [x.detach().double().requires_grad_(True) for x in (q, k, v, rel, uni)]
    check(run(upe_attention, [q, k, v, rel, uni], (slot, key_mask), do),
          run(upe_attention_naive, ref, (slot, key_mask), do.double()), 1e-4)


def test_clipped_offsets_share_one_vector():
    """With clip K every offset beyond K uses R[+-K]: their gradients add up in that one row."""
    q, k, v, rel, _, _, _ = make_inputs(1, 1, 12, 8, 2, 1)
    do = torch.randn(1, 1, 12, 8, dtype=torch.float64)
    g_fast = torch.autograd.grad(upe_attention(q, k, v, rel), rel, do)[0]
    g_naive = torch.autograd.grad(upe_attention_naive(q, k, v, rel), rel, do)[0]
    assert torch.allclose(g_fast, g_naive, atol=1e-12)
    assert g_fast[0, 0].abs().sum() > 0 and g_fast[0, -1].abs().sum() > 0


def test_zero_vectors_are_plain_attention():
    q, k, v, rel, _, _, key_mask = make_inputs(2, 2, 9, 8, 3, 1)
    q, k, v = (x.detach() for x in (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
    assert torch.allclose(upe_attention(q, k, v, torch.zeros_like(rel), key_mask=key_mask), want, atol=1e-12)


def test_uniform_vector_is_the_same_for_every_query():
    """A slotted key's positional logit q_i . C[slot] does not depend on where the query is."""
    q, k, _, rel, uni, slot, _ = (x.detach() if torch.is_tensor(x) and x.requires_grad else x
                                  for x in make_inputs(1, 1, 10, 8, 2, 2))
    q = q[:, :, :1].expand(1, 1, 10, 8)                  # the same query content at every position
    logits = upe_logits(q, k, rel, uni, slot)
    j = int((slot[0] >= 0).nonzero()[0])
    assert torch.allclose(logits[0, 0, :, j], logits[0, 0, 0, j].expand(10))


def test_rpe_logits_are_invariant_to_shifting_the_operands():
    """Padding added on the left shifts every digit of both operands by the same amount; RPE's logits
    between the original tokens do not change (absolute positions would)."""
    task = TASKS["add_padded"]
    x = torch.tensor(task.encode(task.tokens(123, 4095, 8)[0]))            # (T,)
    shift = 5
    x2 = torch.cat([torch.full((shift,), task.vocab.index("#")), x])
    torch.manual_seed(0)
    emb, wq, wk = torch.randn(len(task.vocab), 16), torch.randn(16, 16), torch.randn(16, 16)
    rel = torch.randn(1, 2 * 4 + 1, 16)

    def logits(tokens, absolute=False):
        h = emb[tokens]
        if absolute:
            h = h + torch.sin(torch.arange(len(tokens))[:, None] / (1 + torch.arange(16)))
        return upe_logits((h @ wq)[None, None], (h @ wk)[None, None], rel)[0, 0]

    T = len(x)
    assert torch.allclose(logits(x2)[shift:, shift:], logits(x), atol=1e-5)
    assert not torch.allclose(logits(x2, True)[shift:, shift:], logits(x, True), atol=1e-2)
    assert T > 2 * 4                                                        # offsets beyond K are clipped too


def test_naive_backend_switch(monkeypatch):
    q, k, v, rel, uni, slot, key_mask = (x.detach() if x.dtype != torch.long and x.dtype != torch.bool else x
                                         for x in make_inputs(1, 2, 6, 8, 2, 2))
    monkeypatch.setattr(upe, "BACKEND", "naive")
    assert torch.allclose(upe_attention(q, k, v, rel, uni, slot, key_mask),
                          upe_attention_naive(q, k, v, rel, uni, slot, key_mask))


def test_slot_without_a_vector_is_an_error():
    q, k, v, rel, uni, slot, _ = make_inputs(1, 1, 6, 8, 2, 2)
    slot[0, 0] = 5
    with pytest.raises(ValueError, match="slot 5 has no uniform vector"):
        upe_attention(q, k, v, rel, uni, slot)


def cfg(**opts):
    return ModelConfig(vocab_size=14, d_model=32, n_heads=2, causal=False, opts=opts)


def test_layers_use_slot_and_key_mask():
    torch.manual_seed(0)
    layer = UPEAttention(cfg(rpe_clip=4, upe_slots=3))
    x = torch.randn(2, 9, 32)
    slot = torch.full((2, 9), -1)
    slot[:, 0] = 0
    key_mask = torch.ones(2, 9, dtype=torch.bool)
    key_mask[1, 7:] = False
    base = layer(x, {"slot": slot, "key_mask": key_mask})
    with torch.no_grad():
        layer.uni[:, 0] += 1.0
    assert not torch.allclose(layer(x, {"slot": slot, "key_mask": key_mask}), base)   # C[0] is used
    x2 = x.clone()
    x2[1, 7:] = 100.0                                                       # masked keys change nothing
    assert torch.allclose(layer(x2, {"slot": slot, "key_mask": key_mask})[1, :7],
                          layer(x, {"slot": slot, "key_mask": key_mask})[1, :7], atol=1e-5)
    assert RPEAttention(cfg(rpe_clip=4)).uni is None


def test_compiled_layers_run_the_pytorch_path_eagerly():
    """torch.compile leaves `upe_attention_torch` out of its graphs (compiled on CUDA in bfloat16, the UPE paper's
    RPE model diverged where eager training did not: docs/results/upe-compile). Traced with a backend that records
    each graph's calls and runs it as it is: the projections are compiled, the offset gather is not, and the
    output and gradients are the eager ones."""
    calls = []

    def record(gm, inputs):
        calls.append([str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")])
        return gm.forward
    torch.manual_seed(0)
    layer = UPEAttention(cfg(rpe_clip=4, upe_slots=3))
    x = torch.randn(2, 9, 32, requires_grad=True)
    slot = torch.full((2, 9), -1)
    slot[:, 0] = 0
    ctx = {"slot": slot, "slot_max": 0}
    eager = layer(x, ctx)
    grad = torch.autograd.grad(eager.square().sum(), [x, layer.rel, layer.uni])
    torch._dynamo.reset()
    out = torch.compile(layer, backend=record, dynamic=False)(x, ctx)
    torch._dynamo.reset()
    assert calls and not any("gather" in c for graph in calls for c in graph), calls
    assert any("linear" in c or "qkv" in c for graph in calls for c in graph), calls
    assert torch.allclose(out, eager, atol=1e-6)
    for a, b in zip(torch.autograd.grad(out.square().sum(), [x, layer.rel, layer.uni]), grad):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["torch", None])
def test_the_papers_rpe_model_trains_compiled(tmp_path, monkeypatch, backend):
    """upe-add's full RPE run (768 wide, 6 layers, head dim 96), 1000 steps compiled with CUDA graphs, on the
    PyTorch path or the default one (Triton). Compiled inside the graph, the PyTorch path diverged (the largest
    attention logit 2,000 by step 1k in a 30k-step run); in this test it reaches 135 by step 500 and 253 by 1000,
    where upe-add's full runs (not compiled) stay below 63 over 30k steps (8 seeds,
    docs/results/jobs-4gpu-upe-add-full), hence the bound of 100. The loss bound is above the 0.09 seen here (the
    1000-step schedule decays early) and below the 0.2-0.3 where training starts."""
    monkeypatch.setattr(upe, "BACKEND", backend)
    full = experiments.at_budget(experiments.EXPERIMENTS["upe-add"], "full")
    run = next(r for r in full.runs if r["method"] == "rpe")
    cfg = make_config({**run, "steps": 1000, "eval_every": 0, "test_lengths": [5], "n_eval": 64, "ckpt_every": 250,
                       "seed": 0, "device": "cuda", "out": str(tmp_path), "compile": True}, "gpu")
    train.train(cfg, log=lambda *_: None)
    m = json.loads((cfg.run_dir() / "metrics.json").read_text())
    late = [v for s, v in m["loss"] if s > 800]
    assert max(max(logits) for _, logits in m["logit_max"]) < 100, m["logit_max"]
    assert late and sum(late) / len(late) < 0.15, late


def test_layer_checks_the_batch_slots():
    """A 3-digit multiplier has slots 0-2: a model with 2 uniform vectors must refuse it. The layer
    reads the largest slot from ctx (taken on the CPU by batch_context, no device sync)."""
    import numpy as np
    from model import batch_context
    task = TASKS["mul_padded"]
    batch = task.sample(4, 5, np.random.default_rng(0), multiplier_digits=3)
    ctx = batch_context(task, batch, "cpu")
    assert ctx["slot_max"] == int(batch.slot.max()) == 2
    x = torch.randn(4, batch.x.shape[1], 32)
    UPEAttention(cfg(rpe_clip=4, upe_slots=3))(x, ctx)                    # fits
    with pytest.raises(ValueError, match=r"slot 2 has no uniform vector \(upe_slots = 2\)"):
        UPEAttention(cfg(rpe_clip=4, upe_slots=2))(x, ctx)


def test_cli_rejects_too_few_slots(capsys, tmp_path):
    code = main(["--task", "mul_padded", "--method", "upe", "--task-opt", "multiplier_digits=3",
                 "--method-opt", "upe_slots=2", "--out", str(tmp_path / "runs"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "slot 2 has no uniform vector (upe_slots = 2)" in err
    assert not (tmp_path / "runs").exists()


def test_cli_rejects_a_bad_clip(capsys, tmp_path):
    code = main(["--task", "add_padded", "--method", "rpe", "--method-opt", "rpe_clip=0",
                 "--out", str(tmp_path / "runs"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "rpe_clip must be an int >= 1, got 0" in err and not (tmp_path / "runs").exists()
