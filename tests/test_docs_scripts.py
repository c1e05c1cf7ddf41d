"""The measurement scripts of docs/perf run against the code as it is: each one on a tiny trained
run (or, for the GPU profiler, its imports and option parsing), so that a change of the loop's or a
method's interface that breaks one of them fails here rather than the next time someone measures."""
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cli
import train
from evaluation import checkpoint_losses

ROOT = Path(__file__).resolve().parents[1]


def tiny_run(tmp_path, **values) -> Path:
    cfg = cli.make_config({"device": "cpu", "steps": 3, "batch_size": 4, "n_eval": 2, "d_model": 16,
                           "n_layers": 1, "n_heads": 1, "out": str(tmp_path), **values}, "cpu")
    train.train(cfg, log=lambda *_: None)
    return cfg.run_dir()


def perf_module(name: str):
    """A docs/perf script imported as a module (its sibling imports resolve as when it runs)."""
    sys.path.insert(0, str(ROOT / "docs" / "perf"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def script(name: str, *args) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "perf" / name), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_vipe_s_halves_runs_on_a_trained_model(tmp_path):
    run = tiny_run(tmp_path, task="parity", method="vipe", train_lengths=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                          13, 14, 15, 16])
    out = script("vipe_s_halves.py", run)
    bands = [re.findall(r"\d\.\d{3}", line) for line in out.splitlines() if line.startswith("  ")]
    assert [len(b) for b in bands] == [3] * 4 + [2] * 4, out   # four halves; three bands, then two
    assert all(0.0 <= float(x) <= 1.0 for b in bands for x in b), out


def test_prism_cot_errors_runs_on_a_trained_model(tmp_path):
    run = tiny_run(tmp_path, task="add_cot", method="prism", train_lengths=[1, 2, 3])
    out = script("prism_cot_errors.py", run, "2,4", 8)
    for L in (2, 4):
        assert f"length {L}: 8 examples, exact " in out, out


def test_prism_precision_evaluates_each_precision_on_a_trained_model(tmp_path):
    run = tiny_run(tmp_path, task="copy", method="prism", train_lengths=[1, 2, 3])
    out = script("prism_precision.py", run, "2,6", 4)
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["float32", "tf32", "bfloat16", "tf32-fp16", "tf32-bf16"], out
    assert all(r[1] == "2:" and r[5] == "6:" for r in rows), out


def test_prism_precision_rounds_as_bfloat16_and_keeps_float32_scores():
    prism_precision = perf_module("prism_precision")
    import prism
    x = torch.randn(4096) * 100
    assert torch.equal(prism_precision.rounded(x, 7), x.bfloat16().float())  # random values: no ties
    tf = prism_precision.rounded(x, 10)
    assert (tf.view(torch.int32) & ((1 << 13) - 1) == 0).all()                 # 10 mantissa bits left
    assert ((tf - x).abs() <= x.abs() * 2.0 ** -11).all() and not torch.equal(tf, x)
    hist = torch.rand(2, 2, 3 * 2, 5, 8).softmax(-1)                          # sides, B, H O, T, P with H = 3, O = 2
    gram = prism.sinusoid_table(8, 6) @ prism.sinusoid_table(8, 6).T
    assert torch.equal(prism_precision.cursor_scores_at(23)(hist, gram, 3, 6), prism.cursor_scores(hist, gram, 3, 6))
    low = prism_precision.cursor_scores_at(7)(hist, gram, 3, 6)
    assert not torch.equal(low, prism.cursor_scores(hist, gram, 3, 6))
    assert torch.allclose(low, prism.cursor_scores(hist, gram, 3, 6), rtol=0.05)
    tf = prism_precision.cursor_scores_at(10)(hist, gram, 3, 6)
    half = prism_precision.cursor_scores_at(10, torch.float16)(hist, gram, 3, 6)
    assert half.dtype == torch.float32 and torch.equal(half, tf.half().float()) and not torch.equal(half, tf)


def test_path_profile_names_real_kernels_and_its_inputs_fit_path_attention():
    path_profile = perf_module("path_profile")
    missing = [name for name in path_profile.TRITON_KERNELS if not hasattr(path_profile.kp, name)]
    assert not missing, f"path_profile.py times kernels that kernels/path_attention.py lacks: {missing}"
    for name in ("launch", "UT_WARPS", "UT_MAXNREG", "CHUNK", "SPLIT_DKL", "DKL_TILE"):   # what its sweeps patch
        assert hasattr(path_profile.kp, name), name
    args = path_profile.inputs(1, 2, 9, 16, torch.float32, True, device="cpu")
    path_profile.step_fn(path_profile.pa.path_attention, args)()   # fwd + bwd through its own inputs
    assert all(a.grad is None for a in args if a is not None)     # autograd.grad, not .backward()


def test_vipe_stability_records_every_interval(tmp_path):
    out = tmp_path / "run.jsonl"
    script("vipe_stability.py", out, "method=vipe", "task=parity", "steps=6", "d_model=16", "n_heads=1",
           "batch_size=4", "weight_decay=0", "--every", 2, "--eval-every", 6)
    head, *recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert head["config"]["method"] == "vipe" and [r["step"] for r in recs] == [2, 4, 6]
    assert all(len(r["logit"]) == 2 and len(r["u_norm"]) == 2 and r["grad"] > 0 for r in recs)
    assert all(r["loss_min"] <= r["loss_mean"] <= r["loss_max"] for r in recs)
    assert "exact_1_16" in recs[-1] and "exact_1_16" not in recs[0]


def test_vipe_margins_probes_each_vipe_layer_in_both_precisions(tmp_path):
    run = tiny_run(tmp_path, task="parity", method="vipe", n_layers=2, train_lengths=[2, 3], train_set=16)
    out = script("vipe_margins.py", run / train.CKPT, "--batches", 2, "--json", tmp_path / "m.json")
    (r,) = json.loads((tmp_path / "m.json").read_text())
    assert r["step"] == 3 and r["sequences"] == 8 and len(r["layers"]) == 2 and "ViPE layer 2" in out
    assert r["loss_fp32"]["max"] >= r["loss_fp32"]["mean"] > 0 and r["loss_bf16"]["max"] > 0
    for layer in r["layers"]:                             # rows of tokens 2.. of the batch's padded width
        assert layer["largest_logit"] > 0 and 0 <= layer["gap_q01"] <= layer["gap_median"]
        assert 0 <= layer["rows_gap_below_1"] <= r["rows"] and 0 <= layer["rows_moved_by_bf16"] <= r["rows"]
    cfg, model, _ = margins_module().load(run / train.CKPT)  # each sequence's highest loss, directly
    task, worst = train.TASKS["parity"], []
    with torch.no_grad():
        for b in train.batches(cfg, task, [2, 3], 0, 2):
            out = model(b.x, train.batch_context(task, b, "cpu"))
            worst.append(torch.nn.functional.cross_entropy(out.transpose(1, 2), b.y, ignore_index=-100,
                                                           reduction="none").max(1).values)
    assert abs(torch.cat(worst).mean().item() - r["loss_fp32"]["mean"]) < 1e-6 * max(1, r["loss_fp32"]["mean"])


def margins_module():
    vipe_margins = perf_module("vipe_margins")
    return vipe_margins


def test_vipe_margins_logits_are_those_of_the_naive_reference():
    """The probe's float64 logits, softmaxed and applied to v, give the naive reference's output."""
    import vipe
    vipe_margins = margins_module()
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 2, 7, 8, dtype=torch.float64).unbind(0)
    v, u = torch.randn(2, 2, 7, 7, dtype=torch.float64), 0.3 * torch.randn(2, 8, dtype=torch.float64)
    w_p, b_p = torch.zeros(2, 0, dtype=torch.float64), torch.zeros(2, 0, dtype=torch.float64)
    for s in (1.0, 3.0):
        vipe_margins._logits.clear()
        vipe_margins._recording(q, k, v, u, w_p, b_p, s)
        (logits,) = vipe_margins._logits
        want = vipe.vipe_attention_naive(q, k, v, u, w_p, b_p, s)
        assert torch.allclose(logits.softmax(-1) @ v, want, atol=1e-12), (logits.softmax(-1) @ v - want).abs().max()


def test_plateau_replay_retrains_the_runs_own_next_steps(tmp_path):
    """With c = 1 and the run's own eps the replay is the run itself: from the checkpoint at step 3,
    the losses of steps 4-6 of the same run continued (--resume continues bit for bit on the CPU)."""
    import shutil
    run = tiny_run(tmp_path, task="parity", method="vipe", train_lengths=[2, 3], train_set=16, weight_decay=0.0)
    shutil.copy(run / train.CKPT, tmp_path / "at3.pt")
    cfg = cli.make_config({"device": "cpu", "steps": 6, "batch_size": 4, "n_eval": 2, "d_model": 16, "n_layers": 1,
                           "n_heads": 1, "out": str(tmp_path), "task": "parity", "method": "vipe",
                           "train_lengths": [2, 3], "train_set": 16, "weight_decay": 0.0}, "cpu")
    losses = dict(train.train(cfg, resume=True, log=lambda *_: None)["loss"])
    out = script("plateau_replay.py", tmp_path / "at3.pt", "--steps", 2, "--scales", "1,1000",
                 "--eps", f"{cfg.adam_eps:g},1", "--json", tmp_path / "r.json")
    (r,) = json.loads((tmp_path / "r.json").read_text())
    same = r["runs"][0]
    assert (same["eps"], same["scale"]) == (cfg.adam_eps, 1.0) and r["step"] == 3 and "x1000" in out
    assert same["first_loss"] == pytest.approx(losses[4], rel=1e-6)
    assert same["highest_after"] == pytest.approx(max(losses[5], losses[6]), rel=1e-6)
    assert same["last"] == pytest.approx(losses[6], rel=1e-6)
    big_eps = [x for x in r["runs"] if x["eps"] == 1.0]       # eps 1: steps of ~lr * g, the loss barely moves
    assert len(big_eps) == 2 and all(abs(x["last"] - x["first_loss"]) < abs(same["last"] - same["first_loss"])
                                     for x in big_eps)


def test_loss_jumps_reads_finished_and_running_runs(tmp_path):
    run = tiny_run(tmp_path, task="copy", method="rope", train_lengths=[1, 2, 3])
    out = script("loss_jumps.py", run, "--json", tmp_path / "s.json")
    (row,) = json.loads((tmp_path / "s.json").read_text())
    assert row["finished"] and row["steps"] == 3 and row["logit_max_last"] > 0 and 0 <= row["in_dist_exact"] <= 1
    (run / "metrics.json").unlink()                      # a run still going: its checkpoint
    out = script("loss_jumps.py", run, "--json", tmp_path / "s.json", "--every", 2)
    (row,) = json.loads((tmp_path / "s.json").read_text())
    assert not row["finished"] and row["steps"] == 3 and "run" in out
    ckpt = torch.load(run / train.CKPT, weights_only=False)
    loss = dict(checkpoint_losses(ckpt["losses"]))
    (last_step, logits), = ckpt["logit_max"]             # one checkpoint, at the last step
    assert last_step == 3 and row["intervals"] == [[2, max(loss[1], loss[2]), None], [3, loss[3], max(logits)]]
    assert "to step       3" in out


def test_loss_jumps_reads_its_own_json_back_and_draws_it(tmp_path):
    """A JSON file that --json wrote gives the same rows again (the plot's inputs), and --plot draws them;
    --plot without intervals and --names of the wrong count are one-line errors."""
    run = tiny_run(tmp_path, task="copy", method="rope", train_lengths=[1, 2, 3])
    script("loss_jumps.py", run, "--json", tmp_path / "a.json", "--every", 2)
    script("loss_jumps.py", tmp_path / "a.json", run, "--every", 2, "--json", tmp_path / "b.json",
           "--names", "first,second", "--plot", tmp_path / "p.png")
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert b == a + a and (tmp_path / "p.png").stat().st_size > 1000
    for args, want in (((run, "--plot", tmp_path / "q.png"), "needs every run's intervals"),
                       ((run, "--every", 2, "--names", "x,y", "--plot", tmp_path / "q.png"), "2 names for 1")):
        done = subprocess.run([sys.executable, str(ROOT / "docs" / "perf" / "loss_jumps.py"), *map(str, args)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 2 and want in done.stderr, done.stderr
    assert not (tmp_path / "q.png").exists()


def test_loss_jumps_settled_needs_a_whole_window_below_the_threshold():
    """A single low batch in the learning phase does not count as settled; the highest loss is read
    from the settled step on, so a dip before it is not a jump after it."""
    loss_jumps = perf_module("loss_jumps")
    losses = [(1, 2.0), (2, 0.005), (3, 0.3), (4, 0.004), (5, 0.003), (6, 0.002), (7, 0.2), (8, 0.001),
              (9, 0.001), (10, 0.001), (11, 0.002), (12, 0.0005)]
    assert loss_jumps.settled(losses, 3) == 4 and loss_jumps.settled(losses, 4) == 8
    assert loss_jumps.settled(losses, 6) is None and loss_jumps.settled(losses[:11], 4) == 8
    # after settling at 4: up to 1.5 at 6 (back below 0.01 at 9); 0.5 (not a jump); 1.2 at 11 (back at 13), whose
    # 2.0 at 12 is the same jump; 3.0 at 15, never back down
    losses = [(1, 2.0), (4, 0.001), (6, 1.5), (7, 0.3), (9, 0.005), (10, 0.5), (11, 1.2), (12, 2.0), (13, 0.002),
              (14, 0.1), (15, 3.0), (16, 0.4)]
    assert loss_jumps.jumps(losses, 4) == [[6, 3], [11, 2], [15, None]] and loss_jumps.jumps(losses, None) == []
    assert loss_jumps.jumps(losses, 11) == [[15, None]]


@pytest.mark.parametrize("method", ["vipe", "rope"])
def test_batched_seeds_train_each_seed_as_if_alone(tmp_path, method):
    """Three seeds as one vmapped model against each seed trained alone by train.Step, 12 steps: every
    step's loss agrees to float rounding (seen: ~2e-7; with one clip norm shared by the seeds, 4e-4)."""
    out = tmp_path / "b.json"
    script("batched_seeds.py", "--task", "parity", "--method", method, "--seeds", 3, "--steps", 12, "--check",
           "--device", "cpu", "--workers", 0, "--d-model", 16, "--n-heads", 1, "--batch-size", 8, "--out", out)
    result = json.loads(out.read_text())
    assert result["seeds"] == 3 and result["batched_steps_per_s"] > 0
    assert result["largest_relative_loss_difference"] < 1e-5


def test_prism_copy_speed_trains_every_copy_task(tmp_path):
    out = tmp_path / "speed.json"
    script("prism_copy_speed.py", "--device", "cpu", "--steps", 0, "--torch-steps", 2, "--tiny", "--out", out)
    rows = json.loads(out.read_text())["rows"]
    assert [r["task"] for r in rows] == ["reverse", "dyn_str_cpy", "scan_cot"]
    assert all(r["backend"] == "torch" and r["steps"] == 2 and r["steps_per_s"] > 0 for r in rows)


def test_step_profile_times_and_profiles_a_step(tmp_path):
    """stack: --tiny keeps as many layers as the blocks PRISM's positions feed (prism_blocks 0 and 3)."""
    out = tmp_path / "profile.json"
    text = script("step_profile.py", "--experiment", "prism-more", "--task", "stack", "--device", "cpu", "--tiny",
                  "--steps", 1, "--warm", 0, "--top", 5, "--out", out)
    got = json.loads(out.read_text())
    assert got["steps_per_s"] > 0 and 0 < got["eager_busy_ms"] and len(got["top"]) == 5
    assert got["top"][0][1] >= got["top"][-1][1] and "aten::" in text
    assert got["n_evals"] == 1 and got["projected_s"] > got["steps"] / got["steps_per_s"]


def test_step_profile_pads_its_batches_to_the_bucket_given(tmp_path):
    """add_cot's full setup trains on 1-10 digits; its 10-digit sums make 78-83 tokens, padded to 80 or 88 by a
    bucket of 8 and to 96 by the default 32, at the longest length as when mixed as in training (--as-trained)."""
    out = tmp_path / "profile.json"
    args = ["--experiment", "prism-add", "--budget", "full", "--label", "prism-full", "--device", "cpu", "--tiny",
            "--steps", 2, "--warm", 0, "--top", 0, "--no-eval", "--out", out]
    for extra, bucket, padded in (([], 32, {96}), (["--bucket", 8], 8, {80, 88}),
                                  (["--bucket", 8, "--as-trained"], 8, {8 * k for k in range(1, 12)})):
        script("step_profile.py", *args, *extra)
        got = json.loads(out.read_text())
        assert got["bucket"] == bucket and got["as_trained"] == ("--as-trained" in extra)
        assert got["padded"] and set(got["padded"]) <= padded, (extra, got["padded"])
        assert "top" not in got and got["steps_per_s"] > 0            # --top 0: no profile


def test_eval_speed_times_each_pass_size_on_the_same_examples(tmp_path):
    """Eager only (compiling PRISM on the CPU takes minutes): one pass of a few sequences against passes
    of many, the same examples and so the same counts (a tolerance for float rounding in passes of
    other shapes)."""
    out = tmp_path / "eval.json"
    text = script("eval_speed.py", "--experiment", "prism-copy", "--task", "copy", "--device", "cpu", "--tiny",
                  "--no-compile", "--tokens", "64,4096", "--out", out)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["way"], r["tokens"]) for r in rows] == [("eager", 64), ("eager", 4096)], text
    assert all(r["seconds"] > 0 for r in rows) and rows[0]["exact"] == rows[1]["exact"]
    assert rows[0]["token_sum"] > 0 and abs(rows[0]["token_sum"] - rows[1]["token_sum"]) < 1e-3


def test_step_profile_picks_the_full_budgets_run_and_counts_its_evaluations(tmp_path):
    out = tmp_path / "profile.json"
    script("step_profile.py", "--experiment", "upe-add", "--budget", "full", "--label", "rpe-full", "--device", "cpu",
           "--tiny", "--steps", 2, "--top", 0, "--out", out)
    got = json.loads(out.read_text())
    assert (got["task"], got["run"], got["steps"]) == ("add_padded", "rpe-full", 30_000)
    assert got["n_evals"] == 31     # every 1000 of 30k steps, and the final one
    assert got["eval_during_s"] == got["eval_s"]   # every evaluation takes n_eval examples a length
    text = script("step_profile.py", "--experiment", "prism-add", "--budget", "full", "--label", "prism-full",
                  "--device", "cpu", "--tiny", "--steps", 2, "--top", 0, "--out", out)
    assert "18000 steps at (1)'s rate + 18 evaluations during training + the final one" in text, text
    assert "at most: the evaluations wait for a loss below 0.1" in text
    got = json.loads(out.read_text())              # (full size: 34 a length during training, 1,000 at the end)
    assert "(2 examples a length)" in text and "during training (1 a length)" in text
    assert got["projected_s"] == pytest.approx(18_000 / got["steps_per_s"] + 18 * got["eval_during_s"] + got["eval_s"])
    with pytest.raises(AssertionError, match="has no run"):
        script("step_profile.py", "--experiment", "upe-add", "--label", "upe", "--device", "cpu", "--tiny")


def test_vipe_finetune_fine_tunes_and_tests_as_the_loop_does(tmp_path):
    """From a run's final checkpoint, the schedule fixed:N is the loop's own fine-tuning (vipe_finetune
    = N, a fresh AdamW) and test: the same token accuracy at every length, the training lengths too, and
    other than the model as trained at that s; for the checkpoint as trained, the same as the loop's s = 1
    ablation; a ramp ends elsewhere."""
    run = tiny_run(tmp_path, task="parity", method="vipe", train_lengths=[16], test_lengths=[8, 16, 20, 48],
                   opts={"vipe_finetune": 10}, n_eval=4, lr=0.05, warmup=1)    # 10 steps that change the test
    metrics = json.loads((run / "metrics.json").read_text())
    script("vipe_finetune.py", run / train.CKPT, "--schedules", "fixed:10,ramp:10", "--n", 4,
           "--json", tmp_path / "f.json")
    (r,) = json.loads((tmp_path / "f.json").read_text())
    token = lambda rows, L: next(x["token"] for x in rows if x["length"] == L)      # noqa: E731
    one = metrics["eval_ablations"]["s = 1, no fine-tuning"]
    assert r["step"] == 3 and r["s"] == 3.0
    assert r["as trained, s = 1"]["token"][0] == pytest.approx((token(one, 8) + token(one, 16)) / 2)
    assert r["as trained, s = 1"]["token"][1] == pytest.approx(token(one, 20))
    fixed, ramp = r["schedules"]
    assert fixed["schedule"] == "fixed:10" and ramp["schedule"] == "ramp:10"
    as_trained = metrics["eval_ablations"]["s = L_test_max / L_train_max, no fine-tuning"]   # at s = 3 too
    assert fixed["all at s"]["token"][0] != pytest.approx((token(as_trained, 8) + token(as_trained, 16)) / 2)  # moved
    assert fixed["all at s"]["token"][0] == pytest.approx((token(metrics["eval"], 8) + token(metrics["eval"], 16)) / 2)
    assert fixed["all at s"]["token"][1] == pytest.approx(token(metrics["eval"], 20))
    assert fixed["all at s"]["token"][3] == pytest.approx(token(metrics["eval"], 48))
    assert ramp["loss_first"] != fixed["loss_first"]              # its first step runs at s = 1.2, not 3
    assert ramp["loss_max"] >= max(ramp["loss_first"], ramp["loss_every_100"][0]) and 1 <= ramp["loss_max_at"] <= 10
    ramped = tiny_run(tmp_path / "ramped", task="parity", method="vipe", train_lengths=[16], n_eval=4, lr=0.05,
                      warmup=1, test_lengths=[8, 16, 20, 48], opts={"vipe_finetune": 10, "vipe_ramp": True})
    loop = json.loads((ramped / "metrics.json").read_text())["eval"]   # the same run, the loop's ramp
    assert ramp["all at s"]["token"][1] == pytest.approx(token(loop, 20))
    assert ramp["all at s"]["token"][3] == pytest.approx(token(loop, 48))
    for start, same in ((3, True), (40, False)):          # --data-from: the run's batches from that step on
        script("vipe_finetune.py", run / train.CKPT, "--schedules", "fixed:10", "--n", 4, "--data-from", start,
               "--json", tmp_path / "g.json")
        (g,) = json.loads((tmp_path / "g.json").read_text())
        assert g["data_from"] == start and (g["schedules"][0]["loss_every_100"] == fixed["loss_every_100"]) == same


def test_multi_gpu_sums_each_experiments_commands_and_gives_the_efficiency(tmp_path):
    """Two experiments alone (one of them over two commands: 600 + 300 s) against one queue over
    2 GPUs in two commands (400 + 200 s): 1200 s alone, 600 s over both GPUs, efficiency 1.00."""
    one, every = tmp_path / "one.txt", tmp_path / "all.txt"
    one.write_text("a gpu 0 rc 124 start 1000 end 1600\nb gpu 1 rc 0 start 1000 end 1300\n"
                   "a gpu 0 rc 0 start 5000 end 5300\n")
    every.write_text("all rc 124 start 100 end 500\nall rc 0 start 900 end 1100\n")
    out = script("multi_gpu.py", one, every, "--gpus", "2", "--runs", "30")
    assert "a                    15.0 min alone" in out and "b                     5.0 min" in out, out
    assert "one experiment after another: 20.0 min (2 experiments)" in out and "2 GPUs, --reproduce all: 10.0 min" in out
    assert "runs per hour: 90 on one GPU, 180 on 2" in out and "speed-up 2.00x on 2 GPUs; scaling efficiency 1.00" in out
    every.write_text("all rc 0 start 100\n")
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "perf" / "multi_gpu.py"), one, every, "--gpus", "2"],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "not a line of NAME" in done.stderr


def test_step_profile_without_evaluation_and_its_option_checks(tmp_path):
    out = tmp_path / "profile.json"
    text = script("step_profile.py", "--experiment", "prism-more", "--task", "stack", "--device", "cpu", "--tiny",
                  "--steps", 1, "--warm", 0, "--top", 0, "--no-eval", "--out", out)
    got = json.loads(out.read_text())
    assert "(2)" not in text and "(4)" not in text and "eval_s" not in got
    assert got["steps_per_s"] > 0 and not got["tf32"]
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "perf" / "step_profile.py"), "--profile-compiled"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--profile-compiled profiles the compiled model: add --compile" in done.stderr


def test_prism_parts_times_each_part_and_its_matmul_mix_is_the_models(tmp_path):
    out = tmp_path / "parts.json"
    text = script("prism_parts.py", "--device", "cpu", "--tiny", "--reps", 1, "--no-compile", "--out", out)
    got = json.loads(out.read_text())
    assert got["reads"] == [3, 1] and got["T"] == 96, text          # stack: blocks 0 and 3 of --tiny's 4 layers
    assert [r[:2] for r in got["rows"]] == [["histogram scan", "vectorised step (CPU)"], ["cursor scores", "float32"],
                                            ["mix, 3 blocks", "broadcast multiply and sum"],
                                            ["mix, 3 blocks", "batched matrix product"],
                                            ["mix, 3 blocks", "every block in one pass"]], text
    assert all(r[2] > 0 for r in got["rows"])
    prism_parts = perf_module("prism_parts")
    import prism
    scores, alpha = torch.randn(2, 3, 4, 5, 6), torch.randn(3, 4)
    assert torch.allclose(prism_parts.mix_matmul(scores, alpha), prism.mix_cursors(scores, alpha), atol=1e-5)
    alphas = torch.randn(2, 3, 4)
    assert torch.allclose(prism_parts.mix_all(scores, alphas),
                          torch.stack([prism.mix_cursors(scores, x) for x in alphas]), atol=1e-5)
    assert [prism_parts.triton_width(P) for P in (96, 128, 129)] == [128, 128, 256]


def test_seed_table_reads_each_seed_and_the_top_3_rule(tmp_path, capsys):
    """Each seed's cell (up to / beyond the training length, "to L"), the mean (min-max) beyond it and the
    top-3 rule over evaluations during training, from metrics written here with known values; a seed
    without evaluations during training gives "-" for the rule; a folder without seeds is a one-line error."""
    def rows(exact):
        return [{"name": str(i + 1), "length": i + 1, "variant": None, "n": 10, "exact": e, "token": e}
                for i, e in enumerate(exact)]

    def write(label, seed, exact, history):
        d = tmp_path / "stack" / label / f"seed{seed}"
        d.mkdir(parents=True)
        m = {"seed": seed, "train_max_length": 2, "eval": rows(exact),
             "history": [{"step": 1000 * (i + 1), "eval": rows([1, 1, b, b])} for i, b in enumerate(history)]}
        (d / "metrics.json").write_text(json.dumps(m))

    seed_table = perf_module("seed_table")

    def table(*folders) -> list[str]:
        seed_table.main([str(f) for f in folders])
        return capsys.readouterr().out.splitlines()

    write("a", 0, [1.0, 0.95, 0.92, 0.5], [0.2, 0.6, 0.4, 0.7])
    write("a", 1, [0.8, 1.0, 0.1, 0.0], [])
    write("b", 2, [1.0, 1.0, 0.9, 0.3], [0.3])
    out = table(tmp_path / "stack" / "a", tmp_path / "stack" / "b")
    assert out[0] == "| run | seed 0 | seed 1 | seed 2 | beyond, mean (min-max) | the paper's rule (top 3) |"
    assert out[2] == "| stack/a | 0.975 / 0.710, to 3 | 0.900 / 0.050, to 0 |  | 0.380 (0.05-0.71) | - |", out
    assert out[3] == "| stack/b |  |  | 1.000 / 0.600, to 3 | 0.600 (one seed) | 0.300 (one seed) |", out
    (tmp_path / "stack" / "a" / "seed1" / "metrics.json").unlink()   # now seed 0 alone: (0.6 + 0.4 + 0.7) / 3
    assert table(tmp_path / "stack" / "a")[2].endswith("| 0.567 (one seed) |")
    (tmp_path / "copy").mkdir()                                      # stack/b again, from another place
    shutil.copytree(tmp_path / "stack" / "b", tmp_path / "copy" / "stack" / "b")
    twice = table(tmp_path / "stack" / "b", tmp_path / "copy" / "stack" / "b")
    assert [row.split(" | ")[0] for row in twice[2:]] == [f"| {tmp_path / 'stack' / 'b'}",
                                                          f"| {tmp_path / 'copy' / 'stack' / 'b'}"], twice
    with pytest.raises(SystemExit) as stop:
        table(tmp_path / "none")
    assert stop.value.code == 2 and "no seed*/metrics.json in" in capsys.readouterr().err


def test_seed_table_reads_a_trained_run(tmp_path):
    run = tiny_run(tmp_path, task="copy", method="rope", train_lengths=[1, 2, 3])
    m = json.loads((run / "metrics.json").read_text())
    top = m["train_max_length"]
    inside = [r["exact"] for r in m["eval"] if r["length"] <= top]
    beyond = [r["exact"] for r in m["eval"] if r["length"] > top]
    row = script("seed_table.py", run.parent).splitlines()[2]
    assert row.startswith(f"| copy/{run.parent.name} | {sum(inside) / len(inside):.3f} / "
                          f"{sum(beyond) / len(beyond):.3f}, to "), row


def test_vipe_hypotheses_commands_run_and_its_table_picks_the_best_checkpoint(tmp_path, capsys):
    """Every variant's command is one the command line takes (base, with its evaluations during training, and
    s2 run here at a tiny size); the table reads them, and its checkpoint rule picks, per seed, the evaluation
    with the best 17-24 of the paper's reading (hand-made metrics: step 2000's 0.5 over the end's 0.25)."""
    vh = perf_module("vipe_hypotheses")
    cmds = vh.commands("parity", "0", str(tmp_path / "runs"))
    assert len(cmds) == len(vh.VARIANTS) and all(c.startswith("python train.py ") for c in cmds)
    tiny = ["--preset", "cpu", "--steps", "4", "--d-model", "16", "--batch-size", "4", "--n-eval", "2",
            "--test-lengths", "8,16,20", "--device", "cpu"]
    for c in (cmds[0], cmds[-1]):
        argv = [a for a in c.replace("vipe_finetune=200", "vipe_finetune=2").replace("--eval-every 1000",
                "--eval-every 2").split()[2:]]
        drop = {"--preset", "--device"}
        argv = [a for i, a in enumerate(argv) if a not in drop and (i == 0 or argv[i - 1] not in drop)]
        assert cli.main(argv + tiny) == 0
    capsys.readouterr()
    text = vh.table(tmp_path / "runs" / "parity")
    base = next(line for line in text.splitlines() if line.startswith("| vipe-L2-base |"))
    assert base.endswith(", 4 |") or base.rsplit(", ", 1)[1].strip(" |") in ("2", "4"), base
    assert any(line.startswith("| vipe-L2-s2 |") for line in text.splitlines())

    # the paper's setup with s = 3 and s = 2 (--full), at the same tiny size: --readings gives each reading's row
    ramp = vh.FULL.format(task="parity", seeds="0", jobs=1, out="runs", tag="ramp", finetune=vh.FINETUNE["ramp"])
    assert "--tag L2-full-ramp --method-opt vipe_finetune=1000 --method-opt vipe_ramp=true" in ramp
    full = vh.FULL.format(task="parity", seeds="0", jobs=1, out=str(tmp_path / "full"), tag="s2also",
                          finetune=vh.FINETUNE["s2also"]).split()[2:]
    full = [a.replace("vipe_finetune=200", "vipe_finetune=2") for a in full]
    drop = {"--preset", "--device", "--steps", "--n-eval", "--train-set", "--workers", "--compile"}
    full = [a for i, a in enumerate(full) if a not in drop and (i == 0 or full[i - 1] not in drop - {"--compile"})]
    assert cli.main(full + tiny) == 0
    capsys.readouterr()
    text = vh.readings(tmp_path / "full" / "parity").splitlines()
    m = json.loads((tmp_path / "full" / "parity" / "vipe-L2-full-s2also" / "seed0" / "metrics.json").read_text())
    also = m["eval_ablations"]["s = 2, fine-tuned with it (vipe_s_also)"]
    line = next(line for line in text if "s = 2, fine-tuned with it" in line)
    assert "(s at 17-24: 2) | 1 | " in line and f"| {vh.value(also, 17, 24):.3f} (" in line
    assert sum("vipe-L2-full-s2also" in line for line in text) == 1 + len(m["eval_ablations"])
    drawn = vh.plot_readings(tmp_path / "full" / "parity", tmp_path / "readings.png")
    assert drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def rows(v):
        return [{"length": L, "exact": 1.0 if L <= 16 else v, "token": 1.0, "last": 1.0} for L in (8, 20)]
    m = {"config": {"steps": 4000}, "eval": rows(0.25),
         "history": [{"step": 1000, "final": rows(0.0)}, {"step": 2000, "final": rows(0.5)}]}
    assert vh.best_checkpoint(m) == (2000, rows(0.5))
    m["history"][1]["final"] = rows(0.25)                  # equal to the end's: the later one
    assert vh.best_checkpoint(m)[0] == 4000


def test_compact_results_thins_curves_and_keeps_every_evaluation(tmp_path):
    """compact_results.thin: 1,000 logged losses become at most 200 points with the last one kept, a spike
    between two kept points stays in loss_peak, values keep 4 significant digits; the evaluation rows and the
    evaluations during training are unchanged, and a short curve (a summary's) is left as it is."""
    compact_results = perf_module("compact_results")
    loss = [[s, 1.0 / s] for s in range(1, 1001)]
    peak = [list(p) for p in loss]
    peak[502] = [503, 7.123456]                                   # a jump at a step no thinned loss point has
    rows = [{"length": 3, "exact": 0.98828125}]
    m = {"loss": loss, "loss_peak": peak, "logit_max": [[s, [1.23456789, 2.0]] for s in range(0, 1000, 2)],
         "eval": rows, "history": [{"step": 500, "eval": rows}]}
    t = compact_results.thin(m)
    assert len(t["loss"]) <= 201 and t["loss"][-1] == [1000, 0.001] and t["loss"][1][1] == float(f"{1 / 6:.4g}")
    assert [503, 7.123] in t["loss_peak"] and len(t["loss_peak"]) <= 200
    assert t["logit_max"][0] == [0, [1.235, 2.0]] and t["curves_thinned"] == {"every": 5, "digits": 4}
    assert t["eval"] is rows and t["history"] == m["history"]
    short = {"loss": loss[:50]}
    assert compact_results.thin(short) is short
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.json").write_text(json.dumps(m))
    compact_results.compact(tmp_path)
    from evaluation import read_stored
    back = json.loads(read_stored(tmp_path / "run" / "metrics.json"))
    assert back["eval"] == rows and len(back["loss"]) <= 201


def test_sm90_resources_compiles_each_launch_of_a_call_for_the_gpu():
    """The cursor scores' two kernels at a small shape, recorded through the interpreter and compiled for sm_90:
    each line names the kernel, its constexprs and launch settings, and a register count and shared memory a
    compiler gives (at most 255 registers a thread, some shared memory for the products)."""
    out = script("sm90_resources.py", "prism_scores", "--length", 20, "--bins", 32)
    lines = [line for line in out.splitlines() if line.startswith("kernels.prism_scores.")]
    assert [line.split(" [")[0] for line in lines] == ["kernels.prism_scores._fwd", "kernels.prism_scores._bwd"]
    for line in lines:
        regs, shared = re.search(r": (\d+) registers, spills \d+ / \d+ bytes .*, (\d+) bytes shared", line).groups()
        assert "BT=32, BP=32, PREC=tf32; 8 warps, 1 stages" in line and 0 < int(regs) <= 255 and int(shared) > 0


def test_digit_accuracy_tables_each_length_by_offset_and_skips_runs_without_it(tmp_path):
    run = tiny_run(tmp_path / "a", task="mul_padded", method="upe", test_lengths=[2, 7])
    out = script("digit_accuracy.py", run.parent, "--below", "0.5")
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert lines[0].split(" | ")[2:] == [str(k) for k in range(22)] + ["22 |"]       # 20 digits + 3: offsets 0-22
    metrics = json.loads((run / "metrics.json").read_text())
    for r, line in zip(sorted(metrics["eval"], key=lambda r: r["length"]), lines[2:]):
        cells = line.strip("| ").split(" | ")
        assert cells[0] == str(r["length"]) and [float(c) for c in cells[2:]] == \
            [round(a, 2) for a in r["by_offset"]]
        first = next((k for k, a in enumerate(r["by_offset"]) if a < 0.5), "-")
        assert cells[1] == str(first)
    other = tiny_run(tmp_path / "b", task="copy", method="rope")
    assert "no evaluation with by_offset" in script("digit_accuracy.py", other.parent)


def test_prism_answer_copy_finds_the_sources_and_reads_a_trained_run(tmp_path):
    prism_answer_copy = perf_module("prism_answer_copy")
    from tasks import TASKS
    task = TASKS["add_cot"]
    tokens, _ = task.tokens(928, 30)               # 8 2 9 + 0 3 = 8 0 0 8 , 2 3 0 5 , 9 0 0 9 → 8 5 9 .
    x = torch.tensor([task.encode(tokens[:-1])])
    q, src = prism_answer_copy.copy_positions(task, x, 3)
    assert [tokens[i] for i in src[0]] == ["8", "5", "9"] == [tokens[i + 1] for i in q[0]]   # d of step k, answer k
    run = tiny_run(tmp_path, task="add_cot", method="prism", train_lengths=[1, 2, 3])
    out = script("prism_answer_copy.py", run, "3,4", 8)
    assert "copy head: layer 0, head 0" in out
    lines = {line.split(" digits")[0]: line for line in out.splitlines() if " digits (8 sums)" in line}
    assert set(lines) == {"3", "4"} and lines["4"].count("k=") == 4
    for cell in re.findall(r"k=\d+: ([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+)", out):
        w, hit, before, after = map(float, cell)
        assert 0 <= w <= 1 and hit + before + after <= 1.0001
    for a, b, ends in [(928, 30, "+"), (30, 928, "="), (5, 71, "=")]:     # the longer operand: a, b, b
        tokens, _ = task.tokens(a, b)
        x = torch.tensor([task.encode(tokens)])
        q, src = prism_answer_copy.next_digit_positions(task, x, len(str(max(a, b))))
        assert [tokens[i + 1] for i in q[0]][-1] == "→" and set(tokens[i + 1] for i in q[0][:-1]) <= {","}
        longer = str(max(a, b))[::-1]
        assert [tokens[i] for i in src[0]] == list(longer[1:]) + [ends]
    out = script("prism_answer_copy.py", run, "3,4", 8, "--read-a")
    assert "reading head: layer 0, head 0" in out and "the longer operand's next digit" in out
    lines = [line for line in out.splitlines() if " digits (8 sums)" in line]
    assert [line.count("k=") for line in lines] == [3, 4]
    for L in (3, 4):
        (ra, na, rb, nb), = re.findall(rf"^{L} digits: (\d+) of (\d+) / (\d+) of (\d+)$", out, re.M)
        assert int(na) + int(nb) == 8 and int(ra) <= int(na) and int(rb) <= int(nb)
    x = torch.tensor([task.encode(task.tokens(a, b)[0])[:23] for a, b in [(928, 30), (30, 928)]])  # a, b longer
    right = torch.nn.functional.one_hot(torch.roll(x, -1, 1), len(task.vocab)).float()   # each next token
    assert prism_answer_copy.chain_ends(task, x, right, 3) == {"a": (1, 1), "b": (1, 1)}
    wrong = right.clone()
    wrong[:, 20] = torch.nn.functional.one_hot(torch.tensor(task.stoi[","]), len(task.vocab)).float()
    assert prism_answer_copy.chain_ends(task, x, wrong, 3) == {"a": (1, 0), "b": (1, 0)}


def test_run_state_reads_a_finished_run_and_its_checkpoint_alike(tmp_path, capsys):
    run_state = perf_module("run_state")
    run = tiny_run(tmp_path, task="copy", method="rope", train_lengths=[1, 2, 3], test_lengths=[2, 5],
                   eval_every=1, n_eval_during=4)
    model, meta = run_state.load_model(run)
    rows = run_state.history(meta)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["n"] == 4 and set(r["exact"]) >= {2, 5} for r in rows)
    finished = {k: v.clone() for k, v in model.state_dict().items()}
    (run / "metrics.json").unlink()
    (run / "model.pt").unlink()                                     # a run stopped between visits: its checkpoint
    model, meta = run_state.load_model(run)
    assert meta["step"] == 3 and meta["train_max_length"] == 3 and run_state.history(meta) == rows
    assert not model.training
    assert all(torch.equal(finished[k], v) for k, v in model.state_dict().items())
    out = script("run_state.py", run, "--ranges", "1-2,5-5", "--json", tmp_path / "h.json")
    assert "checkpoint at step 3; 3 evaluations" in out
    means = [[float(v) for v in line.split("|")[2:4]] for line in out.splitlines() if line.startswith("| 3 |")]
    want = [sum(v for L, v in rows[-1]["exact"].items() if a <= L <= b) / sum(a <= L <= b for L in rows[-1]["exact"])
            for a, b in [(1, 2), (5, 5)]]
    assert means == [[pytest.approx(w, abs=5e-4) for w in want]]
    saved = json.loads((tmp_path / "h.json").read_text())
    assert saved["checkpoint_step"] == 3 and [r["step"] for r in saved["evaluations"]] == [1, 2, 3]
    # the checkpoint and its saved evaluations drawn on one figure: the same means, one line per run and range
    out = script("run_state.py", run, tmp_path / "h.json", "--ranges", "1-2,5-5", "--plot", tmp_path / "h.png")
    assert out.count("| 3 |") == 2 and (tmp_path / "h.png").stat().st_size > 0
    series = {"checkpoint": rows, "saved": run_state.history(meta)}
    lines = run_state.plot(series, [(1, 2), (5, 5)], tmp_path / "h2.png")
    assert [label for label, _, _ in lines] == ["checkpoint, 1-2", "checkpoint, 5", "saved, 1-2", "saved, 5"]
    assert all(x == [1, 2, 3] for _, x, _ in lines)
    assert [y[-1] for _, _, y in lines[:2]] == [pytest.approx(w) for w in want]
    for bad, why in ((["--json", tmp_path / "j.json", run], "--json takes one run"),
                     (["--plot", tmp_path / "p.png"], "--plot needs --ranges")):
        with pytest.raises(SystemExit) as stop:
            run_state.main([str(run), *map(str, bad)])
        assert stop.value.code == 2 and why in capsys.readouterr().err
    (run / train.CKPT).unlink()
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "perf" / "run_state.py"), str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "neither metrics.json nor checkpoint.pt" in done.stderr


def test_prism_hist_reach_reads_each_steps_histograms_and_runs_on_a_trained_model(tmp_path):
    prism_hist_reach = perf_module("prism_hist_reach")
    from tasks import TASKS
    task = TASKS["add_cot"]
    x = torch.tensor([task.encode(task.tokens(928, 30)[0])])        # `=` at 6: the steps' d at 10, 15, 20
    T, P = x.shape[1], 32
    hist = torch.nn.functional.one_hot(torch.arange(T), P).float()   # each cursor at bin t, all its mass there
    hist = torch.stack([hist, 0.5 * hist + 0.5 * hist.roll(1, -1)])[:, None, None]   # (2, 1, 1, T, P)
    centre, peak = prism_hist_reach.at_steps(task, x, hist, 3)
    assert centre.shape == (3, 1, 2, 1) and centre[:, 0, 0, 0].tolist() == [10, 15, 20]
    assert centre[:, 0, 1, 0].tolist() == [10.5, 15.5, 20.5] and peak[:, 0, :, 0].tolist() == [[1, 0.5]] * 3
    run = tiny_run(tmp_path, task="add_cot", method="prism", train_lengths=[1, 2, 3])
    out = script("prism_hist_reach.py", run, "3,4", 8)
    lines = {line.split(" digits")[0]: line for line in out.splitlines() if " digits: " in line}
    assert set(lines) == {"3", "4"} and lines["4"].count("k=") == 4
    shares = [float(v) for v in re.findall(r"k=\d+: ([\d.]+) / ([\d.]+),", lines["3"])[0]]
    assert shares == [0.0, 0.0]                                     # no cursor is past its own reach at 3
    assert "past their reach in most sums at steps 3-3 of 4 digits (" in out and " of 1 heads;" in out
