"""The shared model, the baselines, the training loop, evaluation, resume and the CLI (CPU)."""
import json
import multiprocessing
from dataclasses import replace
from pathlib import Path
import math
import pickle
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cli
import jobs
import experiments
import tasks
import train
from tasks import IGNORE, TASKS, sample_mixed
from model import AlibiBias, ModelConfig, T5Bias, attend, largest_logits, rotary
from cli import main, make_config
from evaluation import evaluate, save_atomic, score, score_by_offset, summary_line
from train import TrainConfig, build_model


def tiny_config(tmp_path, **kw):
    values = dict(task="copy", method="rope", steps=20, batch_size=8, d_model=32, n_layers=1, n_heads=2,
                  n_eval=8, test_lengths=[2, 4], train_lengths=[1, 2, 3], out=str(tmp_path), device="cpu",
                  log_every=1e9, ckpt_every=5, warmup=2)
    values.update(kw)
    return make_config(values, "cpu")


# ---- the attention baselines ------------------------------------------------------------------

def test_attend_matches_explicit_softmax():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 7, 8, dtype=torch.float64).unbind(0)
    bias = torch.randn(2, 7, 7, dtype=torch.float64)
    key_mask = torch.rand(2, 7) > 0.3
    key_mask[:, 0] = True
    for causal in (True, False):
        logits = q @ k.transpose(-1, -2) / math.sqrt(8) + bias
        if causal:
            logits = logits.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), -math.inf)
        logits = logits.masked_fill(~key_mask[:, None, None], -math.inf)
        ref = logits.softmax(-1) @ v
        out = attend(q, k, v, causal, bias, key_mask)
        assert torch.allclose(out, ref, atol=1e-12), (out - ref).abs().max()


def test_rope_logits_depend_only_on_offset():
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 16, dtype=torch.float64).unbind(0)
    T = 12
    qs, ks = rotary(q.expand(1, 1, T, 16), 10000.0), rotary(k.expand(1, 1, T, 16), 10000.0)
    logits = (qs @ ks.transpose(-1, -2))[0, 0]                 # (T, T): same q and k at every position
    for offset in range(-5, 6):
        diag = torch.diagonal(logits, offset)
        assert torch.allclose(diag, diag[0].expand_as(diag), atol=1e-12)
    assert not torch.allclose(torch.diagonal(logits, 0)[0], torch.diagonal(logits, 3)[0])


def test_alibi_and_t5_biases():
    cfg = ModelConfig(n_heads=4, causal=True)
    alibi = AlibiBias(cfg)(6, "cpu")
    assert torch.allclose(alibi[0, 5, 2], torch.tensor(-3 * 2 ** -2.0))   # slope 2^(-8/4) for head 1
    assert torch.allclose(alibi[3, 4, 1], torch.tensor(-3 * 2 ** -8.0))
    t5 = T5Bias(ModelConfig(n_heads=2, causal=False, t5_buckets=32, t5_max_distance=128))
    rel = torch.tensor([0, 1, 7, 8, 100, 1000, -1, -1000])
    b = t5.bucket(rel).tolist()
    assert b[:4] == [0, 1, 7, 8] and b[4] < 16 and b[5] == 15       # exact, then logarithmic, then capped
    assert b[6] == 17 and b[7] == 31                                 # keys after the query: upper half


def test_ape_random_shift_only_in_training():
    cfg = ModelConfig(vocab_size=5, d_model=16, n_heads=2, method="ape", ape_shift=50)
    model = build_model(cfg)
    x = torch.zeros(4, 6, dtype=torch.long)
    model.eval()
    assert torch.equal(model(x), model(x))
    model.train()
    torch.manual_seed(0)
    out = model(x)
    assert not torch.allclose(out[0], out[1])   # different random offsets per sequence


# ---- evaluation -------------------------------------------------------------------------------

def test_score_counts_supervised_positions_only():
    y = torch.tensor([[IGNORE, 1, 2], [IGNORE, 1, 2], [IGNORE, IGNORE, IGNORE]])
    pred = torch.tensor([[0, 1, 2], [2, 1, 0], [1, 1, 1]])
    exact, right, sup, last = score(F.one_hot(pred, 3).float(), y)
    assert exact.tolist() == [True, False, True] and right.tolist() == [2, 1, 0] and sup.tolist() == [2, 2, 0]
    assert last.tolist() == [True, False, False]             # the last supervised position; none in row 3


def test_the_final_answer_is_the_last_supervised_position_before_eos():
    """With eos = 2 the final answer of [_, 1, 2] is the 1 at position 1: right in the second row, whose
    <eos> is wrong, and wrong in the third, whose <eos> is right; a row with nothing else supervised has none."""
    y = torch.tensor([[IGNORE, 1, 2], [IGNORE, 1, 2], [IGNORE, 1, 2], [IGNORE, IGNORE, 2]])
    pred = torch.tensor([[0, 1, 2], [0, 1, 0], [0, 0, 2], [0, 0, 2]])
    exact, right, sup, last = score(F.one_hot(pred, 3).float(), y, eos=2)
    assert exact.tolist() == [True, False, False, True] and last.tolist() == [True, True, False, False]


def test_score_by_offset_counts_back_from_each_rows_last_supervised_position():
    """Row 1 ends at position 3, row 2 (right-padded) at 2: offset 0 is position 3 in one and 2 in the other."""
    y = torch.tensor([[IGNORE, 1, 2, 0], [IGNORE, 2, 1, IGNORE]])
    pred = torch.tensor([[0, 1, 0, 0], [0, 0, 1, 0]])
    right, sup = score_by_offset(F.one_hot(pred, 3).float(), y)
    assert right.tolist() == [[True, False, True, False], [True, False, False, False]]
    assert sup.tolist() == [[True, True, True, False], [True, True, False, False]]


class _Always(torch.nn.Module):
    """A model that predicts one token everywhere."""
    def __init__(self, token, vocab_size):
        super().__init__()
        self.token, self.vocab_size = token, vocab_size

    def forward(self, x, ctx):
        return F.one_hot(torch.full_like(x, self.token), self.vocab_size).float()


@pytest.mark.parametrize("opts", [{}, {"multiplier_low": 1}])
def test_evaluate_by_offset_locates_the_digits_of_padded_products(opts):
    """A model that always says '#' is right exactly where the product is padding: never at offset 0 (a
    product keeps its last digit), always from offset k + 3 on (k digits times at most 3 have at most k + 3),
    and the offsets reach the answer's whole width (20 + 3) whatever the multiplier's length."""
    task = TASKS["mul_padded"]
    rows = evaluate(_Always(task.stoi["#"], len(task.vocab)), task, [2, 5], n=64, seed=0, device="cpu",
                    task_opts=opts, precision="fp32")
    for r in rows:
        k, acc = r["length"], r["by_offset"]
        assert len(acc) == 23 and acc[0] == 0.0 and all(a == 1.0 for a in acc[k + 3:])
        assert 0 < sum(acc[:k + 3]) < k + 3                    # the top digits are sometimes padding
    assert "by_offset" not in evaluate(_Always(0, len(TASKS["copy"].vocab)), TASKS["copy"], [4], n=8, seed=0,
                                       device="cpu", precision="fp32")[0]


def trained_model(task, lengths, steps, seed=0, d=32):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(vocab_size=len(task.vocab), d_model=d, n_layers=2, n_heads=2, method="rope"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        batch = sample_mixed(task, 32, lengths, rng)
        loss = F.cross_entropy(model(batch.x).flatten(0, 1), batch.y.flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@torch.no_grad()
def greedy_decode(model, task, batch, device="cpu") -> torch.Tensor:
    """Reference for the teacher-forced metric: decode token by token, feeding the model's own
    prediction back at every supervised position (the task's tokens elsewhere). Returns (B,)
    exact match. Quadratic in T."""
    assert task.causal, "greedy decoding is defined for causal tasks"
    x, y = batch.x.to(device), batch.y.to(device)
    seq = x.clone()
    correct = torch.ones(len(x), dtype=torch.bool, device=device)
    for t in range(x.shape[1]):
        pred = model(seq[:, : t + 1])[:, -1].argmax(-1)          # (B,)
        sup = y[:, t] != IGNORE
        correct &= ~sup | (pred == y[:, t])
        if t + 1 < x.shape[1]:
            seq[:, t + 1] = torch.where(sup, pred, x[:, t + 1])
    return correct


@pytest.mark.parametrize("name,lengths,steps", [("copy", [1, 2, 3, 4, 5], 150), ("flipflop", [6], 40)])
def test_teacher_forced_exact_match_equals_greedy_decoding(name, lengths, steps):
    task = TASKS[name]
    model = trained_model(task, lengths, steps)
    batch = sample_mixed(task, 96, lengths, np.random.default_rng(7))
    with torch.no_grad():
        exact, _, _, _ = score(model(batch.x), batch.y)
    greedy = greedy_decode(model, task, batch)
    assert torch.equal(exact, greedy)
    assert 0 < exact.sum() < len(exact), "the check needs both right and wrong sequences"


def test_evaluate_reports_each_length_and_variant():
    task = TASKS["flipflop"]
    model = build_model(ModelConfig(vocab_size=len(task.vocab), d_model=16, n_layers=1, n_heads=2, method="nope"))
    rows = evaluate(model, task, [8], 16, 0, "cpu")
    assert [r["name"] for r in rows] == ["ID", "sparse", "dense"]
    rows2 = evaluate(model, task, [8], 16, 0, "cpu")
    assert rows == rows2                               # its own generator: the same examples each time
    copy = TASKS["copy"]
    model = build_model(ModelConfig(vocab_size=len(copy.vocab), d_model=16, n_layers=1, n_heads=2, method="nope"))
    rows = evaluate(model, copy, [1, 3], 8, 0, "cpu")
    assert [r["length"] for r in rows] == [1, 3] and all(0 <= r["token"] <= 1 for r in rows)


def test_evaluation_out_of_gpu_memory_runs_in_smaller_passes():
    """A forward pass of more than 3 examples raises torch.OutOfMemoryError: evaluate splits the
    passes (across lengths, then within one length) and counts the same examples the same way."""
    task = TASKS["copy"]
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=len(task.vocab), d_model=16, n_layers=1, n_heads=2, method="rope"))
    rows = evaluate(model, task, [1, 3, 5], 8, 0, "cpu")
    forward, sizes = model.forward, []

    def small_memory(x, ctx):
        sizes.append(len(x))
        if len(x) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(x, ctx)
    model.forward = small_memory
    assert evaluate(model, task, [1, 3, 5], 8, 0, "cpu") == rows
    assert sizes[0] == 24 and sum(s for s in sizes if s <= 3) == 24 and 16 in sizes and 4 in sizes
    model.forward = lambda x, ctx: (_ for _ in ()).throw(torch.OutOfMemoryError("always"))
    with pytest.raises(torch.OutOfMemoryError):        # down to one example, the error is raised
        evaluate(model, task, [1], 2, 0, "cpu")


def test_schedule_and_curriculum():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert train.lr_at(0, cfg) == pytest.approx(0.1) and train.lr_at(9, cfg) == pytest.approx(1.0)
    assert train.lr_at(100, cfg) == pytest.approx(0.1)
    assert train.lr_at(55, cfg) == pytest.approx(0.55)
    lengths = list(range(1, 41))
    caps = [max(tasks.curriculum_lengths(s, cfg.steps, lengths)) for s in range(0, 100, 5)]
    assert caps[0] == 5 and caps == sorted(caps) and caps[-1] == 40 and 10 in caps


def test_curriculum_on_the_prism_papers_schedule():
    """Section 6.4: length 5 for 5k steps, 10 for the next 5k, then 10 more every 10k steps, whatever
    the run's length; and through TrainBatches, the batches of those steps keep to the cap."""
    cap = lambda step: max(tasks.curriculum_lengths(step, 150_000, list(range(1, 41)), 5000))  # noqa: E731
    assert [cap(s) for s in (0, 4999, 5000, 9999, 10_000, 19_999, 20_000, 30_000, 40_000, 149_999)] == \
        [5, 5, 10, 10, 20, 20, 30, 40, 40, 40]
    stream = tasks.TrainBatches(tasks.TASKS["copy"], list(range(1, 41)), 8, 0, 150_000, curriculum=True,
                                curriculum_steps=5000)
    assert int(stream[4999].length.max()) <= 5 < int(max(stream[s].length.max() for s in range(20_000, 20_010)))


# ---- training: outputs, resume, NaN -----------------------------------------------------------

def test_train_writes_metrics_and_model(tmp_path):
    cfg = tiny_config(tmp_path)
    metrics = train.train(cfg, log=lambda *_: None)
    out = cfg.run_dir()
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["eval"] == metrics["eval"] and [r["length"] for r in saved["eval"]] == [2, 4]
    assert saved["config"]["model"]["n_layers"] == 1 and saved["seed"] == 0 and saved["git"]
    assert len(saved["loss"]) == 20 and saved["loss"][-1][0] == 20
    state = torch.load(out / "model.pt")
    model = build_model(ModelConfig(**saved["config"]["model"]))
    model.load_state_dict(state)
    assert not list(out.glob("*.tmp"))


def test_the_largest_logit_is_logged_at_every_checkpoint(tmp_path):
    """metrics["logit_max"]: [step, one value per attention call] at each checkpoint (every 5 steps
    here), the same values the probe gives for the saved model at the end, and the progress line
    shows the latest."""
    cfg = tiny_config(tmp_path, log_every=0.0)
    lines = []
    metrics = train.train(cfg, log=lines.append)
    assert [s for s, _ in metrics["logit_max"]] == [5, 10, 15, 20]
    model = build_model(cfg.model)
    model.load_state_dict(torch.load(cfg.run_dir() / "model.pt"))
    probe = TASKS["copy"].sample(16, 3, np.random.default_rng([0, 3]))
    assert metrics["logit_max"][-1][1] == pytest.approx(largest_logits(model, probe.x), rel=1e-6)
    assert metrics["logit_max"][0][1] != metrics["logit_max"][-1][1]          # it follows the training
    assert f"logit max {max(metrics['logit_max'][-1][1]):.3g}" in [x for x in lines if "step     20/" in x][0]


@pytest.mark.parametrize("slow", [False, True])
def test_a_slow_checkpoint_write_is_skipped_until_its_share_of_the_time_allows(tmp_path, monkeypatch, slow):
    """Fast writes: a checkpoint every ckpt_every steps. A write of 0.4 s (a large model's): the next periodic
    one waits (0.4 - 0.1) / CKPT_SHARE = 10 s, so only the first and the last step's are written."""
    written, real = [], train.save_atomic

    def save(obj, path, **kw):
        if path.name == train.CKPT:
            written.append(obj["step"])
            time.sleep(0.4 if slow else 0.0)
        real(obj, path, **kw)
    monkeypatch.setattr(train, "save_atomic", save)
    monkeypatch.setattr(train, "CKPT_SHARE", 0.03)
    train.train(tiny_config(tmp_path, steps=30), log=lambda *_: None)
    assert written == ([5, 30] if slow else [5, 10, 15, 20, 25, 30])


def test_metrics_keep_the_highest_loss_of_every_stretch(tmp_path, monkeypatch):
    """With more steps than kept losses, "loss" keeps every stride-th step and "loss_peak" the
    highest loss of each stride, so a one-step spike between two kept steps still shows."""
    cfg = tiny_config(tmp_path, steps=1200, ckpt_every=600)
    real = train.Step.__call__

    def spiky(self, batch):               # step 1004 reports a spike (its update is the real one)
        spiky.calls += 1
        return real(self, batch) + (100.0 if spiky.calls == 1004 else 0.0)
    spiky.calls = 0
    monkeypatch.setattr(train.Step, "__call__", spiky)
    metrics = train.train(cfg, log=lambda *_: None)
    assert [s for s, _ in metrics["loss"]][:3] == [1, 3, 5] and len(metrics["loss_peak"]) == 600
    assert max(v for _, v in metrics["loss"]) < 100 and max(metrics["loss_peak"], key=lambda x: x[1])[0] == 1004


def largest_adam_update(eps: float, plateau: float, burst: float, steps: int) -> float:
    """The largest change of a weight, in learning rates, over `steps` steps of AdamW (the loop's
    optimiser) with gradient `burst`, after 3000 steps with gradient `plateau` (a loss at ~zero)."""
    cfg = TrainConfig(lr=1e-3, weight_decay=0.0, adam_eps=eps)
    model = torch.nn.Linear(4, 4, bias=False)
    opt = train.make_optimizer(model, cfg, "cpu")
    model.weight.grad = torch.full_like(model.weight, plateau)
    for _ in range(3000):
        opt.step()
    model.weight.grad = torch.full_like(model.weight, burst)
    moves = []
    for _ in range(steps):
        before = model.weight.detach().clone()
        opt.step()
        moves.append(float((model.weight.detach() - before).abs().max()) / cfg.lr)
    return max(moves)


def test_adam_takes_no_large_step_when_gradients_return_after_vanishing():
    """The mechanism behind long runs' loss spikes (docs/perf/vipe.md, "Long runs"): after thousands
    of steps with gradients of 1e-9 (a loss of ~1e-9), Adam's second moment has collapsed, and a
    gradient of 1e-6 then moves each weight by m / (sqrt(v) + eps) learning rates per step. With
    the loop's epsilon that stays within one learning rate; with PyTorch's default 1e-8 it is
    several."""
    def largest_update(eps):
        return largest_adam_update(eps, 1e-9, 1e-6, 200)
    assert largest_update(TrainConfig().adam_eps) <= 1.0
    assert largest_update(1e-8) > 3.0


def test_the_vipe_full_setups_eps_keeps_a_collapsed_adam_from_a_burst():
    """What knocked the long ViPE runs off zero loss (docs/perf/vipe.md, "Long runs"): after thousands of
    steps at a plateau, Adam's second moment sits far below eps (sqrt(v) ~ 2e-10 there), and a batch whose
    gradient is ~100x the plateau's (here 1e-5 a weight) is taken as steps of up to 3.6 learning rates on
    every weight with the loop's eps 1e-6. The full setup's eps keeps them under 0.1."""
    import experiments
    full_eps = experiments.VIPE_PAPER["adam_eps"]
    assert all(run["adam_eps"] == full_eps for run in experiments.EXPERIMENTS["vipe-parity"].full["runs"])
    assert largest_adam_update(full_eps, 2e-10, 1e-5, 50) < 0.15
    assert largest_adam_update(TrainConfig().adam_eps, 2e-10, 1e-5, 50) > 3.0


def test_metrics_record_the_commit_the_run_started_on(tmp_path, monkeypatch):
    """A commit made while a run trains does not change the commit its metrics name."""
    commit = {"now": "start"}
    monkeypatch.setattr(train, "git_hash", lambda: commit["now"])
    real = train.Step.__call__

    def commit_during_training(self, batch):
        commit["now"] = "later"
        return real(self, batch)
    monkeypatch.setattr(train.Step, "__call__", commit_during_training)
    assert train.train(tiny_config(tmp_path), log=lambda *_: None)["git"] == "start"


def same_run(a, b):
    """The two runs' final weights and loss curves are bit-identical."""
    wa, wb = torch.load(a.run_dir() / "model.pt"), torch.load(b.run_dir() / "model.pt")
    la = json.loads((a.run_dir() / "metrics.json").read_text())["loss"]
    lb = json.loads((b.run_dir() / "metrics.json").read_text())["loss"]
    return all(torch.equal(wa[k], wb[k]) for k in wa) and la == lb


def interrupt_and_resume(full, part, monkeypatch):
    """Train `full` to the end; train `part` until a KeyboardInterrupt in step 13 (its checkpoint is
    at step 10), then resume it to the end."""
    train.train(full, log=lambda *_: None)
    real, calls = train.Step.__call__, {"n": 0}

    def crash_after_12(self, batch):
        calls["n"] += 1
        if calls["n"] > 12:
            raise KeyboardInterrupt
        return real(self, batch)
    monkeypatch.setattr(train.Step, "__call__", crash_after_12)
    with pytest.raises(KeyboardInterrupt):
        train.train(part, log=lambda *_: None)
    monkeypatch.setattr(train.Step, "__call__", real)
    assert torch.load(part.run_dir() / "checkpoint.pt", weights_only=False)["step"] == 10
    train.train(part, resume=True, log=lambda *_: None)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_gives_the_same_weights(tmp_path, monkeypatch, workers):
    """Interrupted after step 12 (checkpoint at 10) and resumed, with the data made in the loop or
    by worker processes: the same weights as the run that was never interrupted."""
    full = tiny_config(tmp_path / "a", method="ape", ape_shift=8)
    part = tiny_config(tmp_path / "b", method="ape", ape_shift=8, workers=workers)
    interrupt_and_resume(full, part, monkeypatch)
    assert same_run(full, part)


@pytest.mark.parametrize("older", [None, "pickled", "list"])
def test_a_checkpoint_holds_the_loss_history_as_one_tensor_and_older_forms_resume_alike(tmp_path, monkeypatch, older):
    """The checkpoint keeps [step, loss] of every step so far as one (N, 2) float32 tensor (8 bytes a step);
    checkpoints written before, holding it pickled or as the list itself, resume to the same run."""
    full = tiny_config(tmp_path / "a", method="ape", ape_shift=8)
    part = tiny_config(tmp_path / "b", method="ape", ape_shift=8)
    real_train = train.train

    def as_older(cfg, resume=False, **kw):        # the resume of interrupt_and_resume
        if resume:
            path = cfg.run_dir() / train.CKPT
            ckpt = torch.load(path, weights_only=False)
            saved = ckpt["losses"]
            assert saved.dtype == torch.float32 and saved.shape == (10, 2)
            losses = [[int(s), v] for s, v in saved.tolist()]
            assert [s for s, _ in losses] == list(range(1, 11)) and all(math.isfinite(v) for _, v in losses)
            if older:
                torch.save({**ckpt, "losses": pickle.dumps(losses) if older == "pickled" else losses}, path)
        return real_train(cfg, resume=resume, **kw)
    monkeypatch.setattr(train, "train", as_older)
    interrupt_and_resume(full, part, monkeypatch)
    assert same_run(full, part)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_resume_and_nan_stop_with_cuda_graphs_and_workers(tmp_path, monkeypatch):
    """On the GPU with CUDA graphs and 2 data workers: a run interrupted after step 12 (checkpoint at
    10) and resumed follows the uninterrupted run (its graphs are captured again after the resume);
    a NaN loss still stops the run with its step. Tolerance: bf16 autocast, and kernels that add in
    another order from one launch to the next (atomics in backward passes)."""
    gpu = dict(device="cuda", graphs=True, workers=2)
    full, part = tiny_config(tmp_path / "a", **gpu), tiny_config(tmp_path / "b", **gpu)
    interrupt_and_resume(full, part, monkeypatch)
    la, lb = (json.loads((c.run_dir() / "metrics.json").read_text())["loss"] for c in (full, part))
    assert [s for s, _ in la] == [s for s, _ in lb] and np.allclose([v for _, v in la], [v for _, v in lb], rtol=1e-2)
    monkeypatch.setattr(train.F, "cross_entropy", lambda logits, *a, **k: logits.sum() * float("nan"))  # capturable
    with pytest.raises(train.NaNLoss, match=r"at step 1 "):
        train.train(tiny_config(tmp_path / "c", **gpu), log=lambda *_: None)


def test_data_workers_give_bit_identical_weights(tmp_path):
    """Step s's batch depends on (seed, s) only: making batches in 3 worker processes ahead of the
    loop trains exactly the model of the loop that makes them itself; another seed does not."""
    runs = [tiny_config(tmp_path / str(k), workers=w, seed=s, curriculum=True)
            for k, (w, s) in enumerate([(0, 0), (3, 0), (0, 1)])]
    for cfg in runs:
        train.train(cfg, log=lambda *_: None)
    assert same_run(runs[0], runs[1]) and not same_run(runs[0], runs[2])


def test_padding_to_the_graph_bucket_changes_nothing():
    """The padded step of CUDA graphs (here run eagerly on the CPU) gives the loss and the gradients
    of the unpadded step, for a causal task and a bidirectional one with pads and slots. Tolerance:
    float32 rounding of sums taken in another order (the gradients, not AdamW's first update, which
    divides a near-zero gradient by its own size)."""
    for task, method, opts in (("copy", "rope", {}), ("mul_padded", "upe", {"multiplier_digits": 3})):
        cfg = make_config(dict(task=task, method=method, device="cpu", d_model=32, n_heads=2, n_layers=2,
                               task_opts=opts), "cpu")
        t = cli.validate(cfg)
        cfg.model.vocab_size, cfg.model.causal = len(t.vocab), t.causal
        batch = tasks.TrainBatches(t, t.train_lengths, cfg.batch_size, cfg.seed, cfg.steps, **cfg.task_opts)[3]
        assert batch.x.shape[1] % cfg.bucket, "the check needs a batch that gets padded"
        results = []
        for pad in (False, True):
            torch.manual_seed(0)
            model = build_model(cfg.model)
            opt = train.make_optimizer(model, cfg, "cpu")
            step = train.Step(model, model, opt, cfg, t, "cpu")
            step.pad = pad
            results.append((step(batch), [p.grad for p in model.parameters()]))
        (l0, g0), (l1, g1) = results
        assert torch.allclose(l0, l1, atol=1e-6), (task, l0, l1)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g0, g1)), task


@pytest.mark.parametrize("method", ["vipe", "prism", "path", "alibi", "t5", "fire", "ape"])
def test_padding_to_a_bucket_of_8_changes_nothing_for_each_method(method):
    """The padded step (eagerly on the CPU) against the unpadded one at a bucket of 8 on copy (21 tokens -> 24),
    for the methods whose positions are not those of RoPE's and UPE's cases above. Tolerance as there."""
    cfg = make_config(dict(task="copy", method=method, device="cpu", d_model=16, n_heads=2, n_layers=2, bucket=8),
                      "cpu")
    t = cli.validate(cfg)
    cfg.model.vocab_size, cfg.model.causal = len(t.vocab), t.causal
    batch = t.sample(4, 10, np.random.default_rng(0))
    results = []
    for pad in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg.model)
        step = train.Step(model, model, train.make_optimizer(model, cfg, "cpu"), cfg, t, "cpu")
        step.pad = pad
        results.append((step(batch), [p.grad for p in model.parameters()], list(step.buffers)))
    (l0, g0, _), (l1, g1, padded) = results
    assert padded == [24] and torch.allclose(l0, l1, atol=1e-6), (method, l0, l1)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g0, g1) if a is not None), method


def test_a_smaller_bucket_pads_less_and_changes_nothing():
    """cfg.bucket sets the padded length (the padded step, run eagerly on the CPU): 8 pads a copy batch of 21
    tokens to 24 where 32 pads it to 32, with the same loss. A bucket is how a run executes, not what it
    computes: a run may resume with another (jobs.EXEC_KEYS)."""
    losses = []
    for bucket in (32, 8):
        cfg = make_config(dict(task="copy", method="rope", device="cpu", d_model=16, n_heads=2, n_layers=1,
                               bucket=bucket), "cpu")
        t = cli.validate(cfg)
        cfg.model.vocab_size = len(t.vocab)
        batch = t.sample(4, 10, np.random.default_rng(0))
        torch.manual_seed(0)
        model = build_model(cfg.model)
        step = train.Step(model, model, train.make_optimizer(model, cfg, "cpu"), cfg, t, "cpu")
        step.pad = True
        losses.append(step(batch))
        assert batch.x.shape[1] == 21 and list(step.buffers) == [{32: 32, 8: 24}[bucket]]
    assert torch.allclose(losses[0], losses[1], atol=1e-6)
    assert "bucket" in jobs.EXEC_KEYS and "bucket" not in jobs.RUN_KEYS


def test_compiled_compiles_each_of_many_padded_lengths():
    """A small bucket makes more shapes than torch's 8 compilations per frame: train.compiled raises the limit, so
    a twelfth padded length still compiles (counted by the backend) rather than falling back to eager."""
    seen = []

    def backend(gm, inputs):
        seen.append(tuple(inputs[0].shape))
        return gm.forward

    torch._dynamo.reset()
    fn = train.compiled(torch.nn.Linear(4, 4), backend=backend)
    for T in range(8, 104, 8):
        fn(torch.ones(T, 4))
    assert len(seen) == 12


@pytest.mark.parametrize("workers", [0, 2])
def test_nan_loss_stops_with_step_and_last_loss(tmp_path, monkeypatch, workers):
    real, calls = F.cross_entropy, {"n": 0}

    def nan_at_4(*a, **k):
        calls["n"] += 1
        loss = real(*a, **k)
        return loss * float("nan") if calls["n"] == 4 else loss
    monkeypatch.setattr(train.F, "cross_entropy", nan_at_4)
    with pytest.raises(train.NaNLoss, match=r"at step 4 \(counted as in the progress lines\); last finite loss \d"):
        train.train(tiny_config(tmp_path, workers=workers), log=lambda *_: None)
    assert not multiprocessing.active_children()             # the data workers are stopped too


def script_losses(monkeypatch, script: dict) -> dict:
    """The loss of the n-th training step (1, 2, ...) becomes script[n]; returns script, which a test
    may extend for the steps of a resumed run."""
    real, calls = F.cross_entropy, {"n": 0}

    def scripted(*a, **k):
        calls["n"] += 1
        return real(*a, **k) * 0 + script[calls["n"]]
    monkeypatch.setattr(train.F, "cross_entropy", scripted)
    return script


def test_a_jump_after_zero_loss_keeps_the_checkpoint_from_before_it(tmp_path, monkeypatch):
    """Losses scripted per step: high (not a jump: the run has not been near zero yet), below 0.01,
    a jump at step 7, back, a second jump at 9 lasting two steps. Each jump keeps the checkpoint on
    disk when it came (step 5's) once, and says so. A resumed run still knows whether it is in a jump
    and whether it has been near zero. Of four jumps the last three stay."""
    script = script_losses(monkeypatch, {1: 1.0, 2: 1.0, 3: 1.0, 4: 1e-3, 5: 1e-3, 6: 1e-3, 7: 0.5, 8: 1e-3, 9: 0.3,
                                         10: 0.2})
    lines = []
    cfg = tiny_config(tmp_path, steps=10)
    train.train(cfg, log=lines.append)
    kept = sorted(p.name for p in cfg.run_dir().glob("before-jump-*.pt"))
    assert kept == ["before-jump-7.pt", "before-jump-9.pt"]
    assert all(torch.load(cfg.run_dir() / name, weights_only=False)["step"] == 5 for name in kept)
    assert [x.strip() for x in lines if "before-jump" in x] == [
        "loss 0.5 at step 7 after it had been below 0.01: kept the checkpoint before it as before-jump-7.pt",
        "loss 0.3 at step 9 after it had been below 0.01: kept the checkpoint before it as before-jump-9.pt"]
    script[11] = 0.3                                          # resumed from step 10, still in the jump of 9
    train.train(tiny_config(tmp_path, steps=11), resume=True, log=lines.append)
    assert len(list(cfg.run_dir().glob("before-jump-*.pt"))) == 2
    script[12], script[13] = 1e-3, 0.3                        # resumed from step 11: 12 is low, 13 a jump
    cfg = tiny_config(tmp_path, steps=13)
    train.train(cfg, resume=True, log=lines.append)
    assert (cfg.run_dir() / "before-jump-13.pt").exists()
    assert torch.load(cfg.run_dir() / "before-jump-13.pt", weights_only=False)["step"] == 11
    script[14], script[15] = 1e-3, 0.3                        # a fourth jump: the earliest of them goes
    cfg = tiny_config(tmp_path, steps=15)
    train.train(cfg, resume=True, log=lines.append)
    kept = sorted(p.name for p in cfg.run_dir().glob("before-jump-*.pt"))
    assert kept == ["before-jump-13.pt", "before-jump-15.pt", "before-jump-9.pt"]
    assert [x.strip() for x in lines if "before-jump-15" in x] == [
        "loss 0.3 at step 15 after it had been below 0.01: kept the checkpoint before it as before-jump-15.pt "
        "(removed the earliest, before-jump-7.pt)"]


def test_a_rise_where_the_curriculum_grows_the_lengths_is_no_jump(tmp_path, monkeypatch):
    """With PRISM's curriculum (lengths <= 5 for 4 steps, then up to 8), the loss rises on the new
    lengths at step 5 (the first batch of the second stage) after it had been near zero: no checkpoint
    is kept for that. Near zero again, a rise at step 9 at the same lengths is a jump."""
    script_losses(monkeypatch, {1: 1.0, 2: 1e-3, 3: 1e-3, 4: 1e-3, 5: 0.9, 6: 0.5, 7: 1e-3, 8: 1e-3, 9: 0.5, 10: 1e-3})
    lines = []
    cfg = tiny_config(tmp_path, steps=10, train_lengths=[3, 8], curriculum=True, curriculum_steps=4, ckpt_every=2)
    train.train(cfg, log=lines.append)
    assert sorted(p.name for p in cfg.run_dir().glob("before-jump-*.pt")) == ["before-jump-9.pt"], lines


# ---- CLI --------------------------------------------------------------------------------------

def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("args,message", [
    (["--task", "nope", "--method", "rope"], "unknown task 'nope'; valid tasks: flipflop, a5"),
    (["--task", "copy", "--method", "magic"], "unknown method 'magic'; available methods: nope, ape, rope"),
    (["--task", "add_padded", "--method", "path"], "method 'path' is causal only; task 'add_padded' needs a bidirectional"),
    (["--task", "copy", "--method", "rope", "--test-lengths", "0,5"], "test length: task copy: length 0 is impossible"),
    (["--task", "scan", "--method", "rope", "--train-lengths", "23"], "no SCAN command has 23 actions"),
    (["--task", "copy", "--method", "rope", "--test-lengths", "a-b"], "cannot read 'a-b'"),
    (["--task", "mqrar", "--method", "rope", "--task-opt", "nback=2"], "has no option 'nback'"),
    (["--task", "copy", "--method", "rope", "--n-heads", "3"], "not a multiple of n_heads 3"),
    (["--reproduce", "nothing"], "unknown experiment 'nothing'"),
    (["--task", "mqrar", "--method", "rope", "--task-opt", "n_back=abc"], "option n_back must be an int, got 'abc'"),
    (["--task", "mqrar", "--method", "rope", "--task-opt", "n_back=99"], "n_back must be in 1..8, got 99"),
    (["--task", "flipflop", "--method", "rope", "--task-opt", "p_ignore=2"], "p_ignore must be in [0, 1), got 2"),
    (["--task", "mul_padded", "--method", "rope", "--task-opt", "multiplier_digits=4"], "must be 1, 2 or 3, got 4"),
    (["--task", "copy", "--method", "rope", "--seeds", ""], "--seeds: the list is empty"),
    (["--task", "copy", "--method", "nope", "--lr", "-1"], "--lr must be > 0 and finite, got -1.0"),
    (["--task", "copy", "--method", "nope", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["--task", "copy", "--method", "nope", "--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
    (["--task", "copy", "--method", "nope", "--beta2", "1"], "--beta2 must be in [0, 1), got 1.0"),
    (["--task", "copy", "--method", "rope", "--train-lengths", "10-1"], "the range 10-1 runs backwards"),
    (["--task", "copy", "--method", "rope", "--train-lengths", ""], "--train-lengths: the list is empty"),
    (["--task", "parity", "--method", "vipe", "--method-opt", "vipe_modee=value"],
     "method 'vipe' has no option 'vipe_modee' (--method-opt); its options: vipe_mode, vipe_dp"),
    (["--task", "copy", "--method", "rope", "--method-opt", "prism_alpha=2"], "its options: none"),
    (["--task", "copy"], "give --task and --method"),
])
def test_cli_errors_are_one_line(capsys, tmp_path, args, message):
    code, out, err = run_cli(capsys, *args, "--out", str(tmp_path / "runs"), "--device", "cpu")
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_cli_refuses_an_output_folder_it_cannot_write(capsys, tmp_path):
    """Checked before training: a path below a file (a folder root can write to whatever its mode)."""
    (tmp_path / "file").write_text("")
    code, _, err = run_cli(capsys, *CLI_TINY, "--method", "rope", "--out", str(tmp_path / "file" / "runs"))
    assert code == 2 and "cannot write there" in err and "is not a folder" in err and err.count("\n") == 1


def test_a_signal_stops_at_a_step_boundary_with_a_checkpoint(tmp_path, monkeypatch, capsys):
    """SIGINT during step 7: the run finishes that step, writes its checkpoint and says so; --resume
    then gives the weights of the run that was never interrupted."""
    import os
    import signal
    full = tiny_config(tmp_path / "a", method="ape", ape_shift=8)
    train.train(full, log=lambda *_: None)
    real, calls = train.Step.__call__, {"n": 0}

    def signal_at_7(self, batch):
        calls["n"] += 1
        if calls["n"] == 7:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, batch)
    monkeypatch.setattr(train.Step, "__call__", signal_at_7)
    part = tiny_config(tmp_path / "b", method="ape", ape_shift=8)
    with pytest.raises(train.Interrupted, match="after step 7, checkpoint written"):
        cli.run(part, log=lambda *_: None)
    monkeypatch.setattr(train.Step, "__call__", real)
    ckpt = torch.load(part.run_dir() / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 7 and ckpt["timed"][0] == 3      # steps 5-7: the speed counts from step 4 on
    assert not (part.run_dir() / "run.lock").exists()
    train.train(part, resume=True, log=lambda *_: None)
    assert same_run(full, part)


def test_a_signal_to_the_whole_process_group_stops_a_run_with_data_workers(tmp_path):
    """Ctrl-C in a terminal, or `timeout`, signals every process of the group, data workers too:
    the workers ignore it, and the run stops at a step with its checkpoint (a worker killed by the
    signal used to crash the run while it wrote that checkpoint)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "train.py", "--task", "copy", "--method", "rope", "--device", "cpu",
                             "--steps", "100000", "--workers", "2", "--d-model", "16", "--n-layers", "1",
                             "--out", str(tmp_path)], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    for line in proc.stdout:                              # the loop is stepping, its workers running
        if " step " in line:
            break
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGTERM)
    out = line + proc.stdout.read()
    assert proc.wait(timeout=120) != 0
    assert "checkpoint written" in out and "Traceback" not in out, out[-2000:]
    ckpt = torch.load(tmp_path / "copy" / "rope" / "seed0" / "checkpoint.pt", weights_only=False)
    assert 1 <= ckpt["step"] < 100000


def test_nan_stop_without_a_checkpoint_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(train.F, "cross_entropy", lambda *a, **k: torch.tensor(float("nan"), requires_grad=True))
    with pytest.raises(train.NaNLoss, match=r"at step 1 .*last finite loss none \(no checkpoint written\)"):
        train.train(tiny_config(tmp_path), log=lambda *_: None)


def test_a_run_folder_in_use_is_refused_and_a_stale_lock_taken_over(tmp_path):
    import subprocess
    import sys
    cfg = tiny_config(tmp_path)
    lock = cfg.run_dir() / "run.lock"
    lock.parent.mkdir(parents=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lock.write_text(str(other.pid))                     # a live process holds it
        with pytest.raises(cli.UsageError, match=f"is in use by process {other.pid}"):
            cli.run(cfg, log=lambda *_: None)
    finally:
        other.kill()
        other.wait()
    cli.run(cfg, log=lambda *_: None)                       # its process is gone: a stale lock
    assert (cfg.run_dir() / "metrics.json").exists() and not lock.exists()


def test_concurrent_atomic_writes_do_not_collide(tmp_path):
    """Two threads writing the same file 300 times each: every write lands whole, no temporary left."""
    import threading
    path, errors = tmp_path / "m.json", []

    def writer(k):
        try:
            for i in range(300):
                save_atomic({"writer": k, "i": i}, path)
        except Exception as e:      # noqa: BLE001  the test reports any failure
            errors.append(e)
    threads = [threading.Thread(target=writer, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and json.loads(path.read_text())["i"] == 299 and not list(tmp_path.glob("*.tmp"))


def test_metrics_json_puts_a_row_on_a_line_and_reads_back_the_same(tmp_path):
    """save_atomic's JSON: every value reads back equal (NaN, nesting, empty containers, strings with brackets);
    an eval row, a loss pair and a list of seeds are one line each, a dict of dicts a line per key."""
    obj = {"task": "copy", "seeds": [0, 1], "note": "a [b] {c}", "empty": {}, "none": [],
           "eval": [{"name": "1", "exact": 1.0, "token": float("nan")}, {"name": "2", "exact": 0.5, "token": 0.75}],
           "loss": [[1, 2.0], [101, 0.5]], "config": {"lr": 1e-3, "model": {"d_model": 64, "opts": {"k": 1}}}}
    save_atomic(obj, tmp_path / "m.json")
    text = (tmp_path / "m.json").read_text()
    back = json.loads(text)
    assert math.isnan(back["eval"][0].pop("token"))      # NaN is not equal to itself: compared apart
    obj["eval"][0].pop("token")
    assert back == obj
    lines = text.splitlines()
    assert '  {"name": "2", "exact": 0.5, "token": 0.75}' in lines and "  [101, 0.5]," not in lines
    assert "  [101, 0.5]" in lines and ' "seeds": [0, 1],' in lines and '   "opts": {"k": 1}' in lines
    assert ' "config": {' in lines and '  "lr": 0.001,' in lines and ' "empty": {},' in lines


def test_a_run_with_other_options_does_not_overwrite_a_run(capsys, tmp_path):
    tiny = ["--task", "mul_padded", "--method", "rope", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
            "--steps", "3", "--batch-size", "8", "--n-eval", "4", "--test-lengths", "5", "--device", "cpu",
            "--out", str(tmp_path)]
    assert run_cli(capsys, *tiny, "--task-opt", "multiplier_digits=1")[0] == 0
    code, _, err = run_cli(capsys, *tiny, "--task-opt", "multiplier_digits=3")
    assert code == 2 and "holds a finished run with other options (task_opts.multiplier_digits: 1 -> 3)" in err
    assert run_cli(capsys, *tiny, "--task-opt", "multiplier_digits=3", "--tag", "m3")[0] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cli_gpu_options_on_cpu(capsys, tmp_path):
    code, _, err = run_cli(capsys, "--task", "copy", "--method", "rope", "--device", "cuda", "--out", str(tmp_path))
    assert code == 2 and "no CUDA GPU is available" in err
    code, _, err = run_cli(capsys, "--task", "copy", "--method", "rope", "--compile", "--out", str(tmp_path))
    assert code == 2 and "--compile needs a CUDA GPU" in err
    code, _, err = run_cli(capsys, "--task", "copy", "--method", "rope", "--tf32", "--out", str(tmp_path))
    assert code == 2 and "--tf32 is for CUDA GPUs" in err
    assert not list(tmp_path.iterdir())


def test_each_run_sets_tf32_as_its_config_says(tmp_path):
    """The TF32 switch is the process's: each run sets it, so that a run after a --tf32 one in the same
    process (a --jobs worker) multiplies in float32 again. An execution setting: a run made with it counts
    as the same setup as one without."""
    was = torch.backends.cuda.matmul.allow_tf32
    try:
        for tf32 in (True, False):
            cfg = tiny_config(tmp_path, steps=2, tag=f"tf32-{tf32}")
            cfg.tf32 = tf32
            train.train(cfg, log=lambda *_: None)
            assert torch.backends.cuda.matmul.allow_tf32 is tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
    assert "tf32" in jobs.EXEC_KEYS and "tf32" not in jobs.RUN_KEYS


CLI_TINY = ["--task", "copy", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--steps", "15",
            "--batch-size", "8", "--n-eval", "8", "--train-lengths", "1-3", "--test-lengths", "2,5", "--device", "cpu"]


def test_cli_runs_methods_and_seeds_and_plots(capsys, tmp_path):
    out = tmp_path / "runs"
    code, stdout, _ = run_cli(capsys, *CLI_TINY, "--methods", "nope,alibi", "--seeds", "0,1", "--out", str(out))
    assert code == 0 and "small CPU preset" in stdout and "| length | exact |" in stdout
    for m in ("nope", "alibi"):
        s = json.loads((out / "copy" / m / "metrics.json").read_text())
        assert s["seeds"] == [0, 1] and [p["length"] for p in s["eval"]] == [2, 5]
        seeds = [json.loads((out / "copy" / m / f"seed{k}" / "metrics.json").read_text()) for k in (0, 1)]
        for i, p in enumerate(s["eval"]):
            ex = [m_["eval"][i]["exact"] for m_ in seeds]
            assert p["exact"] == pytest.approx(np.mean(ex)) and p["exact_min"] == min(ex) and p["exact_max"] == max(ex)
        assert (out / "copy" / m / "seed1" / "model.pt").exists()
    png = out / "copy" / "extrapolation.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_resume_continues_a_run(capsys, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(capsys, *CLI_TINY, "--method", "t5", "--out", str(out))[0] == 0
    before = torch.load(out / "copy" / "t5" / "seed0" / "model.pt")
    code, stdout, err = run_cli(capsys, *CLI_TINY, "--method", "t5", "--out", str(out), "--resume", "--steps", "25")
    assert code == 0 and "resumed" in stdout and "at step 15" in stdout, err
    saved = json.loads((out / "copy" / "t5" / "seed0" / "metrics.json").read_text())
    assert saved["loss"][-1][0] == 25 and [s for s, _ in saved["loss"]] == list(range(1, 26))
    after = torch.load(out / "copy" / "t5" / "seed0" / "model.pt")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_cli_resume_errors(capsys, tmp_path):
    out = tmp_path / "runs"
    code, _, err = run_cli(capsys, *CLI_TINY, "--method", "rope", "--out", str(out), "--resume")
    assert code == 2 and "no checkpoint at" in err
    assert run_cli(capsys, *CLI_TINY, "--method", "rope", "--out", str(out))[0] == 0
    ckpt = out / "copy" / "rope" / "seed0" / "checkpoint.pt"
    code, _, err = run_cli(capsys, *CLI_TINY, "--method", "rope", "--out", str(out), "--resume", "--d-model", "64")
    assert code == 2 and "belongs to a different run (model.d_model: 32 -> 64)" in err and len(err) < 200
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    code, _, err = run_cli(capsys, *CLI_TINY, "--method", "rope", "--out", str(out), "--resume")
    assert code == 2 and "corrupt or unreadable" in err and err.count("\n") == 1


def test_dropout_acts_in_training_only():
    """--dropout: two training-mode passes differ; in eval mode the model is the same function as
    the model without dropout that has its weights; p = 0 draws no random numbers."""
    x = torch.randint(0, 10, (4, 12))
    models = []
    for p in (0.3, 0.0):
        torch.manual_seed(0)
        models.append(build_model(ModelConfig(vocab_size=10, d_model=32, n_layers=2, n_heads=2, dropout=p,
                                              method="rope")))
    drop, plain = models
    assert not torch.equal(drop(x), drop(x))
    drop.eval(), plain.eval()
    assert torch.equal(drop(x), plain(x))
    plain.train()
    state = torch.get_rng_state()
    plain(x)
    assert torch.equal(torch.get_rng_state(), state)


def test_adamw_beta2_reaches_the_optimiser(tmp_path):
    opt = train.make_optimizer(build_model(ModelConfig(vocab_size=10, d_model=16, n_heads=2, method="rope")),
                               tiny_config(tmp_path, beta2=0.98), "cpu")
    assert all(g["betas"] == (0.9, 0.98) for g in opt.param_groups)


def test_resume_of_a_run_saved_before_a_new_model_field(capsys, tmp_path):
    """A checkpoint whose config lacks a ModelConfig field added since (here dropout) resumes when
    the field has its default, and is refused when it does not."""
    out = tmp_path / "runs"
    assert run_cli(capsys, *CLI_TINY, "--method", "rope", "--out", str(out))[0] == 0
    path = out / "copy" / "rope" / "seed0" / "checkpoint.pt"
    ckpt = torch.load(path, weights_only=False)
    del ckpt["config"]["model"]["dropout"]
    torch.save(ckpt, path)
    code, _, err = run_cli(capsys, *CLI_TINY, "--method", "rope", "--out", str(out), "--resume", "--dropout", "0.1")
    assert code == 2 and "model.dropout: 0.0 -> 0.1" in err
    code, stdout, err = run_cli(capsys, *CLI_TINY, "--method", "rope", "--out", str(out), "--resume", "--steps", "20")
    assert code == 0 and "at step 15" in stdout, err


def test_evaluations_during_training_keep_a_history(tmp_path):
    """--eval-every: each evaluation on the test set, and on held-out examples (another generator) of
    --held-out-lengths, goes into metrics["history"] and the checkpoint, for the papers' selection rules."""
    cfg = tiny_config(tmp_path, eval_every=10, held_out_lengths=[4])
    metrics = train.train(cfg, log=lambda *_: None)
    assert [h["step"] for h in metrics["history"]] == [10, 20]
    assert all([r["length"] for r in h["eval"]] == [2, 4] for h in metrics["history"])
    assert all([r["length"] for r in h["held_out"]] == [4] for h in metrics["history"])
    assert metrics["history"][-1]["eval"] == metrics["eval"]          # the last one is the final test
    assert len(torch.load(cfg.run_dir() / "checkpoint.pt", weights_only=False)["history"]) == 2


def test_evaluations_during_training_can_take_fewer_examples_than_the_final_one(tmp_path):
    """--n-eval-during N: the evaluations during training (PRISM's top-3 rule; the paper's test set of
    1,000 examples in all) take N examples per length, the final evaluation n_eval."""
    cfg = tiny_config(tmp_path, eval_every=10, n_eval=12, n_eval_during=5, held_out_lengths=[4])
    metrics = train.train(cfg, log=lambda *_: None)
    assert {r["n"] for h in metrics["history"] for key in ("eval", "held_out") for r in h[key]} == {5}
    assert {r["n"] for r in metrics["eval"]} == {12}


def test_evaluations_during_training_wait_for_the_loss_when_asked(tmp_path):
    """--eval-from-loss X (PRISM's paper: 0.1): the evaluations during training start at the first evaluation
    step whose mean loss over the last eval_every steps is below X, and go on from there even where the loss
    rises again. The steps come from a run that evaluates from the start: on the CPU evaluating leaves
    training unchanged."""
    every = tiny_config(tmp_path / "a", steps=60, eval_every=5)
    losses = [v for _, v in train.train(every, log=lambda *_: None)["loss"]]
    means = {k: np.mean(losses[k - 5:k]) for k in range(5, 61, 5)}
    threshold = min(means[k] for k in means if k <= 40) + 1e-9
    first = min(k for k in means if means[k] < threshold)
    assert first > 15 and any(means[k] >= threshold for k in means if k > first), \
        "the check needs a threshold crossed late, with the loss above it again afterwards"
    metrics = train.train(tiny_config(tmp_path / "b", steps=60, eval_every=5, eval_from_loss=threshold),
                          log=lambda *_: None)
    assert [h["step"] for h in metrics["history"]] == list(range(first, 61, 5))
    assert [v for _, v in metrics["loss"]] == losses
    never = train.train(tiny_config(tmp_path / "c", steps=60, eval_every=5, eval_from_loss=1e-9), log=lambda *_: None)
    assert "history" not in never


@pytest.mark.parametrize("task_name,method", [("copy", "rope"), ("add_padded", "rpe"), ("mul_padded", "upe")])
def test_packing_lengths_into_one_pass_changes_no_result(task_name, method):
    """evaluate() packs examples of several lengths into one padded forward pass; with a budget of one
    token per pass it runs each length alone: the same rows either way (causal, and bidirectional
    with key masks and UPE slots)."""
    task = TASKS[task_name]
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=len(task.vocab), d_model=32, n_layers=2, n_heads=2, method=method,
                                    causal=task.causal))
    lengths = [1, 2, 3, 5, 8]
    packed = evaluate(model, task, lengths, 12, 0, "cpu", batch_size=5)
    alone = evaluate(model, task, lengths, 12, 0, "cpu", batch_size=5, tokens_per_batch=1)
    assert packed == alone
    assert 0 < np.mean([r["token"] for r in packed]) < 1, "the check needs partly right predictions"


def test_cli_lists_the_options_of_a_method_and_a_task(capsys):
    code, out, _ = run_cli(capsys, "--help-method", "upe")
    assert code == 0 and "rpe_clip" in out and "upe_slots" in out and "(default 3)" in out
    code, out, _ = run_cli(capsys, "--help-task", "mqrar")
    assert code == 0 and "n_back=1" in out and "n_keys=32" in out and "associative recall" in out
    code, _, err = run_cli(capsys, "--help-method", "magic")
    assert code == 2 and "unknown method 'magic'" in err


def test_scan_is_evaluated_on_every_command():
    task = TASKS["scan"]
    model = build_model(ModelConfig(vocab_size=len(task.vocab), d_model=16, n_layers=1, n_heads=2, method="nope"))
    rows = evaluate(model, task, [24, 48], 8, 0, "cpu")
    assert [r["n"] for r in rows] == [336, 128]             # the test split's commands of 24 and 48 actions


def test_the_run_summary_and_the_table_count_scan_over_commands():
    """A length with 336 commands weighs 336 times one with 1; the table's examples note gives the
    per-length range where lengths differ in size, one number where they do not."""
    rows = [dict(length=24, variant="", name="24", n=336, exact=1.0), dict(length=48, variant="", name="48", n=1, exact=0.0)]
    assert summary_line(rows, 22) == f"exact in-dist - | beyond train length {336 / 337:.3f}"
    assert experiments.examples_note(rows) == ", 337 examples, 1-336 per length"
    assert experiments.examples_note([{**r, "n": 8} for r in rows]) == ", 8 examples per point"
    assert experiments.examples_note([{"length": 3, "exact": 1.0}]) == ""


def test_a_second_sigterm_after_a_stop_does_not_kill_the_run_before_it_reports(tmp_path):
    """`timeout` and Slurm send SIGTERM to the process and then to its whole group: the second one
    arrives while the stopped run reports and releases its folder. It must not kill the process
    (before, the default action did, silently, leaving the run's lock behind)."""
    import subprocess
    import sys
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
import cli, train
cfg = cli.make_config(dict(task="copy", method="rope", steps=50, batch_size=4, d_model=16, n_layers=1, n_heads=2,
                           n_eval=2, test_lengths=[2], train_lengths=[1, 2], out={str(tmp_path)!r}, device="cpu",
                           log_every=1e9), "cpu")
real = train.Step.__call__
def term_at_3(self, batch, n=[0]):
    n[0] += 1
    if n[0] == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self, batch)
train.Step.__call__ = term_at_3
try:
    cli.run(cfg, log=lambda *_: None)
except train.Interrupted as e:
    os.kill(os.getpid(), signal.SIGTERM)          # the group's copy of the signal
    print("reported:", e, flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0 and "reported: stopped by signal 15 after step 3" in done.stdout, done.stderr[-1500:]
    assert not (tmp_path / "copy" / "rope" / "seed0" / "run.lock").exists()


def test_compiled_step_compiles_each_padded_length_for_that_length():
    """--compile: the step compiles once per padded length, each for its fixed length. torch's default
    compiles the second length it meets with the length as a symbol (generic kernels, kept for every
    later curriculum stage). Traced here with a backend that records its inputs and runs the graph
    as it is; batches of three lengths go through the step as the loop runs it (padded)."""
    symbolic = []

    def record(gm, inputs):
        symbolic.append(any(isinstance(d, torch.SymInt) for t in inputs
                            for d in (t.shape if isinstance(t, torch.Tensor) else [t])))
        return gm.forward
    cfg = make_config(dict(task="copy", method="rope", device="cpu", d_model=32, n_heads=2, n_layers=1), "cpu")
    t = cli.validate(cfg)
    cfg.model.vocab_size, cfg.model.causal = len(t.vocab), t.causal
    model = build_model(cfg.model)
    torch._dynamo.reset()
    step = train.Step(model, train.compiled(model, backend=record), train.make_optimizer(model, cfg, "cpu"),
                      replace(cfg, compile=True), t, "cpu")
    rng = np.random.default_rng(0)
    for length in (5, 20, 40):           # 12, 42 and 82 tokens: padded to 32, 64 and 96
        step(t.sample(4, length, rng))
    torch._dynamo.reset()
    assert not torch._functorch.config.enable_autograd_cache     # see train.compiled
    assert sorted(step.buffers) == [32, 64, 96]
    assert len(symbolic) >= 3 and not any(symbolic), symbolic


def test_a_post_norm_model_is_berts_order_of_sums_and_norms():
    """norm="post": the embedding normalised, then h = LN1(h + attn(h)) and h = LN2(h + mlp(h)) in each block,
    and the head reads the last block's output without a further norm (BERT's order); "pre" (the default) is
    h + attn(LN1(h)), h + mlp(LN2(h)), then the final norm. Both from the model's own modules, by hand."""
    from model import Model
    torch.manual_seed(0)
    x = torch.randint(0, 12, (3, 9))
    for norm in ("post", "pre"):
        net = Model(ModelConfig(vocab_size=12, d_model=16, n_layers=2, n_heads=2, causal=False, method="nope",
                                norm=norm), train.METHODS["nope"])
        for p in net.parameters():                      # norms with weights and biases other than 1 and 0
            torch.nn.init.normal_(p, std=0.5)
        ctx = {"tokens": x}
        h = net.embed(x)
        h = net.norm(h) if norm == "post" else h
        for b in net.blocks:
            if norm == "post":
                h = b.norm1(h + b.attn(h, ctx))
                h = b.norm2(h + b.mlp(h))
            else:
                h = h + b.attn(b.norm1(h), ctx)
                h = h + b.mlp(b.norm2(h))
        want = net.head(h if norm == "post" else net.norm(h))
        assert torch.allclose(net(x), want, atol=1e-6), norm


def test_norm_post_is_a_flag_recorded_with_the_run_and_printed_in_its_command(tmp_path):
    cfg = make_config(dict(task="copy", method="rope", norm="post", device="cpu", out=str(tmp_path)), "cpu")
    cli.validate(cfg)
    assert cfg.model.norm == "post" and "--norm post" in cli.command_of(cfg)
    assert "--norm" not in cli.command_of(make_config(dict(task="copy", method="rope", device="cpu"), "cpu"))
    assert main(["--task", "copy", "--method", "rope", "--norm", "post", "--steps", "2", "--n-eval", "2",
                 "--test-lengths", "4", "--out", str(tmp_path), "--device", "cpu"]) == 0
    saved = json.loads((tmp_path / "copy" / "rope" / "seed0" / "metrics.json").read_text())
    assert saved["config"]["model"]["norm"] == "post"
