"""train.py's command line with one more experiment, "tiny" (copy; nope and rope, seeds 0 and 1, 200 CPU
steps each), small enough to try --shard on a one-node Slurm in a minute. From the repository root:

    sbatch --array=0-1 --output=docs/results/slurm-shard/shard-%a.out \\
        --wrap 'python docs/results/slurm-shard/tiny.py --reproduce tiny --device cpu --out /tmp/tiny --shard $SLURM_ARRAY_TASK_ID/2'
    python docs/results/slurm-shard/tiny.py --reproduce tiny --device cpu --out /tmp/tiny
"""
import sys

sys.path.insert(0, ".")
import cli          # noqa: E402
import experiments  # noqa: E402

experiments.EXPERIMENTS["tiny"] = experiments.Experiment(
    claim="copy, train 1-5, test 2-10: a smoke test of --shard", scaled="200 steps on a CPU", paper={},
    runs=[dict(task="copy", method=m, steps=200, batch_size=16, d_model=32, n_layers=2, n_heads=2, n_eval=32,
               train_lengths=[1, 2, 3, 4, 5], test_lengths=[2, 5, 10]) for m in ("nope", "rope")],
    columns=[("5", (5, 5), "exact"), ("10", (10, 10), "exact")], seeds=[0, 1])
sys.exit(cli.main(sys.argv[1:]))
