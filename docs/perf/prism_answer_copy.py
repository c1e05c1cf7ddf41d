"""Which attention head copies add_cot's answer from its chain of thought, and where that copy goes wrong past the
training length. The answer's digit k (least significant first) repeats step k's sum digit d, which sits at
position `=` + 5k + 4; the token before the answer digit (the `→` for k = 0) is the query that predicts it. For
every layer and head, teacher-forced: the attention weight of those queries on their source, and how often the
source is the key they weigh most. The head with the most weight on the sources at the first length given is
the copy head; for it, per length and answer digit: the weight on the source, the share of examples whose
top key is the source, and whose top key is the d of the step before or after (5 tokens off).

    python docs/perf/prism_answer_copy.py RUN 10,12,14 [n]     # RUN: a finished run, or only its checkpoint
    python docs/perf/prism_answer_copy.py RUN 10,12,14 [n] --read-a         # the end of the chain

With --read-a the same for the end of the chain: the query is step k's sum digit d, which predicts the `,` that
goes on or the `→` that ends the chain, and its source is digit k + 1 of the operand with the most digits (a or b,
at random): at the last step the `+` after a or the `=` after b, the token that says the chain ends. "Before" and
"after" are one digit off. It also counts the sums whose last step's sum digit predicts `→`, apart for those whose
longer operand is a and those whose longer operand is b.

Run it from the repository root. Results: docs/perf/prism.md ("Where add_cot goes wrong").
"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, ".")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import prism  # noqa: E402
from model import batch_context  # noqa: E402
from run_state import load_model  # noqa: E402
from tasks import TASKS  # noqa: E402


def attention_maps(model, task, batch) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every PRISM layer's attention weights (B, H, T, T) on the batch, in block order, and the logits."""
    maps, weights = [], prism.PrismAttention.weights

    def keep(self, q, k, ctx):
        w = weights(self, q, k, ctx)
        maps.append(w.detach())
        return w
    prism.PrismAttention.weights = keep
    try:
        with torch.no_grad():
            logits = model(batch.x, batch_context(task, batch, "cpu"))
    finally:
        prism.PrismAttention.weights = weights
    return maps, logits


def copy_positions(task, x: torch.Tensor, L: int) -> tuple[np.ndarray, np.ndarray]:
    """(queries, sources), each (n, L): the query that predicts answer digit k and the position of step k's d."""
    eq = (x == task.stoi["="]).int().argmax(1).numpy()
    arrow = (x == task.stoi["→"]).int().argmax(1).numpy()
    k = np.arange(L)[None, :]
    return arrow[:, None] + k, eq[:, None] + 5 * k + 4


def next_digit_positions(task, x: torch.Tensor, L: int) -> tuple[np.ndarray, np.ndarray]:
    """(queries, sources), each (n, L): step k's d (which predicts `,` or `→`) and digit k + 1 of the operand with L
    digits (a or b, the other has 1..L), which for k = L - 1 is the `+` after a or the `=` after b."""
    eq = (x == task.stoi["="]).int().argmax(1).numpy()[:, None]
    plus = (x == task.stoi["+"]).int().argmax(1).numpy()[:, None]     # a's length
    k = np.arange(L)[None, :]
    return eq + 5 * k + 4, np.where(plus == L, k + 1, plus + 2 + k)


def chain_ends(task, x: torch.Tensor, logits: torch.Tensor, L: int) -> dict:
    """Teacher-forced: of the sums whose a has L digits (b too, or fewer), then of those whose b alone has L, how
    many, and in how many the last step's sum digit predicts `→` (the chain ends where it should)."""
    eq = (x == task.stoi["="]).int().argmax(1)
    a_longer = (x == task.stoi["+"]).int().argmax(1) == L
    ends = logits[torch.arange(len(x)), eq + 5 * (L - 1) + 4].argmax(-1) == task.stoi["→"]
    return {side: (int(m.sum()), int((ends & m).sum())) for side, m in (("a", a_longer), ("b", ~a_longer))}


def measure(model, task, L: int, n: int, rng, positions=copy_positions, off: int = 5) -> tuple[np.ndarray, dict]:
    """(layers, heads, L, 4): weight on the source, top key is the source, top key `off` before, `off` after; and
    `chain_ends` of the same sums."""
    batch = task.sample(n, L, rng)
    q, src = positions(task, batch.x, L)
    rows = np.arange(n)[:, None]
    out = []
    maps, logits = attention_maps(model, task, batch)
    for w in maps:
        w = w.numpy()                                              # (n, H, T, T)
        at = w[rows, :, q, :]                                      # (n, L, H, T)
        on_src = np.take_along_axis(at, src[:, :, None, None], -1)[..., 0]          # (n, L, H)
        top = at.argmax(-1)                                        # (n, L, H)
        s = src[:, :, None]
        out.append(np.stack([on_src.mean(0), (top == s).mean(0), (top == s - off).mean(0), (top == s + off).mean(0)],
                            -1).transpose(1, 0, 2))               # (H, L, 4)
    return np.stack(out), chain_ends(task, batch.x, logits, L)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    read_a = "--read-a" in argv
    argv = [a for a in argv if a != "--read-a"]
    run, lengths, n = Path(argv[0]), [int(a) for a in argv[1].split(",")], int(argv[2]) if len(argv) > 2 else 64
    model, meta = load_model(run)                        # a finished run, or a checkpoint at any step
    task = TASKS[meta["task"]]
    if task.name != "add_cot":
        raise SystemExit(f"{run}: an add_cot run, not {task.name}")
    rng = np.random.default_rng(7)
    how = (next_digit_positions, 1) if read_a else (copy_positions, 5)
    found, ends = {}, {}
    for L in lengths:
        found[L], ends[L] = measure(model, task, L, n, rng, *how)
    first = found[lengths[0]][..., 0].mean(-1)                     # (layers, heads): mean weight on the sources
    layer, head = np.unravel_index(first.argmax(), first.shape)
    what, k_is, off = (("the longer operand's next digit", "step", "one digit") if read_a else
                       ("the copy's source", "answer digit", "one step"))
    print(f"{run}: mean attention weight on {what} at {lengths[0]} digits, by layer (rows) and head:")
    for i, row in enumerate(first):
        print(f"  layer {i}: " + " ".join(f"{v:.2f}" for v in row))
    print(f"\n{'reading' if read_a else 'copy'} head: layer {layer}, head {head}. Per {k_is} k (0 = least "
          f"significant): weight on the source / top key is the source / top key {off} before / {off} after, mean "
          "over examples")
    for L in lengths:
        cells = [f"k={k}: {w:.2f} / {hit:.2f} / {before:.2f} / {after:.2f}"
                 for k, (w, hit, before, after) in enumerate(found[L][layer, head])]
        print(f"{L} digits ({n} sums): " + "; ".join(cells))
    if read_a:
        print("\nthe last step's sum digit predicts `→` (teacher-forced), in sums whose operand with the most "
              "digits is a / b:")
        for L in lengths:
            (na, ra), (nb, rb) = ends[L]["a"], ends[L]["b"]
            print(f"{L} digits: {ra} of {na} / {rb} of {nb}")


if __name__ == "__main__":
    main()
