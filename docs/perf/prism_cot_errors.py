"""Where does a trained chain-of-thought model (mul_cot, add_cot) go wrong beyond its training length?

Teacher-forced, like `evaluation.evaluate`: for each wrong example, the first wrong position, the
token expected and the token predicted, and where that position sits in the chain of thought.
mul_cot: which '+'-joined term, and how many `(e→0)` groups of that term come before it (a term
copies the later digits of b one group at a time, so the first term of a 10-digit b has 9 groups
while training, b up to 9 digits, shows at most 8). add_cot: which step (digit i) and which of its
four tokens (d_a, d_b, c_out, d), or which digit of the answer after '→'.

    python train.py --method prism --task mul_cot --curriculum --n-layers 5 --steps 2000 \\
        --method-opt prism_bins=1280 --method-opt prism_count_bias=1 --out runs
    python docs/perf/prism_cot_errors.py runs/mul_cot/prism/seed0 8,9,10,11,12 256

RUN: a finished run's seed folder, or one that holds only its checkpoint (`run_state.load_model`).
Run it from the repository root. Results: docs/perf/prism.md ("Where mul_cot goes wrong",
"Where add_cot goes wrong").
"""
import collections
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, ".")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import autocast, batch_context  # noqa: E402
from run_state import load_model  # noqa: E402
from tasks import IGNORE, TASKS  # noqa: E402

run, lengths, n = Path(sys.argv[1]), [int(a) for a in sys.argv[2].split(",")], int(sys.argv[3])
device = "cuda" if torch.cuda.is_available() else "cpu"
model, meta = load_model(run, device)                    # a finished run, or a checkpoint at any step
task = TASKS[meta["task"]]
rng = np.random.default_rng(7)


def position(task_name: str, out: list[str]):
    """Where the next token of the chain of thought `out` sits."""
    if task_name == "mul_cot":
        text = "".join(out)
        if "[" not in text:
            return f"copying a, character {len(text)}"
        return ("term", text.count("+"), "zero groups before", text.rsplit("+", 1)[-1].count("→0"))
    if "→" in out:                                        # add_cot's answer
        return ("answer digit", len(out) - out.index("→") - 1)
    step = out.count(",")
    slot = len(out) - (len(out) - out[::-1].index(",") if step else 0)
    return ("step", step, ("d_a", "d_b", "c_out", "d", "the , or → after d")[slot])


for L in lengths:
    b = task.sample(n, L, rng)
    with torch.no_grad(), autocast(device):
        pred = model(b.x.to(device), batch_context(task, b, device, 1.0)).float().argmax(-1).cpu()   # (n, T)
    wrong = (pred != b.y) & (b.y != IGNORE)                                                         # (n, T)
    kinds, where, per_example = collections.Counter(), collections.Counter(), collections.Counter()
    for i in range(n):
        idx = torch.nonzero(wrong[i]).flatten()
        per_example[min(len(idx), 5)] += 1                 # 5 = five or more
        if len(idx) == 0:
            continue
        t = int(idx[0])
        seq = task.decode(b.x[i][: t + 1])
        out = seq[seq.index("=") + 1:]                      # the chain of thought before the error
        kinds[(task.vocab[int(b.y[i, t])], task.vocab[int(pred[i, t])])] += 1
        where[position(task.name, out)] += 1
        if sum(kinds.values()) <= 3:
            print("   e.g.", "".join(seq)[-60:], "| expected", task.vocab[int(b.y[i, t])],
                  "predicted", task.vocab[int(pred[i, t])])
    print(f"length {L}: {n} examples, exact {1 - wrong.any(1).float().mean():.3f}; "
          f"wrong tokens per example {dict(sorted(per_example.items()))}")
    print("  first error (expected, predicted):", kinds.most_common(8))
    print("  first error at:", where.most_common(8))
