"""Generic tests of every encoding in train.METHODS (CPU): a method added to the registry gets
them without further changes. The method-specific tests (naive against fast paths, gradients)
live in each method's own test file."""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cli
import path_attention
import prism
import train
import upe
import vipe
from model import Method, Model, ModelConfig, autocast, batch_context, largest_logits
from tasks import IGNORE, TASKS, TrainBatches, sample_mixed

METHODS = list(train.METHODS)
BIDIRECTIONAL = [m for m in METHODS if not train.METHODS[m].causal_only]


def tiny_model(method: str | Method, causal=True, seed=0, vocab=10, **opts):
    torch.manual_seed(seed)
    spec = train.METHODS[method] if isinstance(method, str) else method
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, causal=causal, opts=opts,
                      method=method if isinstance(method, str) else "nope")
    return Model(cfg, spec)


@pytest.mark.parametrize("method", METHODS)
def test_causal_models_never_look_ahead(method):
    model = tiny_model(method).eval()
    x = torch.randint(0, 10, (2, 12))
    x2 = x.clone()
    x2[:, 8:] = (x2[:, 8:] + 1) % 10
    a, b = model(x), model(x2)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:], atol=1e-3)


@pytest.mark.parametrize("method", BIDIRECTIONAL)
def test_bidirectional_models_ignore_masked_keys(method):
    """With a key mask, what stands at masked positions never reaches the others; without the
    mask it does (so the model does read those positions when allowed to)."""
    model = tiny_model(method, causal=False).eval()
    x = torch.randint(0, 10, (2, 12))
    x2 = x.clone()
    x2[:, 9:] = (x2[:, 9:] + 1) % 10                  # the last three positions: padding
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[:, 9:] = False
    a, b = model(x, {"key_mask": mask}), model(x2, {"key_mask": mask})
    assert torch.allclose(a[:, :9], b[:, :9], atol=1e-5), (a[:, :9] - b[:, :9]).abs().max()
    assert not torch.allclose(model(x)[:, :9], model(x2)[:, :9], atol=1e-3)


@pytest.mark.parametrize("method", METHODS)
def test_state_dict_round_trip(method):
    """A model of another seed that loads the state dict (strictly: same keys) computes the same."""
    a, b = tiny_model(method, seed=0).eval(), tiny_model(method, seed=1).eval()
    x = torch.randint(0, 10, (2, 9))
    assert not torch.allclose(a(x), b(x))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("method", METHODS)
def test_unknown_method_options_are_refused(method):
    """--method-opt keys a method does not declare are one-line errors that name its options."""
    cfg = cli.make_config(dict(task="copy", method=method, device="cpu", opts={"no_such_option": 1}), "cpu")
    with pytest.raises(cli.UsageError, match=r"has no option 'no_such_option' \(--method-opt\); its options: "):
        cli.validate(cfg)


def learn_copy(method: str | Method, causal, device="cpu"):
    """100 steps of a tiny model on copy (lengths 1-3), with train.py's autocast: the losses, after
    checking that every gradient is finite."""
    task = TASKS["copy"]
    model = tiny_model(method, causal, vocab=len(task.vocab)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(100):
        batch = sample_mixed(task, 32, [1, 2, 3], rng)
        with autocast(device):
            logits = model(batch.x.to(device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.y.to(device).flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for name, p in model.named_parameters()
                   if not name.endswith(".uni")), method  # UPE's slot vectors: copy has no slots
        opt.step()
        losses.append(loss.item())
    return losses


def learned(losses) -> bool:
    """The bound of the learning tests: the loss falls to under 0.45 of its initial value (~ln 12).
    The slowest encodings (nope, alibi: no way to tell positions apart exactly) reach about 0.37."""
    return np.mean(losses[-10:]) < 0.45 * np.mean(losses[:5])


@pytest.mark.parametrize("method", METHODS)
def test_methods_learn_in_their_modes(method):
    """Forward and backward in causal and (where the method allows) bidirectional mode; a tiny
    model learns copy (lengths 1-3) within 100 steps."""
    for causal in (True,) if train.METHODS[method].causal_only else (True, False):
        losses = learn_copy(method, causal)
        assert learned(losses), (method, causal, losses[:5], losses[-10:])


class NoAttention(nn.Module):
    """An attention layer that reads nothing: each position sees only its own token."""

    def __init__(self, cfg):
        super().__init__()
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x, ctx):
        return 0 * self.out(x)


def test_the_learning_bound_fails_without_attention():
    """The bound above can fail: a model whose attention reads nothing does not meet it."""
    losses = learn_copy(Method(NoAttention), causal=True)
    assert not learned(losses), (losses[:5], losses[-10:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", METHODS)
def test_methods_learn_on_the_gpu(method):
    """The same on CUDA under bf16 autocast, where the methods take their Triton paths, with the
    same bound as on the CPU."""
    for causal in (True,) if train.METHODS[method].causal_only else (True, False):
        losses = learn_copy(method, causal, "cuda")
        assert learned(losses), (method, causal, losses[:5], losses[-10:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method,opts,compiled", [(m, {}, False) for m in METHODS]
                         + [("prism", {"prism_copy": True}, False), ("prism", {}, True)])
def test_cuda_graph_steps_follow_the_eager_steps(method, opts, compiled):
    """train.Step with CUDA graphs (padded batches, each padded length captured once and replayed)
    against the eager step from the same initialisation: 12 steps of copy, every third of lengths
    20-24 and the others of lengths 1-6 (two padded lengths, whose graphs share one memory pool,
    replayed in turn); PRISM also with its copy branch, and compiled (--compile: its graph breaks make some
    frames compile on the model's second call, which must not come inside a capture). Tolerance: bf16 autocast
    in both, the padded batches' kernels sum in another order, and the difference grows with each
    update.

    Every parameter with a gradient must also move as far under graphs as eagerly (AdamW moves each weight by
    about the learning rate per step whatever its gradient, so the two distances agree well within 2x): a replay
    that restored some weights to their values at capture would move them by one step only. A parameter whose
    true gradient is zero (FIRE's last MLP bias shifts every logit of a row alike, which softmax ignores) moves
    by Adam-normalised rounding noise alone, differently each way: those, with a float32 gradient on the first
    batch below 1e-7 of the largest one, are left out of that check (measured on the CPU: such a bias's
    gradient is 4e-11-7e-11 of the largest, the smallest real one, FIRE's c, 1.6e-6)."""
    task = TASKS["copy"] if train.METHODS[method].causal_only else TASKS["add_padded"]
    losses, moved = [], []
    live = None                                    # the parameters with a gradient, from the eager model below
    for graphs in (False, True):
        cfg = cli.make_config(dict(task=task.name, method=method, device="cuda", d_model=64, n_heads=2,
                                   n_layers=2, batch_size=16, graphs=graphs, compile=compiled and graphs,
                                   opts=opts), "gpu")
        cli.validate(cfg)
        cfg.model.vocab_size, cfg.model.causal = len(task.vocab), task.causal
        torch.manual_seed(0)
        model = train.build_model(cfg.model).cuda()
        opt = train.make_optimizer(model, cfg, "cuda")
        step = train.Step(model, train.compiled(model) if cfg.compile else model, opt, cfg, task, "cuda")
        if task.name == "copy":
            short, long = (TrainBatches(task, lengths, 16, 0, 12) for lengths in ([1, 2, 3, 4, 5, 6], [20, 24]))
            data = [long[s] if s % 3 == 2 else short[s] for s in range(12)]
        else:
            data = TrainBatches(task, task.train_lengths, 16, 0, 12)
        if live is None:                           # a float32 gradient on the first batch, at the initial weights
            b = data[0]
            logits = model(b.x.cuda(), batch_context(task, b, "cuda")).float()
            F.cross_entropy(logits.flatten(0, 1), b.y.cuda().flatten(), ignore_index=IGNORE).backward()
            norms = {name: 0.0 if p.grad is None else p.grad.norm().item() for name, p in model.named_parameters()}
            live = {name for name, v in norms.items() if v > 1e-7 * max(norms.values())}
            opt.zero_grad(set_to_none=True)
        start = {name: p.detach().clone() for name, p in model.named_parameters()}
        losses.append(torch.stack([step(data[s]) for s in range(12)]).tolist())
        moved.append({name: (p.detach() - start[name]).norm().item() for name, p in model.named_parameters()})
        if graphs:
            assert len(step.graphs) >= 1 and len(step.graphs) < 12, "the check needs replays"
            held = torch.cuda.memory_reserved()
            step.release()                                   # the graphs' pool goes back to the driver
            assert torch.cuda.memory_reserved() < held
    assert np.allclose(losses[0], losses[1], rtol=0.05, atol=0.02), losses
    far = {name: (eager, moved[1][name]) for name, eager in moved[0].items()
           if name in live and eager > 0 and not 0.5 < moved[1][name] / eager < 2}
    assert not far, far


@pytest.mark.parametrize("forced", [None, "naive"])
@pytest.mark.parametrize("method", METHODS)
def test_the_logit_probe_hears_every_attention_layer(method, forced, monkeypatch):
    """largest_logits reports a finite, positive value per attention call, at least one per block,
    for every encoding (a method whose PyTorch path does not report its logits fails here), and
    leaves the model in training mode; also where a module's BACKEND forces another path."""
    for module in (path_attention, prism, upe, vipe):
        monkeypatch.setattr(module, "BACKEND", forced)
    model = tiny_model(method)
    values = largest_logits(model, torch.randint(0, 10, (2, 12)))
    assert len(values) >= model.cfg.n_layers and all(0 < v < float("inf") for v in values), values
    assert model.training


def test_the_logit_probe_reads_vipes_rescaled_logits():
    """ViPE's probe value is the largest |s log(n) (1 + u.k_i) q_n.k_i / sqrt(D)| over i <= n, the
    logit written out from the layer's own q and k (with a key factor u that matters)."""
    model = tiny_model("vipe")
    layer = model.blocks[0].attn
    with torch.no_grad():
        layer.u.normal_()
    seen = {}
    hook = layer.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    first = largest_logits(model, torch.randint(0, 10, (2, 12)))[0]
    hook.remove()
    B, T, _ = seen["x"].shape
    with torch.no_grad():
        q, k = layer.qk(seen["x"]).view(B, T, 2, layer.H, layer.D).permute(2, 0, 3, 1, 4)   # 2 x (B, H, T, D)
        lam = torch.log(torch.arange(1, T + 1.0))[:, None] * (1 + (k * layer.u[:, None]).sum(-1))[..., None, :]
        logits = lam * (q @ k.mT) / layer.D ** 0.5                                          # (B, H, T, T)
    want = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), 0).abs().max()
    assert first == pytest.approx(float(want), rel=1e-5)


def test_rope_rotates_pair_i_by_t_times_base_to_the_minus_2i_over_d():
    """RoPE's angles against the standard definition, with values worked out by hand: D = 8, base 10^4, so pair i
    (channels i and i + 4) turns by t * 10^(-i) at position t. A unit vector in channel i at t = 2 (pairs 0 and
    1) or t = 5 (pairs 2 and 3) comes out as (cos, sin) of that angle in channels i and i + 4. The relative-
    position property holds for any frequencies, so it cannot pin them; these values do."""
    from model import rotary
    want = {(2, 0): (-0.4161468365471424, 0.9092974268256817),   # angle 2
            (2, 1): (0.9800665778412416, 0.19866933079506122),   # angle 0.2
            (5, 2): (0.9987502603949663, 0.04997916927067833),   # angle 0.05
            (5, 3): (0.9999875000260416, 0.004999979166692708)}  # angle 0.005
    for (t, i), (c, s) in want.items():
        e = torch.zeros(1, 1, 6, 8)
        e[0, 0, t, i] = 1.0
        out = rotary(e, 10_000.0)[0, 0, t]
        expect = torch.zeros(8)
        expect[i], expect[i + 4] = c, s
        assert torch.allclose(out, expect, atol=1e-6), (t, i, out)
