"""ViPE: the naive definition against explicit per-pair sums, the exact fast path against the naive
one (output and every gradient), the two identities the fast path rests on, and the layer.

Tolerances: float64 agrees to rounding (1e-10). float32: both paths round differently over a
softmax of up to 97 terms and a log(n) factor up to ~4.6 on the logits; ~1e-6 seen, 1e-4 allowed."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import model
import vipe
from model import ModelConfig
from cli import main
from vipe import ViPEAttention, vipe_attention, vipe_attention_naive

DEV = "cuda" if torch.cuda.is_available() else "cpu"

NAMES = ["q", "k", "v", "u", "w_p", "b_p"]


def make_inputs(B, H, T, D, Dv, dp, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=1.0: (s * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)  # noqa: E731
    xs = [r(B, H, T, D), r(B, H, T, D), r(B, H, T, Dv), r(H, D, s=0.3), r(H, dp), r(H, dp)]
    return [x.requires_grad_(True) for x in xs]


def run(fn, xs, dz, **kw):
    z = fn(*xs, **kw)
    return [z] + list(torch.autograd.grad(z, xs, dz, allow_unused=True))


def check(got, want, tol):
    for name, a, b in zip(["z"] + NAMES, got, want):
        if a is None and b is None:  # u without the rescaling
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        if b.numel() == 0:  # d_p = 0: no code parameters
            continue
        diff = (a.double() - b.double()).abs()
        bound = tol * max(1.0, b.abs().max().item())
        assert diff.max().item() <= bound, f"{name}: max {diff.max().item():.3e} mean {diff.mean().item():.3e}"


def test_naive_is_the_papers_formula():
    """eq. 7-9 written out per (n, i) with plain loops."""
    B, H, T, D, Dv, dp = 1, 2, 6, 4, 3, 2
    q, k, v, u, w_p, b_p = (x.detach() for x in make_inputs(B, H, T, D, Dv, dp))
    s = 1.5
    z = torch.zeros(B, H, T, Dv + dp, dtype=torch.float64)
    for h in range(H):
        for n in range(1, T + 1):
            logit = torch.stack([s * math.log(n) * (1 + u[h] @ k[0, h, i - 1]) * (q[0, h, n - 1] @ k[0, h, i - 1])
                                 / math.sqrt(D) for i in range(1, n + 1)])
            a = logit.softmax(0)
            for i in range(1, n + 1):
                code = w_p[h] * (n - i) / s + b_p[h]
                z[0, h, n - 1] += a[i - 1] * torch.cat([v[0, h, i - 1], code])
    assert torch.allclose(vipe_attention_naive(q, k, v, u, w_p, b_p, s), z, atol=1e-12)


def test_naive_gradcheck():
    xs = make_inputs(1, 1, 5, 3, 2, 2)
    assert torch.autograd.gradcheck(lambda *a: vipe_attention_naive(*a, s=2.0), xs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("T", [1, 7, 33, 97])
@pytest.mark.parametrize("D,Dv", [(16, 15), (16, 8), (16, 16), (32, 40)])
@pytest.mark.parametrize("s", [1.0, 2.0])
@pytest.mark.parametrize("rescale", [True, False])
def test_fast_matches_naive_float64(T, D, Dv, s, rescale):
    xs = make_inputs(2, 2, T, D, Dv, 4, seed=T + D)
    dz = torch.randn(2, 2, T, Dv + 4, dtype=torch.float64)
    check(run(vipe_attention, xs, dz, s=s, rescale=rescale),
          run(vipe_attention_naive, xs, dz, s=s, rescale=rescale), 1e-10)


@pytest.mark.parametrize("T", [1, 33, 97])
def test_fast_matches_naive_float32(T):
    xs = make_inputs(2, 3, T, 16, 15, 8, dtype=torch.float32, seed=T)
    dz = torch.randn(2, 3, T, 23)
    ref = run(vipe_attention_naive, [x.detach().double().requires_grad_(True) for x in xs], dz.double(), s=2.0)
    check(run(vipe_attention, xs, dz, s=2.0), ref, 1e-4)


def test_naive_takes_16_bit_inputs():
    """bf16 q, k, v (as under autocast) with float32 u, W_p, b_p: computed in float32, returned in
    bf16, within bf16 rounding of the float64 result."""
    q, k, v, u, w_p, b_p = (x.detach() for x in make_inputs(1, 2, 40, 16, 15, 4, seed=5))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = vipe_attention_naive(q, k, v, u.float(), w_p.float(), b_p.float(), s=2.0)
    want = vipe_attention_naive(q.double(), k.double(), v.double(), u, w_p, b_p, s=2.0)  # same inputs, float64
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2)   # the bf16 rounding of the output


def test_value_code_alone_and_rescaling_alone():
    q, k, v, u, w_p, b_p = (x.detach() for x in make_inputs(2, 2, 9, 8, 7, 3))
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    z = vipe_attention(q, k, v, u, w_p, b_p, rescale=False)
    assert torch.allclose(z[..., :7], plain, atol=1e-12)                     # no rescaling: plain logits
    z = vipe_attention(q, k, v, u, w_p[:, :0], b_p[:, :0], s=1.0)
    assert z.shape[-1] == 7                                                  # no code: values only


@pytest.mark.parametrize("s", [1.0, 2.0])
def test_u_zero_identities(s):
    """With u = 0 the value part is causal softmax attention with each query scaled by s log(n),
    and the code part is W_p (n - E[i]) / s + b_p under those same weights."""
    B, H, T, D, Dv, dp = 2, 2, 11, 8, 7, 3
    q, k, v, _, w_p, b_p = (x.detach() for x in make_inputs(B, H, T, D, Dv, dp))
    u = torch.zeros(H, D, dtype=torch.float64)
    z = vipe_attention(q, k, v, u, w_p, b_p, s)
    n = torch.arange(1, T + 1, dtype=torch.float64)
    qs = q * (s * torch.log(n))[:, None]
    assert torch.allclose(z[..., :Dv], F.scaled_dot_product_attention(qs, k, v, is_causal=True), atol=1e-12)
    logits = (qs @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    mean_i = logits.softmax(-1) @ n                                          # E[i], 1-based
    want = (n - mean_i)[..., None] / s * w_p[:, None] + b_p[:, None]
    assert torch.allclose(z[..., Dv:], want, atol=1e-12)


def test_s_is_a_distance_compression_and_a_logit_factor():
    """s acts twice, and a weight change undoes either half (docs/perf/vipe_s_halves.py rests on this):
    W_p x s gives the code its s = 1 values, q / s cancels the factor s on the logits; both together
    give s = 1 exactly, and either one alone does not."""
    q, k, v, u, w_p, b_p = (x.detach() for x in make_inputs(2, 2, 13, 8, 7, 3))
    s, Dv = 3.0, 7
    one = vipe_attention_naive(q, k, v, u, w_p, b_p, s=1.0)
    assert torch.allclose(vipe_attention_naive(q / s, k, v, u, s * w_p, b_p, s=s), one, atol=1e-12)
    logit_only = vipe_attention_naive(q, k, v, u, s * w_p, b_p, s=s)          # distances as at s = 1
    dist_only = vipe_attention_naive(q / s, k, v, u, w_p, b_p, s=s)           # logits as at s = 1
    assert torch.allclose(dist_only[..., :Dv], one[..., :Dv], atol=1e-12)     # same weights, same values
    assert not torch.allclose(dist_only[..., Dv:], one[..., Dv:], atol=1e-3)  # the code compressed
    assert not torch.allclose(logit_only[..., :Dv], one[..., :Dv], atol=1e-3)  # sharper weights


def test_backend_switch(monkeypatch):
    xs = [x.detach().float().to(DEV) for x in make_inputs(1, 2, 5, 8, 7, 2)]
    want = vipe_attention_naive(*xs)
    for backend in ("naive", "torch", "triton"):      # triton: through the interpreter on the CPU
        monkeypatch.setattr(vipe, "BACKEND", backend)
        assert torch.allclose(vipe_attention(*xs), want, atol=1e-5), backend
    monkeypatch.setattr(vipe, "BACKEND", "cuda")
    with pytest.raises(ValueError, match="unknown BACKEND 'cuda'"):
        vipe_attention(*xs)


# ---- the layer --------------------------------------------------------------------------------------

def cfg(**opts):
    return ModelConfig(vocab_size=10, d_model=32, n_heads=2, causal=True, method="vipe", opts=opts)


def test_layer_uses_s_as_given():
    """Training and evaluation alike (fine-tuning trains with the compressed distances); 1 by default."""
    torch.manual_seed(0)
    layer = ViPEAttention(cfg())
    with torch.no_grad():
        layer.u.normal_()
        layer.w_p.normal_()
    x = torch.randn(2, 10, 32)
    for training in (True, False):
        layer.train(training)
        assert torch.allclose(layer(x, {}), layer(x, {"s": 1.0}))
        assert not torch.allclose(layer(x, {"s": 3.0}), layer(x, {"s": 1.0}), atol=1e-3)


def test_the_three_rules_for_s():
    from vipe import compression
    assert [compression("fixed", L, 16, 48) for L in (8, 20, 48)] == [3.0, 3.0, 3.0]
    assert [compression("per_length", L, 16, 48) for L in (8, 20, 48)] == [1.0, 1.25, 3.0]
    assert [compression("one", L, 16, 48) for L in (8, 20, 48)] == [1.0, 1.0, 1.0]


def protocol_run(tmp_path, steps=4, **opts):
    """A tiny ViPE parity run on the CPU: trained to 16, tested at 8, 16 (the longest training length) and 48."""
    import cli
    return cli.make_config(dict(task="parity", method="vipe", device="cpu", steps=steps, opts=opts, lr=1e-2,
                                d_model=32, n_heads=1, n_layers=1, batch_size=4, n_eval=8, train_lengths=[16],
                                test_lengths=[8, 16, 48], out=str(tmp_path)), "cpu")


def test_the_papers_protocol_passes_the_intended_s(tmp_path, monkeypatch):
    """A ViPE run with vipe_s=fixed: s = 1 in training; the three rules evaluated at every length on the model as
    trained (the fixed s = 48 / 16 = 3, s per length, s = 1); then vipe_finetune steps with s = 3; then every
    length with s = 3 again. The layer records every s it sees, in training and in evaluation."""
    import train
    seen = []
    real = ViPEAttention.forward

    def spy(self, x, ctx=None):
        if model._probe is None:                                 # not the loop's logit probe
            seen.append((self.training, x.shape[1], float((ctx or {}).get("s", 1.0))))
        return real(self, x, ctx)
    monkeypatch.setattr(ViPEAttention, "forward", spy)
    metrics = train.train(protocol_run(tmp_path, vipe_finetune=3), log=lambda *_: None)
    trained = [s for training, _, s in seen if training]
    assert trained == [1.0] * 4 + [3.0] * 3                     # 1 layer: one call per step
    tested = [(T, s) for training, T, s in seen if not training]
    T16, T48 = 2 * 16 + 2, 2 * 48 + 2                         # [BoS] x [EoI] y: tokens per length
    # the lengths of one s share a padded pass: fixed; per length (1, 1, 3); s = 1; after fine-tuning, fixed
    assert tested == [(T48, 3.0), (T16, 1.0), (T48, 3.0), (T48, 1.0), (T48, 3.0)]
    named = {"s = L_test_max / L_train_max, no fine-tuning": [3.0, 3.0, 3.0],
             "s = L / L_train_max per length, no fine-tuning": [1.0, 1.0, 3.0], "s = 1, no fine-tuning": [1.0] * 3}
    assert {k: [r["s"] for r in rows] for k, rows in metrics["eval_ablations"].items()} == named
    assert all(r["model"] == "as trained" for rows in metrics["eval_ablations"].values() for r in rows)
    assert [(r["length"], r["s"], r["model"]) for r in metrics["eval"]] == \
        [(8, 3.0, "fine-tuned"), (16, 3.0, "fine-tuned"), (48, 3.0, "fine-tuned")]


def test_the_papers_reading_scores_every_length_on_the_fine_tuned_model(tmp_path, monkeypatch):
    """The paper's reading is one model's: its rows at the training lengths (8 and the longest, 16) come from
    the same weights as the row at 48, those after fine-tuning (model.pt), not the weights as trained (the
    checkpoint at the last step); the as-trained rows come from those. And the run's training accuracy, which
    the paper's 0.85 bar reads, is that of the fine-tuned model."""
    import train
    real = train.evaluate

    def fingerprint(net):
        return round(sum(p.double().sum().item() for p in net.parameters()), 9)

    def spy(net, *args, **kw):
        return [{**r, "weights": fingerprint(net)} for r in real(net, *args, **kw)]
    monkeypatch.setattr(train, "evaluate", spy)
    cfg = protocol_run(tmp_path, vipe_finetune=3)
    metrics = train.train(cfg, log=lambda *_: None)
    as_trained = torch.load(cfg.run_dir() / train.CKPT, weights_only=False)["model"]
    tuned = torch.load(cfg.run_dir() / "model.pt")
    fp = {name: round(sum(t.double().sum().item() for t in w.values() if t.is_floating_point()), 9)
          for name, w in (("trained", as_trained), ("tuned", tuned))}
    assert fp["trained"] != pytest.approx(fp["tuned"], abs=1e-9)
    assert [r["length"] for r in metrics["eval"]] == [8, 16, 48]
    assert [r["weights"] for r in metrics["eval"]] == pytest.approx([fp["tuned"]] * 3, abs=1e-6)
    for rows in metrics["eval_ablations"].values():
        assert [r["weights"] for r in rows] == pytest.approx([fp["trained"]] * 3, abs=1e-6)
    assert metrics["train_exact"] == pytest.approx(np.mean([r["exact"] for r in metrics["eval"][:2]]))


def test_the_fine_tuning_runs_at_the_final_rate_with_a_fresh_optimiser_by_default(tmp_path, monkeypatch):
    """Every fine-tuning step (the steps at s = 3) runs at the run's final learning rate, lr x min_lr_ratio, not
    its peak, on a new AdamW whose moments start at zero; vipe_ft_optim=continued keeps training's optimiser
    (its moments as training left them) and vipe_ft_lr sets the rate."""
    import train
    real = train.Step.__call__
    steps = []

    def spy(self, batch):
        if self.s != 1.0:
            group = self.opt.param_groups[0]
            steps.append((float(group["lr"]), id(self.opt), len(self.opt.state)))
        return real(self, batch)
    monkeypatch.setattr(train.Step, "__call__", spy)
    made = []
    real_opt = train.make_optimizer
    monkeypatch.setattr(train, "make_optimizer", lambda *a: made.append(real_opt(*a)) or made[-1])
    cfg = protocol_run(tmp_path / "a", vipe_finetune=3)
    train.train(cfg, log=lambda *_: None)
    final = cfg.lr * cfg.min_lr_ratio
    assert [lr for lr, _, _ in steps] == pytest.approx([final] * 3) and final < cfg.lr
    assert steps[0][1] == id(made[-1]) != id(made[0]) and steps[0][2] == 0          # fresh: no moments yet
    steps.clear(), made.clear()
    train.train(protocol_run(tmp_path / "b", vipe_finetune=3, vipe_ft_optim="continued", vipe_ft_lr=5e-3),
                log=lambda *_: None)
    assert [lr for lr, _, _ in steps] == pytest.approx([5e-3] * 3)
    assert len(made) == 1 and steps[0][1] == id(made[0]) and steps[0][2] > 0         # training's, with its moments


def test_the_fixed_s_can_be_set(tmp_path):
    """vipe_s_fixed=2 fine-tunes and tests with s = 2 at every length; the as-trained fixed rows carry it too."""
    import train
    metrics = train.train(protocol_run(tmp_path, vipe_finetune=2, vipe_s_fixed=2.0), log=lambda *_: None)
    assert [r["s"] for r in metrics["eval"]] == [2.0] * 3
    assert [r["s"] for r in metrics["eval_ablations"]["s = L_test_max / L_train_max, no fine-tuning"]] == [2.0] * 3


def test_a_ramped_fine_tuning_passes_s_rising_from_1_to_the_fixed_s(tmp_path, monkeypatch):
    """With vipe_ramp the fine-tuning's steps see s = 1 + 2 (k + 1) / 3 (k = 0, 1, 2), ending at the
    fixed s = 3 that the test then uses, and the log says so."""
    import cli
    import train
    seen = []
    real = ViPEAttention.forward

    def spy(self, x, ctx=None):
        if self.training and model._probe is None:
            seen.append(float((ctx or {}).get("s", 1.0)))
        return real(self, x, ctx)
    monkeypatch.setattr(ViPEAttention, "forward", spy)
    run = cli.make_config(dict(task="parity", method="vipe", device="cpu", steps=2,
                               opts={"vipe_finetune": 3, "vipe_ramp": True}, d_model=16, n_heads=1, n_layers=1,
                               batch_size=4, n_eval=2, train_lengths=[16], test_lengths=[48], out=str(tmp_path)), "cpu")
    lines = []
    metrics = train.train(run, log=lines.append)
    assert seen == pytest.approx([1.0, 1.0, 5 / 3, 7 / 3, 3.0])
    assert [(r["length"], r["s"]) for r in metrics["eval"]] == [(48, 3.0)]
    assert "  fine-tuned 3 steps with s = 3, ramped from 1" in lines


def test_layer_modes():
    assert ViPEAttention(cfg(vipe_mode="scale")).out.in_features == 2 * 15      # no code channels
    assert ViPEAttention(cfg(vipe_dp=4)).out.in_features == 2 * (15 + 4)
    with pytest.raises(ValueError, match="vipe_mode"):
        ViPEAttention(cfg(vipe_mode="magic"))


def test_cli_rejects_a_bad_method_option(capsys, tmp_path):
    code = main(["--task", "copy", "--method", "vipe", "--method-opt", "vipe_mode=magic",
                 "--out", str(tmp_path / "runs"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "vipe_mode must be one of" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()
    # a fine-tuning option where no fine-tuning runs: no fine-tuning steps, or a rule for s other than fixed
    for opts in (["vipe_s_also=2"], ["vipe_ft_optim=continued"], ["vipe_ft_lr=0.001"], ["vipe_ramp=true"],
                 ["vipe_s_also=2", "vipe_finetune=5", "vipe_s=per_length"]):
        code = main(["--task", "parity", "--method", "vipe", *[w for o in opts for w in ("--method-opt", o)],
                     "--out", str(tmp_path / "runs"), "--device", "cpu"])
        err = capsys.readouterr().err
        assert code == 2 and "sets the fine-tuning, which runs with vipe_s=fixed and vipe_finetune" in err, opts
    assert not (tmp_path / "runs").exists()


# ---- the Triton kernels around SDPA (interpreter on CPU, compiled on a GPU) ----------------------


@pytest.mark.parametrize("T", [1, 7, 97, 130])
@pytest.mark.parametrize("D,Dv,dp", [(16, 15, 8), (16, 8, 3), (32, 40, 8), (64, 63, 8)])
@pytest.mark.parametrize("rescale", [True, False])
def test_triton_matches_naive(T, D, Dv, dp, rescale):
    """float32 against the float64 naive path; strided q, k as the layer passes them."""
    xs = [x.detach().to(DEV) for x in make_inputs(2, 3, T, D, Dv, dp, dtype=torch.float32, seed=T + D)]
    qk = torch.stack(xs[:2], 2).transpose(2, 3).contiguous().transpose(2, 3)  # q, k views of one tensor
    xs = [x.requires_grad_(True) for x in [qk[:, :, 0], qk[:, :, 1]] + xs[2:]]
    assert not xs[0].is_contiguous()
    dz = torch.randn(2, 3, T, Dv + dp, device=DEV)
    ref = run(vipe_attention_naive, [x.detach().cpu().double().requires_grad_(True) for x in xs], dz.cpu().double(),
              s=2.0, rescale=rescale)
    got = run(vipe.vipe_attention_triton, xs, dz, s=2.0, rescale=rescale)
    check([None if g is None else g.cpu() for g in got], ref, 1e-4)


def test_triton_without_code_and_in_float16():
    xs = make_inputs(1, 2, 40, 16, 15, 0, dtype=torch.float32, seed=1)
    xs = [x.detach().to(DEV).requires_grad_(True) for x in xs]
    dz = torch.randn(1, 2, 40, 15, device=DEV)
    ref = run(vipe_attention_naive, [x.detach().cpu().double().requires_grad_(True) for x in xs], dz.cpu().double())
    check([None if g is None else g.cpu() for g in run(vipe.vipe_attention_triton, xs, dz)], ref, 1e-4)
    # float16 q, k, v (float32 parameters): within fp16 rounding of the float64 result, ~1e-3 seen
    xs = make_inputs(1, 2, 40, 16, 15, 4, dtype=torch.float32, seed=2)
    xs = [x.detach().to(DEV) for x in xs]
    xs = [x.half() if i < 3 else x for i, x in enumerate(xs)]
    got = vipe.vipe_attention_triton(*xs, s=2.0)
    assert got.dtype == torch.float16
    want = vipe_attention_naive(*[x.cpu().double() for x in xs], s=2.0)
    assert torch.allclose(got.cpu().double(), want, rtol=1e-2, atol=1e-2)


def errors(got, want):
    return [(a.double() - b).abs().max().item() for a, b in zip(got, want)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 333, 1024])
def test_triton_gpu(T):
    """The default CUDA path against the naive one in float64. float32: SDPA's own rounding, ~2e-5
    relative seen, 1e-3 allowed. bfloat16: the rounding of q', k' and of the index channel i (up to
    T) moves the logits and E[i] by far more than any tolerance worth stating (~20 % on dq with these
    random inputs, for both fast paths); so the Triton path must be no less accurate than the
    PyTorch-ops path on the same bf16 inputs (it computes its factors in float32, and was 0.4-1.15x
    its error when measured; 1.25x allowed)."""
    xs = make_inputs(2, 4, T, 64, 63, 8, dtype=torch.float32, seed=T)
    dz = torch.randn(2, 4, T, 71, device="cuda")
    ref = run(vipe_attention_naive, [x.detach().cuda().double().requires_grad_(True) for x in xs], dz.double(), s=2.0)
    f32 = [x.detach().cuda().requires_grad_(True) for x in xs]
    check(run(vipe_attention, f32, dz, s=2.0), ref, 1e-3)
    bf16 = [(x.detach().cuda().bfloat16() if i < 3 else x.detach().cuda()).requires_grad_(True) for i, x in enumerate(xs)]
    got = errors(run(vipe_attention, bf16, dz.bfloat16(), s=2.0), ref)
    torch_ops = errors(run(vipe.vipe_attention_torch, bf16, dz.bfloat16(), s=2.0), ref)
    for name, a, b in zip(["z"] + NAMES, got, torch_ops):
        assert a <= 1.25 * b + 1e-6, f"{name}: Triton path max error {a:.3e}, PyTorch ops {b:.3e}"


def test_the_layer_computes_its_logits_in_float32_under_autocast():
    """Under bf16 autocast the layer gives what it gives without autocast (to float32 rounding),
    logits included, where a bf16 layer is off by ~2^-8 of its large logits (docs/perf/vipe.md,
    "Long runs"). The check fails for a layer that lets autocast round q and k."""
    import model as M
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=10, d_model=32, n_layers=1, n_heads=2, causal=True, method="vipe")
    layer = ViPEAttention(cfg)
    with torch.no_grad():
        layer.qk.weight.mul_(8.0)                                   # logits in the thousands, as long runs grow them
        layer.u.normal_()
    x = torch.randn(2, 24, 32)
    xb = x.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, logit_mixed = layer(xb), M.largest_logits(layer, xb)
    ref, logit = layer(xb.float()), M.largest_logits(layer, xb.float())   # the same input, in float32
    assert logit[0] > 100 and mixed.dtype == torch.float32
    assert torch.allclose(mixed, ref, atol=1e-5), (mixed - ref).abs().max()
    assert logit_mixed[0] == pytest.approx(logit[0], rel=1e-6)


def test_the_bounded_codes_and_the_affine_logit_factor():
    """vipe_code and vipe_g (the paper's hypotheses beside eq. 8-9): the naive path against the pairwise
    formula; the PyTorch-ops path (E_n[i]) against the naive one for the code linear in i (over_n) and for g."""
    B, H, T, D, dp = 2, 2, 9, 8, 3
    q, k, v, u, w_p, b_p = [x.detach() for x in make_inputs(B, H, T, D, D - 1, dp)]
    n = torch.arange(1, T + 1, dtype=torch.float64)
    for code, want in (("tanh", lambda d: torch.tanh(d / (2.0 * vipe.TANH_SCALE))), ("over_n", lambda d: d / n[:, None])):
        z = vipe_attention_naive(q, k, v, u, w_p, b_p, s=2.0, code=code)
        zero_code = vipe_attention_naive(q, k, v, u, torch.zeros_like(w_p), torch.zeros_like(b_p), s=2.0, code=code)
        a_v = zero_code[..., :D - 1]                                       # the attention part is the code's own
        lin = vipe_attention_naive(q, k, v, u, w_p, b_p, s=2.0)
        assert torch.allclose(z[..., :D - 1], a_v) and torch.allclose(lin[..., :D - 1], a_v)
        d = want(n[:, None] - n[None, :]).tril()                           # (T, T) the code's distance
        logits = (q @ k.transpose(-1, -2) / math.sqrt(D)) * 2.0 * torch.log(n)[:, None] * \
            (1 + (k * u[:, None, :]).sum(-1))[..., None, :]
        a = logits.masked_fill(~model.causal_mask(T, "cpu"), -math.inf).softmax(-1)
        pos = (a * d).sum(-1)[..., None] * w_p[:, None, :] + b_p[:, None, :]
        assert torch.allclose(z[..., D - 1:], pos, atol=1e-10), code
    got = vipe.vipe_attention_torch(q, k, v, u, w_p, b_p, s=2.0, code="over_n", g=torch.tensor([2.5, 0.5]).double())
    want = vipe_attention_naive(q, k, v, u, w_p, b_p, s=2.0, code="over_n", g=torch.tensor([2.5, 0.5]).double())
    assert torch.allclose(got, want, atol=1e-10)
    assert torch.allclose(vipe_attention_naive(q, k, v, u, w_p, b_p, s=2.0, g=torch.tensor([2.0, 2.0]).double()),
                          vipe_attention_naive(q, k, v, u, w_p, b_p, s=2.0))
    assert torch.allclose(vipe_attention(q, k, v, u, w_p, b_p, s=2.0, code="tanh"),
                          vipe_attention_naive(q, k, v, u, w_p, b_p, s=2.0, code="tanh"))


def test_the_affine_layer_starts_as_g_of_s_equal_to_s():
    """vipe_g=affine learns a and b of g(s) = a s + b per head from a = 1, b = 0: at first the layer is the
    paper's at any s; with a = 0.5, b = 1 its logit factor at s = 3 is 2.5 (the code still compressed by 3)."""
    torch.manual_seed(0)
    plain, affine = ViPEAttention(cfg()), ViPEAttention(cfg(vipe_g="affine"))
    affine.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        plain.u.normal_(), affine.u.copy_(plain.u), plain.w_p.normal_(), affine.w_p.copy_(plain.w_p)
    x = torch.randn(2, 10, 32)
    assert torch.allclose(affine(x, {"s": 3.0}), plain(x, {"s": 3.0}), atol=1e-6)
    with torch.no_grad():
        affine.g_ab.copy_(torch.tensor([[0.5, 1.0]] * 2))
    assert not torch.allclose(affine(x, {"s": 3.0}), plain(x, {"s": 3.0}), atol=1e-4)
    B, T = x.shape[:2]
    q, k = affine.qk(x).view(B, T, 2, 2, 16).permute(2, 0, 3, 1, 4)
    v = affine.v(x).view(B, T, 2, 15).transpose(1, 2)
    z = vipe_attention_naive(q, k, v, affine.u, affine.w_p, affine.b_p, 3.0, g=torch.tensor([2.5, 2.5]))
    assert torch.allclose(affine(x, {"s": 3.0}), affine.out(z.transpose(1, 2).reshape(B, T, -1)), atol=1e-5)


def test_evaluations_during_training_make_the_papers_reading_on_a_copy(tmp_path):
    """With eval_every, each evaluation during training also fine-tunes a copy of the model with the fixed s and
    reads every length with it ("final", the paper's reading at that checkpoint); the run itself is untouched:
    its training losses and final rows are those of the same run without them."""
    import dataclasses
    import train
    plain = train.train(protocol_run(tmp_path / "a", steps=6, vipe_finetune=2), log=lambda *_: None)
    cfg = dataclasses.replace(protocol_run(tmp_path / "b", steps=6, vipe_finetune=2), eval_every=3)
    during = train.train(cfg, log=lambda *_: None)
    assert [h["step"] for h in during["history"]] == [3, 6]
    for h in during["history"]:
        assert [(r["length"], r["s"], r["model"]) for r in h["final"]] == \
            [(8, 3.0, "fine-tuned"), (16, 3.0, "fine-tuned"), (48, 3.0, "fine-tuned")]
        assert [r["s"] for r in h["eval"]] == [1.0] * 3
    assert during["loss"] == plain["loss"]
    assert [(r["exact"], r["token"]) for r in during["eval"]] == [(r["exact"], r["token"]) for r in plain["eval"]]
    assert [(r["exact"], r["token"]) for r in during["history"][-1]["final"]] == \
        [(r["exact"], r["token"]) for r in plain["eval"]]
    # with the run's own Adam moments (vipe_ft_optim=continued): the copy gets copies of them, fine-tunes with
    # them, and the run goes on with its own untouched (the same losses and final rows as without evaluations)
    cont = dict(steps=6, vipe_finetune=2, vipe_ft_optim="continued")
    plain_c = train.train(protocol_run(tmp_path / "d", **cont), log=lambda *_: None)
    during_c = train.train(dataclasses.replace(protocol_run(tmp_path / "e", **cont), eval_every=3), log=lambda *_: None)
    assert during_c["loss"] == plain_c["loss"]
    assert [(r["exact"], r["token"]) for r in during_c["eval"]] == [(r["exact"], r["token"]) for r in plain_c["eval"]]
    assert [(r["exact"], r["token"]) for r in during_c["history"][-1]["final"]] == \
        [(r["exact"], r["token"]) for r in plain_c["eval"]]
    fewer = train.train(dataclasses.replace(cfg, out=str(tmp_path / "c"), n_eval_during=2), log=lambda *_: None)
    assert {r["n"] for h in fewer["history"] for r in h["final"] + h["eval"]} == {2}      # during: n_eval_during
    assert {r["n"] for r in fewer["eval"]} == {8}                                        # the end: n_eval


@pytest.mark.parametrize("optim", ["fresh", "continued"])
def test_a_second_fixed_s_is_the_same_protocol_on_a_copy_of_the_trained_model(tmp_path, monkeypatch, optim):
    """vipe_s_also=2: the paper's protocol with s = 2 on a copy of the trained model, under eval_ablations: 3 steps
    with s = 2 on the copy, then 3 with s = 3 on the run's model. The copy's rows are those of a run with
    vipe_s_fixed=2 (the same training, the same fine-tuning steps from the same weights and moments), and the run's
    own reading is that of the run without the option: the copy's fine-tuning leaves the run's model and
    optimiser untouched."""
    import train
    real, tuning = train.Step.__call__, []

    def spy(self, batch):
        if self.s != 1.0:
            tuning.append((self.s, id(self.model)))
        return real(self, batch)
    monkeypatch.setattr(train.Step, "__call__", spy)
    quiet = dict(log=lambda *_: None)
    base = dict(vipe_finetune=3, vipe_ft_optim=optim)
    both = train.train(protocol_run(tmp_path / "a", **base, vipe_s_also=2.0), **quiet)
    assert [s for s, _ in tuning] == [2.0] * 3 + [3.0] * 3 and tuning[0][1] != tuning[-1][1]
    at3 = train.train(protocol_run(tmp_path / "b", **base), **quiet)
    at2 = train.train(protocol_run(tmp_path / "c", **base, vipe_s_fixed=2.0), **quiet)
    also = both["eval_ablations"]["s = 2, fine-tuned with it (vipe_s_also)"]
    assert [(r["length"], r["s"], r["model"]) for r in also] == [(L, 2.0, "fine-tuned") for L in (8, 16, 48)]
    assert [(r["exact"], r["token"]) for r in also] == [(r["exact"], r["token"]) for r in at2["eval"]]
    assert [(r["exact"], r["token"], r["s"]) for r in both["eval"]] == \
        [(r["exact"], r["token"], r["s"]) for r in at3["eval"]]
    weights = [torch.load(tmp_path / d / "parity" / "vipe" / "seed0" / "model.pt") for d in "ab"]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])
    assert set(both["eval_ablations"]) == set(at3["eval_ablations"]) | {"s = 2, fine-tuned with it (vipe_s_also)"}


def test_with_the_ramp_the_second_s_rises_to_it_too_and_its_reading_says_so(tmp_path, monkeypatch):
    """vipe_s_also=2 with vipe_ramp: the copy's 4 fine-tuning steps take s = 1.25, 1.5, 1.75, 2, then the run's own
    1.5, 2, 2.5, 3; the copy's reading is named as ramped, and its rows are at s = 2."""
    import train
    real, tuning = train.Step.__call__, []

    def spy(self, batch):
        if self.s != 1.0:
            tuning.append(self.s)
        return real(self, batch)
    monkeypatch.setattr(train.Step, "__call__", spy)
    got = train.train(protocol_run(tmp_path, vipe_finetune=4, vipe_ramp=True, vipe_s_also=2.0), log=lambda *_: None)
    assert tuning == pytest.approx([1.25, 1.5, 1.75, 2.0, 1.5, 2.0, 2.5, 3.0])
    also = got["eval_ablations"]["s = 2, fine-tuned with it ramped from 1 (vipe_s_also)"]
    assert {r["s"] for r in also} == {2.0} and {r["s"] for r in got["eval"]} == {3.0}
