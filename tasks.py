"""Synthetic tasks for length extrapolation, one class per task, all registered in TASKS.

Every task yields aligned pairs (x, y): y[b, t] is the target for position t, -100 where nothing
is supervised. For language-model tasks y is x shifted left (the model predicts the next token),
for tagging tasks (a5, mqrar) and the bidirectional arithmetic tasks (add_padded, mul_padded) the
target sits at the position itself. The model is therefore always a per-position classifier.

    task = TASKS["copy"]
    batch = task.sample(4, 12, numpy.random.default_rng(0))   # 4 problems of length 12
    batch.x, batch.y, batch.length                             # (4, T), (4, T), (4,)
    task.decode(batch.x[0])                                    # ['3', '9', ..., '=', ...]

`length` always means the problem length (digits to copy, number of flip-flop instructions,
number of SCAN actions, ...), not the token count; the docstring of each task says which.
All randomness comes from the numpy Generator passed to `sample`.

Shapes: n examples, T tokens, L problem length.
"""
from __future__ import annotations

import inspect
import itertools
import signal
import sys
import weakref
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

IGNORE = -100  # target of positions that are not supervised (torch cross-entropy's ignore_index)
DIGITS = [str(d) for d in range(10)]


@dataclass
class Batch:
    x: torch.Tensor                    # (n, T) int64 input ids, padded with the task's pad id
    y: torch.Tensor                    # (n, T) int64 target for each position, -100 = not supervised
    length: torch.Tensor               # (n,) problem length, for the per-length plot
    slot: torch.Tensor | None = None   # (n, T) int64, UPE slots (-1 = relative)

    def take(self, start: int, stop: int | None) -> "Batch":
        """Examples start:stop."""
        return Batch(*(None if v is None else v[start:stop] for v in (self.x, self.y, self.length, self.slot)))


class Task:
    """Base class. A subclass sets the class attributes and implements
    `_sample(n, length, rng, **options)`; its keyword arguments are the task's options."""

    name: str = ""
    vocab: list[str] = []
    causal: bool = True
    train_lengths: list[int] = []
    test_lengths: list[int] = []
    min_length: int = 1
    pad: str = "<pad>"                 # batching pad token; every vocabulary has one
    variants: dict[str, dict] = {}     # named evaluation settings beyond length (flip-flop)
    by_offset: bool = False            # evaluation also scores each position counted back from the answer's end

    def __init__(self):
        self.stoi = {s: i for i, s in enumerate(self.vocab)}
        self.pad_id = self.stoi[self.pad]

    # ---- public API -------------------------------------------------------------------------
    def sample(self, n: int, length: int, rng: np.random.Generator, **opts) -> Batch:
        self.check_length(length, **opts)
        self.check_opts(opts)
        batch = self._sample(n, length, rng, **opts)
        return batch

    def decode(self, ids) -> list[str]:
        return [self.vocab[i] for i in _as_list(ids) if i != self.pad_id and i >= 0]

    def check_length(self, length: int, **opts) -> None:
        """Raise ValueError with a readable message if this task cannot produce `length`."""
        if int(length) != length or length < self.min_length:
            raise ValueError(f"task {self.name}: length {length} is impossible "
                             f"(lengths must be integers >= {self.min_length})")

    def check_opts(self, opts: dict) -> None:
        """Names and types; the values' ranges are checked where the task samples with them."""
        allowed = self.options()
        params = inspect.signature(self._sample).parameters
        for k, v in opts.items():
            if k not in allowed:
                raise ValueError(f"task {self.name} has no option {k!r} "
                                 f"(options: {', '.join(allowed) or 'none'})")
            kind = int if params[k].default is None else type(params[k].default)   # None: a width
            if isinstance(v, bool) != (kind is bool) or not isinstance(v, (int, float) if kind is float else kind):
                raise ValueError(f"task {self.name}: option {k} must be a{'n' if kind is int else ''} "
                                 f"{kind.__name__}, got {v!r}")

    def length_weights(self, lengths: list[int], **opts) -> np.ndarray | None:
        """Relative frequency of each training length (None: uniform)."""
        return None

    def every_example(self, length: int, **opts) -> Batch | None:
        """Every example of this length, where the task has a finite test set (None: sample)."""
        return None

    def options(self) -> list[str]:
        params = inspect.signature(self._sample).parameters
        return [p for p in params if p not in ("n", "length", "rng")]

    def encode(self, tokens: list[str]) -> list[int]:
        return [self.stoi[t] for t in tokens]

    # ---- helpers for subclasses ---------------------------------------------------------------
    def lm_batch(self, seqs: list[list[str]], n_prompt: list[int], length) -> Batch:
        """Language-model batch from token-string sequences: x = seq[:-1], y = seq[1:], and only
        the tokens after the first n_prompt ones are supervised (the answer, never the prompt)."""
        xs, ys = [], []
        for seq, k in zip(seqs, n_prompt):
            ids = self.encode(seq)
            xs.append(ids[:-1])
            ys.append([IGNORE if t + 1 < k else i for t, i in enumerate(ids[1:])])
        return self.collate(xs, ys, length)

    def collate(self, xs, ys, length) -> Batch:
        """Right-pad variable-length rows: x with the pad id, y with -100."""
        T = max(len(r) for r in xs)
        x = torch.full((len(xs), T), self.pad_id, dtype=torch.long)
        y = torch.full((len(xs), T), IGNORE, dtype=torch.long)
        for b, (xr, yr) in enumerate(zip(xs, ys)):
            x[b, :len(xr)] = torch.tensor(xr, dtype=torch.long)
            y[b, :len(yr)] = torch.tensor(yr, dtype=torch.long)
        lengths = torch.as_tensor(np.broadcast_to(np.asarray(length), (len(xs),)).copy())
        return Batch(x, y, lengths.long())

    def lm_arrays(self, seq: np.ndarray, supervised: np.ndarray, length: int) -> Batch:
        """Vectorised language-model batch from equal-length id arrays seq, supervised: (n, S)."""
        x = torch.from_numpy(seq[:, :-1].astype(np.int64))
        y = torch.from_numpy(np.where(supervised[:, 1:], seq[:, 1:], IGNORE).astype(np.int64))
        return Batch(x, y, torch.full((len(seq),), length, dtype=torch.long))


def _as_list(ids) -> list[int]:
    if isinstance(ids, torch.Tensor):
        return ids.tolist()
    return [int(i) for i in ids]


def collate(batches: list[Batch], pad_id: int) -> Batch:
    """Concatenate batches of different lengths into one, right-padding to the longest."""
    T = max(b.x.shape[1] for b in batches)

    def pad(t, value):
        return torch.nn.functional.pad(t, (0, T - t.shape[1]), value=value)

    x = torch.cat([pad(b.x, pad_id) for b in batches])
    y = torch.cat([pad(b.y, IGNORE) for b in batches])
    length = torch.cat([b.length for b in batches])
    slot = None
    if batches[0].slot is not None:
        slot = torch.cat([pad(b.slot, -1) for b in batches])
    return Batch(x, y, length, slot)


def sample_mixed(task: Task, n: int, lengths: list[int], rng: np.random.Generator, **opts) -> Batch:
    """n problems whose lengths are drawn from `lengths`, uniformly or as the task weighs them
    (one training batch)."""
    weights = task.length_weights(lengths, **opts)
    drawn = rng.choice(np.asarray(lengths), size=n, p=None if weights is None else weights / weights.sum())
    parts = [task.sample(int(c), int(L), rng, **opts)
             for L, c in zip(*np.unique(drawn, return_counts=True))]
    return collate(parts, task.pad_id)


def curriculum_lengths(step: int, steps: int, lengths: list[int], stage_steps: int = 0) -> list[int]:
    """PRISM's length curriculum (section 6.4): the maximum length steps through 5, 10, 20, 30, ...
    up to the largest training length, then stays there. With stage_steps = N > 0 the paper's own
    schedule: 5 for N steps, 10 for the next N, then 10 more every 2N steps (the paper: N = 5k);
    with 0, scaled to a run of `steps` steps: the stages in equal parts of its first half."""
    top = max(lengths)
    caps = [c for c in [5] + list(range(10, top, 10)) if c < top] + [top]
    if stage_steps:
        stage = step // stage_steps if step < 2 * stage_steps else 2 + (step - 2 * stage_steps) // (2 * stage_steps)
    else:
        stage = int(step / max(1, steps // 2) * len(caps))
    stage = min(len(caps) - 1, stage)
    allowed = [L for L in lengths if L <= caps[stage]]
    return allowed or [min(lengths)]


class TrainBatches(torch.utils.data.Dataset):
    """The training stream: step s's batch is sample_mixed with the generator seeded by (seed, s),
    so worker processes can make batches ahead of the loop in any order, and a resumed run
    continues the same stream. With curriculum, the lengths of step s are curriculum_lengths' (with
    curriculum_steps as its stage_steps).
    With train_set = N > 0 (the ViPE paper's fixed training set) the problems come from one set of
    N drawn once from the seed, in a new order each epoch of N // batch_size steps (the order of
    epoch e seeded by (seed, e)); batches keep the set's padded width."""

    def __init__(self, task: Task, lengths: list[int], batch_size: int, seed: int, steps: int,
                 curriculum: bool = False, train_set: int = 0, curriculum_steps: int = 0, **opts):
        self.task, self.lengths, self.batch_size, self.seed = task, lengths, batch_size, seed
        self.steps, self.curriculum, self.train_set, self.opts = steps, curriculum, train_set, opts
        self.curriculum_steps = curriculum_steps
        self._set = None                    # the fixed set, made on first use (in each worker)

    def __len__(self):
        return self.steps

    def __getitem__(self, step: int) -> Batch:
        if self.train_set:
            if self._set is None:
                self._set = sample_mixed(self.task, self.train_set, self.lengths,
                                         np.random.default_rng([self.seed, 4]), **self.opts)
            epoch, k = divmod(step, self.train_set // self.batch_size)
            order = np.random.default_rng([self.seed, 5, epoch]).permutation(self.train_set)
            rows = torch.from_numpy(order[k * self.batch_size:(k + 1) * self.batch_size])
            s = self._set
            return Batch(s.x[rows], s.y[rows], s.length[rows], None if s.slot is None else s.slot[rows])
        lengths = curriculum_lengths(step, self.steps, self.lengths, self.curriculum_steps) if self.curriculum \
            else self.lengths
        return sample_mixed(self.task, self.batch_size, lengths, np.random.default_rng([self.seed, 0, step]),
                            **self.opts)

    def loader(self, start: int, end: int, workers: int = 0):
        """The batches of steps start .. end - 1, in order; with workers > 0 made by that many
        processes, up to 4 batches each ahead. Workers send numpy arrays: one pickled message per
        batch, where torch tensors would each pass a shared-memory file descriptor. Workers ignore
        SIGINT and SIGTERM, which Ctrl-C or `timeout` send to the whole process group: the loop
        stops at a step with a checkpoint and then stops its workers itself. Where fork exists
        (Linux) the workers are forked, whatever the process's start method: a forked worker starts
        in milliseconds with the loop's signal handlers, where a spawned one (the default in a process
        that was itself spawned, as jobs.py's are) spends seconds importing the main module with the
        default ones, and a signal then kills it, and with it the run."""
        loader = torch.utils.data.DataLoader(
            self, batch_size=None, sampler=range(start, end), num_workers=workers,
            prefetch_factor=4 if workers else None, collate_fn=_to_numpy, worker_init_fn=_ignore_stop_signals,
            multiprocessing_context=("fork" if sys.platform == "linux" else None) if workers else None,
            generator=torch.Generator())  # its own: the global generator (APE's shifts) stays the model's
        batches = iter(loader)
        if workers:
            OPEN_LOADERS.add(batches)
        return (Batch(*(None if a is None else torch.from_numpy(a) for a in arrays)) for arrays in batches)


OPEN_LOADERS = weakref.WeakSet()   # the loaders with workers not yet stopped: close_loaders stops them


def close_loaders() -> int:
    """Stop the workers of every loader still open, as a loader does when it is closed (each worker
    told to finish, then joined), and return how many were open. A worker killed in place of this may
    die holding a lock that the loader's own stop takes later: the process that drops the loader then
    waits on that lock for ever. (torch has no public call for this: it is what a dropped loader runs.)"""
    open_ = [batches for batches in OPEN_LOADERS if not batches._shutdown]
    for batches in open_:
        batches._shutdown_workers()       # a second call does nothing
    OPEN_LOADERS.clear()
    return len(open_)


def _ignore_stop_signals(_worker: int):
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)


def _to_numpy(batch: Batch) -> tuple:
    return tuple(None if t is None else t.numpy() for t in (batch.x, batch.y, batch.length, batch.slot))


# =============================================================================================
# PaTH tasks: flip-flop, A5 word problem, MQRAR-N
# =============================================================================================

class FlipFlop(Task):
    """Flip-flop language modelling (Liu et al. 2023; PaTH Table 1). Causal.

    `length` = number of (instruction, bit) pairs, 256 in the paper (512 tokens). The first
    instruction is w, the last r; the middle ones are i.i.d. with P(i) = p_ignore and
    P(w) = P(r) = (1 - p_ignore) / 2. The bit after w or i is uniform; the bit after r equals the
    most recently written bit. Only the bits after r are supervised; the metric is the error rate
    at those bits. Train p_ignore = 0.8; evaluation variants ID (0.8), sparse (0.98), dense (0.1).

    Example (4 pairs):   w 1 i 0 w 0 r 0      x = w 1 i 0 w 0 r      y = . . . . . . 0
    Vocabulary: <pad> w r i 0 1.
    """
    name = "flipflop"
    vocab = ["<pad>", "w", "r", "i", "0", "1"]
    train_lengths = [256]
    test_lengths = [256]
    min_length = 2
    variants = {"ID": {"p_ignore": 0.8}, "sparse": {"p_ignore": 0.98}, "dense": {"p_ignore": 0.1}}

    def build(self, instr: np.ndarray, bits: np.ndarray) -> Batch:
        """instr: (n, L) ids of w/r/i; bits: (n, L) 0/1 draws. Reads get the last written bit."""
        n, L = instr.shape
        w, r = self.stoi["w"], self.stoi["r"]
        t = np.broadcast_to(np.arange(L), (n, L))
        last_w = np.maximum.accumulate(np.where(instr == w, t, -1), axis=1)  # (n, L) index of last w
        bits = np.where(instr == r, np.take_along_axis(bits, last_w, axis=1), bits)
        seq = np.empty((n, 2 * L), dtype=np.int64)                          # (n, 2L) interleaved
        seq[:, 0::2] = instr
        seq[:, 1::2] = bits + self.stoi["0"]
        supervised = np.zeros_like(seq, dtype=bool)
        supervised[:, 1::2] = instr == r
        return self.lm_arrays(seq, supervised, L)

    def _sample(self, n, length, rng, p_ignore=0.8):
        if not 0.0 <= p_ignore < 1.0:
            raise ValueError(f"task flipflop: p_ignore must be in [0, 1), got {p_ignore}")
        w, r, i = self.stoi["w"], self.stoi["r"], self.stoi["i"]
        p_wr = (1 - p_ignore) / 2
        u = rng.random(size=(n, length))
        instr = np.where(u < p_ignore, i, np.where(u < p_ignore + p_wr, w, r))
        instr[:, 0], instr[:, -1] = w, r
        bits = rng.integers(0, 2, size=(n, length))
        return self.build(instr, bits)


@lru_cache(maxsize=None)
def a5_elements() -> list[tuple[int, ...]]:
    """The 60 even permutations of (1..5), lexicographic, so index 0 is the identity."""
    def even(p):
        inversions = sum(p[i] > p[j] for i in range(5) for j in range(i + 1, 5))
        return inversions % 2 == 0
    return [p for p in itertools.permutations(range(1, 6)) if even(p)]


@lru_cache(maxsize=None)
def a5_table() -> np.ndarray:
    """(60, 60) multiplication table: index of a*b with (a*b)[i] = a[b[i]]."""
    elems = a5_elements()
    index = {p: k for k, p in enumerate(elems)}
    table = np.empty((60, 60), dtype=np.int64)
    for ia, a in enumerate(elems):
        for ib, b in enumerate(elems):
            table[ia, ib] = index[tuple(a[b[i] - 1] for i in range(5))]
    return table


A5_GENERATORS = ["23145", "31245", "24315", "41325", "25341", "51342"]  # (1 2 3), (1 2 4), (1 2 5), inverses


class A5(Task):
    """A5 word problem (PaTH Fig. 2: "a sequence of group operations using fixed generators and
    their inverses"; Merrill et al. 2024). Causal tagging.

    Inputs (option alphabet): "generators" (default, the PaTH paper's text) draws each token from the
    6 permutations g1 = (1 2 3), g2 = (1 2 4), g3 = (1 2 5) and their inverses; "elements" from all
    60 elements of A5, as in Merrill et al. Tokens are permutations in one-line notation ("12345"
    is the identity, id 0). The target at position t is the running product x_1 x_2 ... x_t with
    (a*b)[i] = a[b[i]], one of 60 classes. `length` = number of tokens; train 20 as in the paper
    (solved = accuracy above 90 %), test 10, 20, 30, 40.

    Example (generators):  x = 23145 24315 51342    y = 23145 34125 53124
    Example (elements):    x = 23145 13425          y = 23145 21435    (23145 * 13425 = 21435)
    Vocabulary: the 60 permutations, then <pad> (id 60).
    """
    name = "a5"
    vocab = ["".join(map(str, p)) for p in a5_elements()] + ["<pad>"]
    train_lengths = [20]
    test_lengths = [10, 20, 30, 40]
    ALPHABETS = ("generators", "elements")

    def build(self, elems: np.ndarray) -> Batch:
        """elems: (n, L) element ids -> targets = running products."""
        table = a5_table()
        prod = elems.copy()
        for t in range(1, elems.shape[1]):
            prod[:, t] = table[prod[:, t - 1], elems[:, t]]
        return Batch(torch.from_numpy(elems.astype(np.int64)), torch.from_numpy(prod),
                     torch.full((len(elems),), elems.shape[1], dtype=torch.long))

    def _sample(self, n, length, rng, alphabet="generators"):
        if alphabet not in self.ALPHABETS:
            raise ValueError(f"task a5: alphabet must be one of {', '.join(self.ALPHABETS)}, got {alphabet!r}")
        if alphabet == "elements":
            return self.build(rng.integers(0, 60, size=(n, length)))
        gens = np.array([self.stoi[g] for g in A5_GENERATORS])
        return self.build(gens[rng.integers(0, len(gens), size=(n, length))])


class MQRAR(Task):
    """Multi-query repeated associative recall with N-back (PaTH Fig. 2). Causal tagging.

    A stream of `key value` assignments over n_keys keys and n_values values. At every key token
    whose key already has at least N earlier assignments, the target is the N-th most recent
    earlier value of that key; nothing else is supervised. `length` = number of assignments
    (the paper: 384 assignments = 768 tokens, 32 keys, N in 1..4); train and test 384.

    Example (N = 2), keys A B C D written k0 k1 k2 k3 and values 1..9,0 written v1..v9,v0:
        x = A 1 B 2 C 3 D 4 A 5 B 6 A 7 C 8 A 9 B 0
        y = . . . . . . . . . . . . 1 . . . 5 . 2 .
    Vocabulary: <pad>, k0..k{n_keys-1}, v0..v{n_values-1} (32 of each).
    """
    name = "mqrar"
    n_max = 32
    vocab = ["<pad>"] + [f"k{i}" for i in range(n_max)] + [f"v{i}" for i in range(n_max)]
    train_lengths = [384]
    test_lengths = [384]

    def build(self, keys: np.ndarray, values: np.ndarray, n_back: int) -> Batch:
        """keys, values: (n, L) indices. Sorting each row's positions by key (stably, so in time
        order within a key) puts a key's N-th most recent earlier assignment N places before it."""
        n, L = keys.shape
        k8, v8 = keys.astype(np.uint8), values.astype(np.uint8)             # uint8: argsort is a radix sort
        order = np.argsort(k8, axis=1, kind="stable")                       # (n, L) positions by key
        k_sorted, v_sorted = np.take_along_axis(k8, order, 1), np.take_along_axis(v8, order, 1).astype(np.int64)
        back = np.full((n, L), IGNORE)                                      # (n, L) in sorted order
        if n_back < L:
            hit = k_sorted[:, n_back:] == k_sorted[:, :-n_back]
            back[:, n_back:] = np.where(hit, v_sorted[:, :-n_back] + 1 + self.n_max, IGNORE)
        target = np.empty((n, L), dtype=np.int64)
        np.put_along_axis(target, order, back, 1)                           # back to time order
        x = np.empty((n, 2 * L), dtype=np.int64)
        x[:, 0::2], x[:, 1::2] = keys + 1, values + 1 + self.n_max
        y = np.full((n, 2 * L), IGNORE, dtype=np.int64)
        y[:, 0::2] = target
        return Batch(torch.from_numpy(x), torch.from_numpy(y), torch.full((n,), L, dtype=torch.long))

    def _sample(self, n, length, rng, n_back=1, n_keys=32, n_values=32):
        if not 1 <= n_back <= 8:
            raise ValueError(f"task mqrar: n_back must be in 1..8, got {n_back}")
        if not (1 <= n_keys <= self.n_max and 1 <= n_values <= self.n_max):
            raise ValueError(f"task mqrar: n_keys and n_values must be in 1..{self.n_max}")
        return self.build(rng.integers(0, n_keys, size=(n, length)),
                          rng.integers(0, n_values, size=(n, length)), n_back)


# =============================================================================================
# PRISM tasks: copy, reverse, odds_first, stack, add_cot, mul_cot, dyn_str_cpy, scan_cot
# =============================================================================================

class _DigitsTask(Task):
    """Base of copy / reverse / odds_first: `digits = f(digits) <eos>`, answer supervised.
    A subclass implements answer(ids: (n, L)) -> (n, L)."""
    vocab = ["<pad>"] + DIGITS + ["=", "<eos>"]
    train_lengths = list(range(1, 11))
    test_lengths = list(range(1, 101))

    def build(self, digits: np.ndarray) -> Batch:
        """digits: (n, L) values 0..9."""
        n, L = digits.shape
        ids = digits + self.stoi["0"]
        eq, eos = np.full((n, 1), self.stoi["="]), np.full((n, 1), self.stoi["<eos>"])
        seq = np.concatenate([ids, eq, self.answer(ids), eos], axis=1)   # (n, 2L + 2)
        supervised = np.zeros_like(seq, dtype=bool)
        supervised[:, L + 1:] = True
        return self.lm_arrays(seq, supervised, L)

    def _sample(self, n, length, rng):
        return self.build(rng.integers(0, 10, size=(n, length)))


class Copy(_DigitsTask):
    """Copy (PRISM Table 3). Causal. `length` = number of digits; train 1..10, test to 100.

    Example:  8 3 4 9 2 1 6 = 8 3 4 9 2 1 6 <eos>   (supervised after '=')
    Vocabulary: <pad> 0-9 = <eos>.
    """
    name = "copy"

    def answer(self, ids):
        return ids


class Reverse(_DigitsTask):
    """Reverse (PRISM Table 3). Causal. `length` = number of digits; train 1..10, test to 100.

    Example:  8 3 4 9 2 1 6 = 6 1 2 9 4 3 8 <eos>
    Vocabulary: <pad> 0-9 = <eos>.
    """
    name = "reverse"

    def answer(self, ids):
        return ids[:, ::-1]


class OddsFirst(_DigitsTask):
    """Odds first (PRISM Table 3). Causal. The digits at 0-based odd positions in order, then
    those at even positions. `length` = number of digits; train 1..40, test to 150.

    Example:  0 1 2 3 4 5 = 1 3 5 0 2 4 <eos>
    Vocabulary: <pad> 0-9 = <eos>.
    """
    name = "odds_first"
    train_lengths = list(range(1, 41))
    test_lengths = list(range(1, 151))

    def answer(self, ids):
        return np.concatenate([ids[:, 1::2], ids[:, 0::2]], axis=1)


class Stack(Task):
    """Stack manipulation (PRISM Table 3, DeepMind). Causal.

    An initial binary stack written bottom -> top, then actions 2 = POP, 3 = PUSH 0, 4 = PUSH 1
    (POP on an empty stack is ignored); `length` = total number of tokens left of '=' (stack plus
    actions). Answer: the final stack top -> bottom, terminator 2, zeros up to length + 1 tokens,
    then <eos>. Train 1..40, test to 150.

    Example:  0 1 1 0 4 2 2 = 1 1 0 2 0 0 0 0 <eos>
    Vocabulary: <pad> 0 1 2 3 4 = <eos>.
    """
    name = "stack"
    vocab = ["<pad>", "0", "1", "2", "3", "4", "=", "<eos>"]
    train_lengths = list(range(1, 41))
    test_lengths = list(range(1, 151))

    @staticmethod
    def run(stack: list[int], actions: list[int]) -> list[int]:
        stack = list(stack)
        for a in actions:
            if a == 2:
                if stack:
                    stack.pop()
            else:
                stack.append(a - 3)
        return stack

    def tokens(self, stack: list[int], actions: list[int]) -> tuple[list[str], int]:
        final = self.run(stack, actions)[::-1] + [2]
        ell = len(stack) + len(actions)
        answer = final + [0] * (ell + 1 - len(final))
        prompt = [str(s) for s in stack + actions] + ["="]
        return prompt + [str(a) for a in answer] + ["<eos>"], len(prompt)

    def _sample(self, n, length, rng):
        """Every row at once: `tokens` for the stacks and actions drawn, the stacks run as arrays."""
        m = rng.integers(0, length + 1, size=n)                   # (n,) initial stack size; the rest are actions
        first = np.arange(length) < m[:, None]                    # (n, L) part of the initial stack
        prompt = np.where(first, rng.integers(0, 2, size=(n, length)), rng.integers(2, 5, size=(n, length)))
        rows, stack = np.arange(n), np.zeros((n, length + 1), dtype=np.int64)   # (n, L + 1) bottom first
        size = np.zeros(n, dtype=np.int64)
        for j in range(length):
            push = first[:, j] | (prompt[:, j] >= 3)              # an initial value, PUSH 0 or PUSH 1
            value = np.where(first[:, j], prompt[:, j], prompt[:, j] - 3)
            stack[rows, size] = np.where(push, value, stack[rows, size])
            size = np.where(push, size + 1, np.maximum(size - 1, 0))   # POP on an empty stack: ignored
        i = np.arange(length + 1)                                 # answer: top -> bottom, 2, zeros
        below_top = np.take_along_axis(stack, np.clip(size[:, None] - 1 - i, 0, length), 1)
        answer = np.where(i < size[:, None], below_top, np.where(i == size[:, None], 2, 0))
        seq = np.concatenate([prompt + 1, np.full((n, 1), self.stoi["="]), answer + 1,   # digit d: id d + 1
                              np.full((n, 1), self.stoi["<eos>"])], axis=1)           # (n, 2L + 3)
        return self.lm_arrays(seq, np.broadcast_to(np.arange(2 * length + 3) > length, seq.shape), length)


def _digits_lsd_first(v: int) -> list[int]:
    return [int(c) for c in str(v)[::-1]]


class AddCoT(Task):
    """Addition with chain of thought (PRISM Table 3). Causal.

    Operands least-significant digit first, '+', '=', then one comma-separated step per digit
    `d_a d_b c_out d`, then '→', the sum LSD first (with a final carry digit when it is 1), '.'.
    `length` = digits of the longer operand (the other has 1..length digits). Train 1..10, test
    to 30.

    Example (928 + 30):  8 2 9 + 0 3 = 8 0 0 8 , 2 3 0 5 , 9 0 0 9 → 8 5 9 .
    Vocabulary: <pad> 0-9 + = , → .
    """
    name = "add_cot"
    vocab = ["<pad>"] + DIGITS + ["+", "=", ",", "→", "."]
    train_lengths = list(range(1, 11))
    test_lengths = list(range(1, 31))

    def tokens(self, a: int, b: int) -> tuple[list[str], int]:
        da, db = _digits_lsd_first(a), _digits_lsd_first(b)
        prompt = [str(d) for d in da] + ["+"] + [str(d) for d in db] + ["="]
        steps, carry = [], 0
        for i in range(max(len(da), len(db))):
            x = da[i] if i < len(da) else 0
            y = db[i] if i < len(db) else 0
            total = x + y + carry
            carry = total // 10
            steps.append([str(x), str(y), str(carry), str(total % 10)])
        cot = list(itertools.chain.from_iterable(s + [","] for s in steps))[:-1]
        return prompt + cot + ["→"] + [str(d) for d in _digits_lsd_first(a + b)] + ["."], len(prompt)

    def _sample(self, n, length, rng):
        """`tokens` for a batch at once, in numpy: one operand of exactly `length` digits, the other
        of 1..length digits, in random order (tested equal to `tokens` row by row)."""
        L, d0, rows, j = length, self.stoi["0"], np.arange(n)[:, None], np.arange(length)[None, :]
        long, k = rng.integers(0, 10, size=(n, L)), rng.integers(1, L + 1, size=n)     # LSD first
        long[:, L - 1] = rng.integers(0 if L == 1 else 1, 10, size=n)               # exactly L digits
        short = np.where(j < k[:, None], rng.integers(0, 10, size=(n, L)), 0)
        short[np.arange(n), k - 1] = np.where(k == 1, short[np.arange(n), 0], rng.integers(1, 10, size=n))
        swap = rng.random(n) < 0.5
        A, B = np.where(swap[:, None], short, long), np.where(swap[:, None], long, short)   # (n, L)
        la, lb = np.where(swap, k, L), np.where(swap, L, k)
        carry, digit = np.zeros((n, L), dtype=np.int64), np.zeros((n, L), dtype=np.int64)
        c = np.zeros(n, dtype=np.int64)
        for i in range(L):
            c, digit[:, i] = divmod(A[:, i] + B[:, i] + c, 10)
            carry[:, i] = c
        p0 = la + lb + 2                                                 # where the steps start
        end = p0 + 6 * L + c                                             # the '.' (after '→' and the sum)
        seq = np.full((n, end.max() + 1), self.pad_id, dtype=np.int64)
        seq[np.nonzero(j < la[:, None])] = (A + d0)[j < la[:, None]]
        seq[np.arange(n), la] = self.stoi["+"]
        b_at = j < lb[:, None]
        seq[rows.repeat(L, 1)[b_at], (la[:, None] + 1 + j)[b_at]] = (B + d0)[b_at]
        seq[np.arange(n), la + lb + 1] = self.stoi["="]
        for q, part in enumerate((A, B, carry, digit)):                 # step i: d_a d_b c_out d ,
            seq[rows, p0[:, None] + 5 * j + q] = part + d0
        seq[rows, (p0[:, None] + 5 * j + 4)[:, : L - 1]] = self.stoi[","]
        seq[np.arange(n), p0 + 5 * L - 1] = self.stoi["→"]
        seq[rows, p0[:, None] + 5 * L + j] = digit + d0
        seq[np.arange(n)[c == 1], (p0 + 6 * L)[c == 1]] = d0 + 1        # the final carry digit
        seq[np.arange(n), end] = self.stoi["."]
        t = np.arange(seq.shape[1])[None, :]
        return self.lm_arrays(seq, (t >= p0[:, None]) & (t <= end[:, None]), length)


class MulCoT(Task):
    """Multiplication written as a program-like chain of thought (PRISM Table 4). Causal.

    `a x b =` then `a x [` and for each digit d of b (most significant first) `d*(d→1)` followed by
    `(e→0)` for every later digit e (a one marks the digit, the zeros count its place), the terms
    joined by '+', then `].`. The product itself is not required. `length` = digits of b (a has
    1..length digits). Train 1..9, test to 20. Character tokens.

    Example:  675x1259=675x[1*(1→1)(2→0)(5→0)(9→0)+2*(2→1)(5→0)(9→0)+5*(5→1)(9→0)+9*(9→1)].
    Vocabulary: <pad> 0-9 x = [ ] * ( ) → + .
    """
    name = "mul_cot"
    vocab = ["<pad>"] + DIGITS + ["x", "=", "[", "]", "*", "(", ")", "→", "+", "."]
    train_lengths = list(range(1, 10))
    test_lengths = list(range(1, 21))

    def tokens(self, a: int, b: int) -> tuple[list[str], int]:
        db = str(b)
        terms = []
        for i, d in enumerate(db):
            terms.append(f"{d}*({d}→1)" + "".join(f"({e}→0)" for e in db[i + 1:]))
        prompt = f"{a}x{b}="
        return list(prompt + f"{a}x[" + "+".join(terms) + "]."), len(prompt)

    def template(self, k: int, length: int) -> tuple[np.ndarray, int]:
        """The layout of `tokens(a, b)` for a of k digits and b of `length` digits: per position an
        index into [a's digits, b's digits, the vocabulary's ids] (one row of `_sample`'s table),
        and the prompt's length."""
        digit_a = lambda i: i                                   # noqa: E731
        digit_b = lambda i: k + i                               # noqa: E731
        tok = lambda t: k + length + self.stoi[t]               # noqa: E731
        A, B = [digit_a(i) for i in range(k)], [digit_b(i) for i in range(length)]
        prompt = A + [tok("x")] + B + [tok("=")]
        terms = []
        for i in range(length):
            terms += ([tok("+")] if i else []) + [B[i], tok("*"), tok("("), B[i], tok("→"), tok("1"), tok(")")]
            for j in range(i + 1, length):
                terms += [tok("("), B[j], tok("→"), tok("0"), tok(")")]
        return np.array(prompt + A + [tok("x"), tok("[")] + terms + [tok("]"), tok(".")]), len(prompt)

    def _sample(self, n, length, rng):
        """Every row at once: a's digit count uniform in 1..length, then per count one gather of
        the digits drawn (and the fixed tokens) through `template`."""
        k = rng.integers(1, length + 1, size=n)                             # (n,) digits of a
        a = rng.integers(0, 10, size=(n, length))                           # (n, L) a's digits, first k used
        a[:, 0] = np.where(k == 1, a[:, 0], rng.integers(1, 10, size=n))    # no leading zero
        b = rng.integers(0, 10, size=(n, length))
        b[:, 0] = rng.integers(0 if length == 1 else 1, 10, size=n)
        ids = np.concatenate([a + self.stoi["0"], b + self.stoi["0"]], axis=1)    # (n, 2L) digit ids
        layouts = {int(c): self.template(int(c), length) for c in np.unique(k)}
        T = max(len(t) for t, _ in layouts.values())
        seq = np.full((n, T), self.pad_id, dtype=np.int64)
        supervised = np.zeros((n, T), dtype=bool)
        ends = np.zeros(n, dtype=np.int64)                                  # (n,) tokens per row
        vocab_ids = np.arange(len(self.vocab))
        for c, (t, n_prompt) in layouts.items():
            rows = np.flatnonzero(k == c)
            table = np.concatenate([ids[rows][:, :c], ids[rows][:, length:],
                                    np.broadcast_to(vocab_ids, (len(rows), len(vocab_ids)))], axis=1)
            seq[rows, :len(t)] = table[:, t]
            supervised[rows, n_prompt:len(t)] = True
            ends[rows] = len(t)
        x = np.where(np.arange(T - 1) < ends[:, None] - 1, seq[:, :-1], self.pad_id)   # as lm_batch: seq[:-1] per row
        y = np.where(supervised[:, 1:], seq[:, 1:], IGNORE)
        return Batch(torch.from_numpy(x), torch.from_numpy(y), torch.full((n,), length, dtype=torch.long))


class DynStrCpy(Task):
    """Dynamic string copy (PRISM Table 4). Causal.

    `s,d=` then the suffix of s that starts at the unique occurrence of d, then <eos>. The start
    t is uniform over the positions of s; the other positions are filled from the alphabet
    without s[t], so d is unique by construction. `length` = |s|. Train 1..10, test to 100.

    Example:  5 8 3 9 4 7 2 , 3 = 3 9 4 7 2 <eos>
    Vocabulary: <pad> 0-9 , = <eos>.
    """
    name = "dyn_str_cpy"
    vocab = ["<pad>"] + DIGITS + [",", "=", "<eos>"]
    train_lengths = list(range(1, 11))
    test_lengths = list(range(1, 101))

    def tokens(self, s: list[int], t: int) -> tuple[list[str], int]:
        prompt = [str(c) for c in s] + [",", str(s[t]), "="]
        return prompt + [str(c) for c in s[t:]] + ["<eos>"], len(prompt)

    def _sample(self, n, length, rng):
        """`tokens` for a batch at once, in numpy (tested equal to it row by row)."""
        L, rows, j, d0 = length, np.arange(n), np.arange(length)[None, :], self.stoi["0"]
        t, d = rng.integers(0, L, size=n), rng.integers(0, 10, size=n)
        s = rng.integers(0, 9, size=(n, L))
        s += s >= d[:, None]                                           # uniform over the digits but d
        s[rows, t] = d
        end = 2 * L + 3 - t                                            # where <eos> goes
        seq = np.full((n, 2 * L + 4), self.pad_id, dtype=np.int64)
        seq[:, :L] = s + d0
        seq[:, L], seq[:, L + 1], seq[:, L + 2] = self.stoi[","], d + d0, self.stoi["="]
        src = t[:, None] + j                                           # the suffix s[t:]
        copied = src < L
        seq[:, L + 3:2 * L + 3][copied] = (s[rows[:, None], np.minimum(src, L - 1)] + d0)[copied]
        seq[rows, end] = self.stoi["<eos>"]
        pos = np.arange(2 * L + 4)[None, :]
        return self.lm_arrays(seq[:, :end.max() + 1], ((pos >= L + 3) & (pos <= end[:, None]))[:, :end.max() + 1], L)


# ---- SCAN (Lake & Baroni 2018), generated from its grammar ------------------------------------

_PRIMITIVES = {"walk": "I_WALK", "look": "I_LOOK", "run": "I_RUN", "jump": "I_JUMP"}
_TURN = {"left": "I_TURN_LEFT", "right": "I_TURN_RIGHT"}


def _scan_phrases() -> list[str]:
    """Every V of the grammar: U, D, D opposite, D around (34 phrases)."""
    us = list(_PRIMITIVES)
    ds = [f"{u} {d}" for u in us for d in _TURN] + [f"turn {d}" for d in _TURN]
    return us + ds + [d.replace(" ", " opposite ") for d in ds] + [d.replace(" ", " around ") for d in ds]


def scan_phrase_actions(phrase: str) -> list[str]:
    """Semantics of one V phrase, e.g. 'walk around left' -> (I_TURN_LEFT I_WALK) x 4."""
    words = phrase.split()
    if len(words) == 1:
        return [_PRIMITIVES[words[0]]]
    verb, direction = words[0], _TURN[words[-1]]
    act = [] if verb == "turn" else [_PRIMITIVES[verb]]
    if len(words) == 2:
        return [direction] + act
    if words[1] == "opposite":
        return [direction, direction] + act
    return ([direction] + act) * 4  # around


def scan_parse(command: str) -> list[str]:
    """The command's phrases in execution order, with twice/thrice expanded."""
    def clause(s: str) -> list[str]:
        words = s.split()
        repeat = {"twice": 2, "thrice": 3}.get(words[-1], 1)
        phrase = " ".join(words[:-1] if repeat > 1 else words)
        return [phrase] * repeat
    if " and " in command:
        first, second = command.split(" and ")
        return clause(first) + clause(second)
    if " after " in command:
        first, second = command.split(" after ")
        return clause(second) + clause(first)
    return clause(command)


def scan_actions(command: str) -> str:
    return " ".join(a for p in scan_parse(command) for a in scan_phrase_actions(p))


@lru_cache(maxsize=None)
def scan_commands() -> tuple[str, ...]:
    """All 20,910 SCAN commands: C -> S | S and S | S after S; S -> V | V twice | V thrice."""
    ss = [v + rep for v in _scan_phrases() for rep in ("", " twice", " thrice")]
    return tuple(ss + [f"{a} {c} {b}" for a in ss for c in ("and", "after") for b in ss])


def scan_split(name: str = "length") -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, test) lists of (command, actions). 'length': train = at most 22 actions, test = at
    least 24 (the SCAN length split)."""
    if name != "length":
        raise ValueError(f"unknown SCAN split {name!r} (available: length)")
    pairs = [(c, scan_actions(c)) for c in scan_commands()]
    n_act = [len(a.split()) for _, a in pairs]
    return ([p for p, k in zip(pairs, n_act) if k <= 22], [p for p, k in zip(pairs, n_act) if k >= 24])


@lru_cache(maxsize=None)
def _scan_by_length() -> dict[int, list[tuple[str, str]]]:
    train, test = scan_split("length")
    by_len: dict[int, list[tuple[str, str]]] = {}
    for c, a in train + test:
        by_len.setdefault(len(a.split()), []).append((c, a))
    return by_len


def _scan_cot(command: str) -> list[str]:
    """PRISM's first CoT step: execution order, repetitions as '+'-joined copies, clauses joined
    by 'and' (an 'after' command is reordered)."""
    if " after " in command:
        first, second = command.split(" after ")
        clauses = [second, first]
    else:
        clauses = command.split(" and ")
    out = []
    for c in clauses:
        n_rep = len(scan_parse(c))
        phrase = scan_parse(c)[0]
        out.append(" + ".join([phrase] * n_rep))
    return " and ".join(out).split()


class Scan(Task):
    """SCAN, length split (Lake & Baroni 2018), generated from the grammar in code. Causal.

    `command = actions <eos>`, word-level tokens. `length` = number of actions; lengths up to 22
    come from the train split, 24 and more from the test split (the length split). Train lengths
    are every action count of the train split; test lengths all counts (1..48).

    Training draws commands of the train split as they are: an action count as often as the split
    has commands of it (option uniform_lengths=True: every count equally often). Evaluation takes
    every command of each length once, so a range's exact match is over commands (the paper's
    number over the 3,920 test commands). The model is a causal decoder over the whole sequence:
    a prefix-LM mask on the command would need every encoding's fast path to take a mask, which
    the causal kernels (PaTH, ViPE) do not.

    Example:  jump twice after walk left = I_TURN_LEFT I_WALK I_JUMP I_JUMP <eos>
    Vocabulary: <pad>, the 13 command words, =, the 6 actions, <eos>, and for scan_cot + → : .
    """
    name = "scan"
    words = ["walk", "look", "run", "jump", "turn", "left", "right", "opposite", "around",
             "twice", "thrice", "and", "after"]
    vocab = (["<pad>"] + words + ["="] + list(_PRIMITIVES.values()) + list(_TURN.values())
             + ["<eos>", "+", "→", ":", "."])

    @property
    def train_lengths(self):
        return sorted(L for L in _scan_by_length() if L <= 22)

    @property
    def test_lengths(self):
        return sorted(_scan_by_length())

    def check_length(self, length, **opts):
        if length not in _scan_by_length():
            raise ValueError(f"task {self.name}: no SCAN command has {length} actions "
                             f"(possible: {', '.join(map(str, self.test_lengths))})")

    def tokens(self, command: str, actions: str) -> tuple[list[str], int]:
        prompt = command.split() + ["="]
        return prompt + actions.split() + ["<eos>"], len(prompt)

    def length_weights(self, lengths, uniform_lengths=False, **opts):
        return None if uniform_lengths else np.array([len(_scan_by_length()[L]) for L in lengths], dtype=float)

    def every_example(self, length, uniform_lengths=False, **opts):
        """Every command with `length` actions as one padded batch, encoded once per process."""
        cache = self.__dict__.setdefault("_encoded", {})
        if length not in cache:
            seqs, n_prompt = zip(*(self.tokens(*p) for p in _scan_by_length()[length]))
            cache[length] = self.lm_batch(list(seqs), list(n_prompt), length)
        return cache[length]

    def _sample(self, n, length, rng, uniform_lengths=False):
        every = self.every_example(length)
        picks = torch.from_numpy(rng.integers(0, len(every.x), size=n))      # (n,) commands drawn
        x, y = every.x[picks], every.y[picks]
        T = int((x != self.pad_id).sum(1).max())                            # the longest drawn row
        return Batch(x[:, :T].contiguous(), y[:, :T].contiguous(), every.length[picks])


class ScanCoT(Scan):
    """SCAN with PRISM's two chain-of-thought steps (PRISM Table 4). Causal.

    `command =`, the command rewritten in execution order (twice/thrice as '+'-joined copies,
    'and' between clauses), '→', then `phrase : actions` for each phrase in order, then '.'.
    `length` = number of actions, as for scan.

    Example:  jump twice after walk left = walk left and jump + jump → walk left : I_TURN_LEFT
              I_WALK jump : I_JUMP jump : I_JUMP .
    Vocabulary: as scan; train lengths up to 22 actions.
    """
    name = "scan_cot"

    def tokens(self, command: str, actions: str) -> tuple[list[str], int]:
        prompt = command.split() + ["="]
        steps = []
        for p in scan_parse(command):
            steps += p.split() + [":"] + scan_phrase_actions(p)
        return prompt + _scan_cot(command) + ["→"] + steps + ["."], len(prompt)


# =============================================================================================
# ViPE tasks: polynomial iteration, parity, binary copy (Cabannes et al. 2024)
# =============================================================================================

class _Iterative(Task):
    """Base: `<bos> x_1..x_L <eoi> y_1..y_L <eos>`, supervised on y and <eos>. A subclass
    implements step(s, x) -> next state (numpy, elementwise)."""
    vocab = ["<pad>", "<bos>", "<eoi>", "<eos>", "0", "1", "2", "3", "4"]
    train_lengths = list(range(1, 17))
    test_lengths = list(range(1, 49))
    low, high = 0, 2  # x is uniform in [low, high)

    def build(self, xs: np.ndarray) -> Batch:
        """xs: (n, L) input values -> y_1 = x_1, y_t = step(y_{t-1}, x_t)."""
        n, L = xs.shape
        ys = xs.copy()
        for t in range(1, L):
            ys[:, t] = self.step(ys[:, t - 1], xs[:, t])
        col = lambda tok: np.full((n, 1), self.stoi[tok])  # noqa: E731
        zero = self.stoi["0"]
        seq = np.concatenate([col("<bos>"), xs + zero, col("<eoi>"), ys + zero, col("<eos>")], 1)
        supervised = np.zeros_like(seq, dtype=bool)
        supervised[:, L + 2:] = True                      # y_1 .. y_L and <eos>
        return self.lm_arrays(seq, supervised, L)

    def _sample(self, n, length, rng):
        return self.build(rng.integers(self.low, self.high, size=(n, length)))


class Polynomial(_Iterative):
    """Polynomial iteration (ViPE Table 3). Causal. x in {1..4}, y_1 = x_1,
    y_t = (y_{t-1} * x_t + 1) mod 5. `length` = L; train 1..16, test 17..48 (and the train range).

    Example:  <bos> 1 2 3 4 <eoi> 1 3 0 1 <eos>
    Vocabulary: <pad> <bos> <eoi> <eos> 0 1 2 3 4.
    """
    name = "polynomial"
    low, high = 1, 5

    def step(self, s, x):
        return (s * x + 1) % 5


class Parity(_Iterative):
    """Parity (ViPE Table 3). Causal. x in {0, 1}, y_t = (x_1 + ... + x_t) mod 2.

    Example:  <bos> 1 1 1 0 1 <eoi> 1 0 1 1 0 <eos>
    Lengths as polynomial (train 1..16). Vocabulary: as polynomial (only 0 and 1 occur).
    """
    name = "parity"

    def step(self, s, x):
        return (s + x) % 2


class BinaryCopy(_Iterative):
    """Binary copy (ViPE Table 3). Causal. x in {0, 1}, y = x.

    Example:  <bos> 1 0 1 0 0 <eoi> 1 0 1 0 0 <eos>
    Lengths as polynomial (train 1..16). Vocabulary: as polynomial (only 0 and 1 occur).
    """
    name = "binary_copy"

    def step(self, s, x):
        return x


# =============================================================================================
# UPE tasks: padded addition and multiplication for a bidirectional encoder
# =============================================================================================

class _Padded(Task):
    """Base of the UPE arithmetic tasks: fixed width, '#' is the number padding symbol (the
    paper's "pad"), and '<pad>' only pads batches (never used, all rows have equal length)."""
    vocab = ["<pad>"] + DIGITS + ["#", "+", "×"]
    causal = False
    by_offset = True                   # offset 0: the result's least significant digit
    width = 20
    train_lengths = [5]
    test_lengths = list(range(1, 21))

    def check_length(self, length, width=None, **opts):
        super().check_length(length)
        width = self.width if width is None else width
        if length > width:
            raise ValueError(f"task {self.name}: length {length} does not fit the width {width} "
                             f"(pass width >= {length})")

    @staticmethod
    def padded(v: int, width: int) -> list[str]:
        s = str(v)
        return ["#"] * (width - len(s)) + list(s)

    def padded_ids(self, digits: np.ndarray) -> np.ndarray:
        """`padded` for arrays: digits (n, w) most significant first -> ids with the leading zeros as
        '#' (a zero keeps its last digit)."""
        lead = np.cumsum(digits != 0, axis=1) == 0                     # only zeros so far
        lead[:, -1] = False
        return np.where(lead, self.stoi["#"], digits + self.stoi["0"])

    @staticmethod
    def carried(columns: np.ndarray) -> np.ndarray:
        """Column sums (n, w), least significant first -> the digits of their number, same order."""
        out, carry = columns.copy(), 0
        for i in range(out.shape[1]):
            carry, out[:, i] = divmod(out[:, i] + carry, 10)
        return out


class AddPadded(_Padded):
    """Padded addition (UPE eq. 3.1). Bidirectional.

    Input: a left-padded with '#' to `width` digits, '+', b left-padded to `width` digits.
    Output: the sum right-aligned under b over the width + 1 positions starting at '+', left-padded
    with '#' (the pads are supervised); -100 elsewhere. `length` = k: both operands uniform below
    10^k. Train k = 5 (operands below 10^5); test k = 1..width.

    Example (width 20, 123 + 4095), '#' x 17 written #17:
        x = #17 1 2 3 + #16 4 0 9 5
        y = .20      #17 4 2 1 8
    Vocabulary: <pad> 0-9 # + ×.
    """
    name = "add_padded"

    def tokens(self, a: int, b: int, width: int) -> tuple[list[str], list[str | None]]:
        x = self.padded(a, width) + ["+"] + self.padded(b, width)
        y = [None] * width + self.padded(a + b, width + 1)
        return x, y

    def _sample(self, n, length, rng, width=None):
        """`tokens` for a batch at once, in numpy (tested equal to it row by row)."""
        width = self.width if width is None else width
        a, b = np.zeros((2, n, width + 1), dtype=np.int64)             # least significant digit first
        a[:, :length], b[:, :length] = rng.integers(0, 10, size=(2, n, length))
        total = self.carried(a + b)[:, ::-1]                           # (n, width + 1), MSD first
        x = np.concatenate([self.padded_ids(a[:, width - 1::-1]), np.full((n, 1), self.stoi["+"]),
                            self.padded_ids(b[:, width - 1::-1])], 1)
        y = np.full_like(x, IGNORE)
        y[:, width:] = self.padded_ids(total)
        return Batch(torch.from_numpy(x), torch.from_numpy(y), torch.full((n,), length, dtype=torch.long))


class MulPadded(_Padded):
    """Padded multiplication (UPE eq. 3.2). Bidirectional.

    Input: the multiplier (exactly `multiplier_digits` digits, not padded), '×', the multiplicand
    left-padded with '#' to `width` digits. Output: the product right-aligned over the last
    width + multiplier_digits positions, left-padded with '#' (pads supervised); -100 elsewhere.
    slot[t] = index of the multiplier digit at its position (0 = least significant), -1 elsewhere.
    `length` = k: the multiplicand is uniform below 10^k. Train k = 5; test k = 1..width.

    With multiplier_low = N > 0 the multiplier is uniform in N .. 10^multiplier_digits - 1, of 1 to
    multiplier_digits digits (a batch right-padded to its longest); 0 (default): exactly multiplier_digits.

    Example (width 20, 56 × 4297):
        x    = 5 6 × #16 4 2 9 7
        y    = . #16 2 4 0 6 3 2
        slot = 1 0 -1 ...
    Vocabulary: <pad> 0-9 # + ×.
    """
    name = "mul_padded"

    def tokens(self, a: int, b: int, width: int):
        m = len(str(a))
        x = list(str(a)) + ["×"] + self.padded(b, width)
        y = [None] * (len(x) - width - m) + self.padded(a * b, width + m)
        slot = list(range(m - 1, -1, -1)) + [-1] * (width + 1)
        return x, y, slot

    def _sample(self, n, length, rng, width=None, multiplier_digits=3, multiplier_low=0):
        width = self.width if width is None else width
        if multiplier_digits not in (1, 2, 3):
            raise ValueError(f"task mul_padded: multiplier_digits must be 1, 2 or 3, got {multiplier_digits}")
        m = multiplier_digits
        if multiplier_low:                   # multipliers uniform in [low, 10^m): 1 to m digits, one part per count
            if not 1 <= multiplier_low < 10 ** m:
                raise ValueError(f"task mul_padded: multiplier_low must be 0 or from 1 to {10 ** m - 1}, "
                                 f"got {multiplier_low}")
            values = rng.integers(multiplier_low, 10 ** m, size=n)
            counts = np.array([len(str(v)) for v in values])
            return collate([self._product(np.array([[int(c) for c in str(v)] for v in values[counts == d]]), length,
                                          rng, width) for d in sorted(set(counts))], self.pad_id)
        a = rng.integers(0, 10, size=(n, m))                           # most significant digit first
        a[:, 0] = rng.integers(1, 10, size=n)
        return self._product(a, length, rng, width)

    def _product(self, a, length, rng, width):
        """The batch of the multipliers' digits a (n, m), most significant first, times multiplicands below
        10^length drawn here."""
        n, m = a.shape
        b = np.zeros((n, width), dtype=np.int64)                       # least significant digit first
        b[:, :length] = rng.integers(0, 10, size=(n, length))
        columns = np.zeros((n, width + m), dtype=np.int64)
        for j in range(m):                                             # a's digit of weight 10^j
            columns[:, j:j + width] += a[:, m - 1 - j, None] * b
        x = np.concatenate([a + self.stoi["0"], np.full((n, 1), self.stoi["×"]), self.padded_ids(b[:, ::-1])], 1)
        y = np.full_like(x, IGNORE)
        y[:, 1:] = self.padded_ids(self.carried(columns)[:, ::-1])
        slot = np.full_like(x, -1)
        slot[:, :m] = np.arange(m - 1, -1, -1)
        return Batch(torch.from_numpy(x), torch.from_numpy(y), torch.full((n,), length, dtype=torch.long),
                     torch.from_numpy(slot))


TASKS: dict[str, Task] = {t.name: t for t in (
    FlipFlop(), A5(), MQRAR(), Copy(), Reverse(), OddsFirst(), Stack(), AddCoT(), MulCoT(),
    DynStrCpy(), Scan(), ScanCoT(), Polynomial(), Parity(), BinaryCopy(), AddPadded(), MulPadded())}
