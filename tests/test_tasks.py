"""Every task: its documented example reproduces exactly, and its invariants hold on random samples."""
import signal

import numpy as np
import pytest
import torch

import tasks
from tasks import IGNORE, TASKS, sample_mixed, scan_actions, scan_commands, scan_split


def rng(seed=0):
    return np.random.default_rng(seed)


def answer_tokens(task, batch, b):
    """The supervised target tokens of row b, in order."""
    return [task.vocab[i] for i in batch.y[b].tolist() if i != IGNORE]


def prompt_tokens(task, batch, b):
    """Input tokens of row b up to the first supervised target (the prompt of an LM task)."""
    first = (batch.y[b] != IGNORE).nonzero()[0, 0].item()
    return task.decode(batch.x[b, : first + 1])


def in_doc(task, text):
    flat = " ".join(task.__doc__.split())
    assert " ".join(text.split()) in flat, f"{task.name}: example {text!r} not in its docstring"


# ---- documented examples ----------------------------------------------------------------------

def lm_example(task, tokens_and_prompt):
    seq, k = tokens_and_prompt
    batch = task.lm_batch([seq], [k], 0)
    assert task.decode(batch.x[0]) + [seq[-1]] == seq
    assert answer_tokens(task, batch, 0) == seq[k:]
    return seq


@pytest.mark.parametrize("name,args,text,sep", [
    ("stack", ([0, 1, 1, 0], [4, 2, 2]), "0 1 1 0 4 2 2 = 1 1 0 2 0 0 0 0 <eos>", " "),
    ("add_cot", (928, 30), "8 2 9 + 0 3 = 8 0 0 8 , 2 3 0 5 , 9 0 0 9 → 8 5 9 .", " "),
    ("mul_cot", (675, 1259), "675x1259=675x[1*(1→1)(2→0)(5→0)(9→0)+2*(2→1)(5→0)(9→0)+5*(5→1)(9→0)+9*(9→1)].", ""),
    ("dyn_str_cpy", ([5, 8, 3, 9, 4, 7, 2], 2), "5 8 3 9 4 7 2 , 3 = 3 9 4 7 2 <eos>", " "),
    ("scan", ("jump twice after walk left", "I_TURN_LEFT I_WALK I_JUMP I_JUMP"),
     "jump twice after walk left = I_TURN_LEFT I_WALK I_JUMP I_JUMP <eos>", " "),
])
def test_documented_lm_examples(name, args, text, sep):
    task = TASKS[name]
    seq = lm_example(task, task.tokens(*args))
    assert sep.join(seq) == text
    in_doc(task, text)


def test_paper_examples_prism():
    # PRISM Tables 3 and 4, verbatim (the paper writes them without spaces or EOS)
    for name, digits, expected in [("copy", "8349216", "8349216"), ("reverse", "8349216", "6129438"),
                                   ("odds_first", "012345", "135024")]:
        task = TASKS[name]
        batch = task.build(np.array([[int(c) for c in digits]]))
        assert "".join(task.decode(batch.x[0])) == f"{digits}={expected}"
        assert "".join(answer_tokens(task, batch, 0)) == expected + "<eos>"
        in_doc(task, " ".join(digits) + " = " + " ".join(expected) + " <eos>")
    cmd = "walk around left thrice and look opposite right"
    seq, k = TASKS["scan_cot"].tokens(cmd, scan_actions(cmd))
    walk = "walk around left : " + " ".join(["I_TURN_LEFT I_WALK"] * 4)
    assert " ".join(seq[k:]) == ("walk around left + walk around left + walk around left and look opposite right "
                                 f"→ {walk} {walk} {walk} look opposite right : I_TURN_RIGHT I_TURN_RIGHT I_LOOK .")
    seq, _ = TASKS["scan_cot"].tokens("jump twice after walk left", scan_actions("jump twice after walk left"))
    in_doc(TASKS["scan_cot"], " ".join(seq))


@pytest.mark.parametrize("name,xs,ys", [
    ("polynomial", [1, 2, 3, 4], [1, 3, 0, 1]),          # ViPE Table 3, verbatim
    ("parity", [1, 1, 1, 0, 1], [1, 0, 1, 1, 0]),
    ("binary_copy", [1, 0, 1, 0, 0], [1, 0, 1, 0, 0]),
])
def test_paper_examples_vipe(name, xs, ys):
    task = TASKS[name]
    batch = task.build(np.array([xs]))
    text = " ".join(["<bos>"] + list(map(str, xs)) + ["<eoi>"] + list(map(str, ys)) + ["<eos>"])
    assert " ".join(task.decode(batch.x[0])) + " <eos>" == text
    assert answer_tokens(task, batch, 0) == list(map(str, ys)) + ["<eos>"]
    in_doc(task, text)


def test_paper_examples_upe():
    add = TASKS["add_padded"]
    x, y = add.tokens(123, 4095, 20)                      # UPE eq. 3.1
    assert x == ["#"] * 17 + list("123") + ["+"] + ["#"] * 16 + list("4095")
    assert y == [None] * 20 + ["#"] * 17 + list("4218")
    mul = TASKS["mul_padded"]
    x, y, slot = mul.tokens(56, 4297, 20)                 # UPE eq. 3.2
    assert x == list("56") + ["×"] + ["#"] * 16 + list("4297")
    assert y == [None] + ["#"] * 16 + list("240632")
    assert slot == [1, 0] + [-1] * 21


def test_paper_example_flipflop_and_mqrar():
    ff = TASKS["flipflop"]
    s = ff.stoi
    batch = ff.build(np.array([[s["w"], s["i"], s["w"], s["r"]]]), np.array([[1, 0, 0, 1]]))
    assert " ".join(ff.decode(batch.x[0])) == "w 1 i 0 w 0 r"
    assert answer_tokens(ff, batch, 0) == ["0"] and batch.y[0, -1] != IGNORE
    in_doc(ff, "w 1 i 0 w 0 r 0")
    # PaTH's MQRAR-2 example: A 1 B 2 C 3 D 4 A 5 B 6 A 7 C 8 A 9 B 0 -> 1 at the 3rd A, 5, 2
    mq = TASKS["mqrar"]
    keys = np.array([[0, 1, 2, 3, 0, 1, 0, 2, 0, 1]])
    values = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 0]])
    batch = mq.build(keys, values, n_back=2)
    targets = {t: mq.vocab[v] for t, v in enumerate(batch.y[0].tolist()) if v != IGNORE}
    assert targets == {12: "v1", 16: "v5", 18: "v2"}


def test_a5_group():
    elems = tasks.a5_elements()
    assert len(elems) == 60 and elems[0] == (1, 2, 3, 4, 5) and len(set(elems)) == 60
    a5 = TASKS["a5"]
    ids = [a5.stoi["23145"], a5.stoi["13425"]]
    batch = a5.build(np.array([ids]))
    assert [a5.vocab[i] for i in batch.y[0].tolist()] == ["23145", "21435"]
    in_doc(a5, "x = 23145 13425")
    in_doc(a5, "y = 23145 21435")
    gens = [a5.stoi[g] for g in ("23145", "24315", "51342")]
    assert [a5.vocab[i] for i in a5.build(np.array([gens])).y[0].tolist()] == ["23145", "34125", "53124"]
    in_doc(a5, "x = 23145 24315 51342")
    in_doc(a5, "y = 23145 34125 53124")


def test_a5_generator_alphabet():
    """The default draws the 6 generators (the three 3-cycles (1 2 k) and their inverses, each
    about equally often); alphabet=elements draws all 60 elements."""
    a5 = TASKS["a5"]
    perm = lambda s: tuple(int(c) for c in s)  # noqa: E731
    for g, inv in zip(tasks.A5_GENERATORS[0::2], tasks.A5_GENERATORS[1::2]):
        p, q = perm(g), perm(inv)
        assert tuple(p[q[i] - 1] for i in range(5)) == (1, 2, 3, 4, 5)          # g * g^-1 = identity
        assert sum(p[i] != i + 1 for i in range(5)) == 3                        # a 3-cycle
    x = a5.sample(200, 20, rng()).x
    counts = np.bincount(x.flatten().numpy(), minlength=61)
    assert set(np.nonzero(counts)[0]) == {a5.stoi[g] for g in tasks.A5_GENERATORS}
    assert counts.max() < 1.2 * counts[counts > 0].min()                       # 4000 draws, 6 classes
    assert len(set(a5.sample(200, 20, rng(), alphabet="elements").x.flatten().tolist())) == 60
    with pytest.raises(ValueError, match="alphabet must be one of generators, elements"):
        a5.sample(2, 3, rng(), alphabet="letters")


# ---- invariants on random samples -------------------------------------------------------------

def test_flipflop_reads_equal_last_write():
    ff = TASKS["flipflop"]
    for p in (0.8, 0.98, 0.1):
        batch = ff.sample(64, 64, rng(), p_ignore=p)
        instr_frac = []
        for b in range(64):
            toks = ff.decode(batch.x[b]) + [None]
            assert toks[0] == "w" and toks[-2] == "r"
            last, n_i = None, 0
            for t in range(0, 126, 2):
                op, bit = toks[t], toks[t + 1] if t + 1 < 127 else None
                target = batch.y[b, t].item()
                if op == "r":
                    assert ff.vocab[target] == last
                    if bit is not None:
                        assert bit == last
                else:
                    assert target == IGNORE
                if op == "w":
                    last = bit
                n_i += op == "i"
            instr_frac.append(n_i / 62)
        # middle instructions are i with probability p (64*62 draws: 4 sigma is below 0.03)
        assert abs(np.mean(instr_frac) - p) < 0.03


def test_a5_targets_are_running_products():
    a5 = TASKS["a5"]
    batch = a5.sample(32, 12, rng())
    elems = tasks.a5_elements()
    for b in range(32):
        prod = (1, 2, 3, 4, 5)
        for t in range(12):
            g = elems[batch.x[b, t].item()]
            prod = tuple(prod[g[i] - 1] for i in range(5))
            assert elems[batch.y[b, t].item()] == prod


@pytest.mark.parametrize("n_back", [1, 3])
def test_mqrar_n_back(n_back):
    mq = TASKS["mqrar"]
    batch = mq.sample(16, 60, rng(), n_back=n_back, n_keys=4)
    for b in range(16):
        toks = mq.decode(batch.x[b])
        seen = {}
        for t in range(0, 120, 2):
            k, v = toks[t], toks[t + 1]
            expect = seen[k][-n_back] if len(seen.get(k, [])) >= n_back else None
            got = batch.y[b, t].item()
            assert (got == IGNORE) if expect is None else mq.vocab[got] == expect
            assert batch.y[b, t + 1].item() == IGNORE
            seen.setdefault(k, []).append(v)


@pytest.mark.parametrize("name,f", [
    ("copy", lambda d: d), ("reverse", lambda d: d[::-1]), ("odds_first", lambda d: d[1::2] + d[0::2])])
def test_digit_tasks(name, f):
    task = TASKS[name]
    batch = task.sample(32, 9, rng())
    for b in range(32):
        digits = task.decode(batch.x[b])[:9]
        assert answer_tokens(task, batch, b) == f(digits) + ["<eos>"]


def test_stack_semantics():
    task = TASKS["stack"]
    batch = task.sample(64, 15, rng())
    for b in range(64):
        toks = [int(t) for t in prompt_tokens(task, batch, b)[:-1]]
        assert len(toks) == 15
        stack = []
        for i, t in enumerate(toks):
            if t in (0, 1):
                assert all(u in (0, 1) for u in toks[:i]), "stack digits come before actions"
                stack.append(t)
            elif t == 2:
                stack = stack[:-1]
            else:
                stack.append(t - 3)
        out = answer_tokens(task, batch, b)
        assert len(out) == 17 and out[-1] == "<eos>"
        assert out[:len(stack) + 1] == [str(s) for s in stack[::-1]] + ["2"]
        assert set(out[len(stack) + 1:-1]) <= {"0"}


@pytest.mark.parametrize("length", [1, 2, 7, 30])
def test_add_cot_batches_equal_the_reference_tokens(length):
    """The vectorised sampler builds, row by row, exactly `tokens(a, b)` of the operands it drew,
    supervising every token after the prompt; the shorter operand's length is spread over 1..length."""
    task = TASKS["add_cot"]
    batch = task.sample(200, length, rng())
    shorter = []
    for b in range(200):
        prompt = prompt_tokens(task, batch, b)
        plus = prompt.index("+")
        a, c = int("".join(prompt[:plus])[::-1]), int("".join(prompt[plus + 1:-1])[::-1])
        seq, k = task.tokens(a, c)
        assert prompt == seq[:k] and answer_tokens(task, batch, b) == seq[k:]
        assert max(len(str(a)), len(str(c))) == length
        shorter.append(min(plus, len(prompt) - plus - 2))
    assert set(shorter) == set(range(1, length + 1)) or length == 30


def test_add_cot_steps_and_sum():
    task = TASKS["add_cot"]
    batch = task.sample(64, 7, rng())
    for b in range(64):
        prompt = prompt_tokens(task, batch, b)
        plus = prompt.index("+")
        a = int("".join(prompt[:plus])[::-1])
        c = int("".join(prompt[plus + 1:-1])[::-1])
        assert max(len(str(a)), len(str(c))) == 7
        out = answer_tokens(task, batch, b)
        arrow = out.index("→")
        steps = " ".join(out[:arrow]).split(" , ")
        assert len(steps) == 7
        carry = 0
        for i, s in enumerate(steps):
            da, db, cout, d = map(int, s.split())
            assert da == (a // 10 ** i) % 10 and db == (c // 10 ** i) % 10
            assert (cout, d) == divmod(da + db + carry, 10)
            carry = cout
        assert int("".join(out[arrow + 1:-1])[::-1]) == a + c and out[-1] == "."


def test_mul_cot_terms():
    task = TASKS["mul_cot"]
    batch = task.sample(32, 6, rng())
    for b in range(32):
        prompt = "".join(prompt_tokens(task, batch, b))
        a, rest = prompt[:-1].split("x")
        out = "".join(answer_tokens(task, batch, b))
        assert len(rest) == 6 and out.startswith(f"{a}x[") and out.endswith("].")
        terms = out[len(a) + 2:-2].split("+")
        # sum of d_i * 10^(zeros after it) reconstructs b
        total = 0
        for term in terms:
            d, marks = term.split("*")
            total += int(d) * 10 ** marks.count("→0")
        assert total == int(rest)


@pytest.mark.parametrize("length", [1, 2, 10, 100])
def test_dyn_str_cpy_batches_equal_the_reference_tokens(length):
    """The vectorised sampler builds, row by row, exactly `tokens(s, t)` of the string and start it drew."""
    task = TASKS["dyn_str_cpy"]
    batch = task.sample(100, length, rng())
    starts = set()
    for b in range(100):
        prompt = prompt_tokens(task, batch, b)
        s, d = [int(c) for c in prompt[:length]], int(prompt[length + 1])
        t = s.index(d)
        seq, k = task.tokens(s, t)
        assert prompt == seq[:k] and answer_tokens(task, batch, b) == seq[k:]
        starts.add(t)
    assert len(starts) == min(length, 100) or length == 100


def test_dyn_str_cpy_unique_start():
    task = TASKS["dyn_str_cpy"]
    batch = task.sample(64, 12, rng())
    for b in range(64):
        prompt = prompt_tokens(task, batch, b)
        s, d = prompt[:12], prompt[13]
        assert s.count(d) == 1
        assert answer_tokens(task, batch, b) == s[s.index(d):] + ["<eos>"]


def test_scan_grammar_and_split():
    cmds = scan_commands()
    assert len(cmds) == len(set(cmds)) == 20910
    train, test = scan_split("length")
    assert (len(train), len(test)) == (16990, 3920)   # the published length split's sizes
    assert max(len(a.split()) for _, a in train) <= 22 and min(len(a.split()) for _, a in test) >= 24
    # semantics from Lake & Baroni (2018), Table 1 / Fig. 1
    cases = {
        "jump": "I_JUMP", "jump left": "I_TURN_LEFT I_JUMP", "turn left twice": "I_TURN_LEFT I_TURN_LEFT",
        "jump opposite left": "I_TURN_LEFT I_TURN_LEFT I_JUMP", "turn opposite right": "I_TURN_RIGHT I_TURN_RIGHT",
        "jump around right": "I_TURN_RIGHT I_JUMP I_TURN_RIGHT I_JUMP I_TURN_RIGHT I_JUMP I_TURN_RIGHT I_JUMP",
        "turn around left": "I_TURN_LEFT I_TURN_LEFT I_TURN_LEFT I_TURN_LEFT",
        "walk and jump thrice": "I_WALK I_JUMP I_JUMP I_JUMP",
        "jump opposite left after walk around left":
            "I_TURN_LEFT I_WALK I_TURN_LEFT I_WALK I_TURN_LEFT I_WALK I_TURN_LEFT I_WALK I_TURN_LEFT I_TURN_LEFT I_JUMP",
    }
    for c, a in cases.items():
        assert scan_actions(c) == a, c
    with pytest.raises(ValueError, match="available: length"):
        scan_split("simple")


def test_scan_samples_follow_the_split():
    train, test = scan_split("length")
    actions = dict(train + test)
    for name in ("scan", "scan_cot"):
        task = TASKS[name]
        for L in (3, 22, 24, 48):
            batch = task.sample(8, L, rng())
            for b in range(8):
                cmd = " ".join(prompt_tokens(task, batch, b)[:-1])
                out = answer_tokens(task, batch, b)
                if name == "scan":
                    assert " ".join(out[:-1]) == actions[cmd] and len(out) - 1 == L
                else:
                    steps = out[out.index("→") + 1:-1]
                    acts = [t for t in steps if t.startswith("I_")]
                    assert " ".join(acts) == actions[cmd]


@pytest.mark.parametrize("name,update,low,high", [
    ("polynomial", lambda s, x: (s * x + 1) % 5, 1, 4),
    ("parity", lambda s, x: (s + x) % 2, 0, 1),
    ("binary_copy", lambda s, x: x, 0, 1),
])
def test_iterative_recurrence(name, update, low, high):
    task = TASKS[name]
    batch = task.sample(32, 20, rng())
    for b in range(32):
        toks = task.decode(batch.x[b])
        xs = [int(t) for t in toks[1:21]]
        assert min(xs) >= low and max(xs) <= high
        ys = [int(t) for t in answer_tokens(task, batch, b)[:-1]]
        s = xs[0]
        assert ys[0] == s
        for t in range(1, 20):
            s = update(s, xs[t])
            assert ys[t] == s


def test_padded_arithmetic():
    add = TASKS["add_padded"]
    batch = add.sample(64, 12, rng(), width=15)
    assert batch.x.shape == (64, 31) and batch.slot is None
    for b in range(64):
        toks = [add.vocab[i] for i in batch.x[b].tolist()]
        a = int("".join(t for t in toks[:15] if t != "#") or 0)
        c = int("".join(t for t in toks[16:] if t != "#") or 0)
        assert toks[15] == "+" and a < 10 ** 12 and c < 10 ** 12
        sup = (batch.y[b] != IGNORE).nonzero().flatten().tolist()
        assert sup == list(range(15, 31))
        out = [add.vocab[batch.y[b, t].item()] for t in sup]
        assert "".join(out).lstrip("#") == str(a + c)
    mul = TASKS["mul_padded"]
    for m in (1, 3):
        batch = mul.sample(64, 8, rng(), multiplier_digits=m)
        for b in range(64):
            toks = [mul.vocab[i] for i in batch.x[b].tolist()]
            assert toks[m] == "×"
            a = int("".join(toks[:m]))
            c = int("".join(t for t in toks[m + 1:] if t != "#") or 0)
            assert len(str(a)) == m
            sup = (batch.y[b] != IGNORE).nonzero().flatten().tolist()
            assert sup == list(range(1, m + 21))
            assert "".join(mul.vocab[batch.y[b, t].item()] for t in sup).lstrip("#") == str(a * c)
            assert batch.slot[b].tolist() == list(range(m - 1, -1, -1)) + [-1] * 21


@pytest.mark.parametrize("length,width,m", [(1, 20, 3), (5, 20, 1), (12, 15, 2), (20, 20, 3)])
def test_padded_batches_equal_the_reference_tokens(length, width, m):
    """The vectorised samplers build, row by row, exactly `tokens` of the operands they drew: input,
    supervised output (pads included) and slots."""
    def ids(task, toks):
        return [IGNORE if t is None else task.stoi[t] for t in toks]
    add, mul = TASKS["add_padded"], TASKS["mul_padded"]
    batch = add.sample(100, length, rng(), width=width)
    for b in range(100):
        toks = add.decode(batch.x[b])
        a, c = (int("".join(t for t in part if t != "#")) for part in (toks[:width], toks[width + 1:]))
        x, y = add.tokens(a, c, width)
        assert toks == x and batch.y[b].tolist() == ids(add, y)
    batch = mul.sample(100, length, rng(), width=width, multiplier_digits=m)
    for b in range(100):
        toks = mul.decode(batch.x[b])
        a, c = int("".join(toks[:m])), int("".join(t for t in toks[m + 1:] if t != "#"))
        x, y, slot = mul.tokens(a, c, width)
        assert toks == x and batch.y[b].tolist() == ids(mul, y) and batch.slot[b].tolist() == slot


def test_large_operands_are_exact():
    # 20-digit operands exceed float precision; the generator must still draw every digit
    add = TASKS["add_padded"]
    batch = add.sample(200, 20, rng())
    last_digits = {add.vocab[batch.x[b, 40].item()] for b in range(200)}
    assert last_digits == set(tasks.DIGITS)


# ---- generic API ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(TASKS))
def test_every_task_is_deterministic_and_aligned(name):
    task = TASKS[name]
    L = task.train_lengths[-1] if name not in ("flipflop", "mqrar") else 20
    a, b, c = (task.sample(4, L, rng(s)) for s in (1, 1, 2))
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x)
    assert a.x.shape == a.y.shape and a.length.tolist() == [L] * 4
    assert (a.y != IGNORE).any(dim=1).all(), "every example supervises something"
    assert ((a.y == IGNORE) | ((a.y >= 0) & (a.y < len(task.vocab)))).all()
    for word in ("Example", "Vocabulary", "Causal" if task.causal else "Bidirectional", "rain"):
        assert word in task.__doc__, f"{name}: the docstring should say {word}"
    if task.causal and name not in ("a5", "mqrar"):   # LM tasks: y is x shifted left
        # the last answer token of each row is never an input; every other one is
        sup = (a.y[:, :-1] != IGNORE) & (a.x[:, 1:] != task.pad_id)
        assert sup.sum() >= 4 and torch.equal(a.y[:, :-1][sup], a.x[:, 1:][sup])


def test_sample_mixed_pads_and_mixes():
    task = TASKS["copy"]
    batch = sample_mixed(task, 64, [1, 5, 10], rng())
    assert set(batch.length.tolist()) == {1, 5, 10} and batch.x.shape[1] == 21
    short = batch.length == 1
    assert (batch.x[short, 4:] == task.pad_id).all() and (batch.y[short, 3:] == IGNORE).all()


def test_bad_lengths_and_options():
    with pytest.raises(ValueError, match="impossible"):
        TASKS["copy"].sample(2, 0, rng())
    with pytest.raises(ValueError, match="no SCAN command has 23 actions"):
        TASKS["scan"].sample(2, 23, rng())
    with pytest.raises(ValueError, match="does not fit the width"):
        TASKS["add_padded"].sample(2, 21, rng())
    with pytest.raises(ValueError, match="has no option 'n_bak'"):
        TASKS["mqrar"].sample(2, 10, rng(), n_bak=2)
    with pytest.raises(ValueError, match="p_ignore"):
        TASKS["flipflop"].sample(2, 10, rng(), p_ignore=1.5)


def test_vocab_ids_unique():
    for task in TASKS.values():
        assert len(set(task.vocab)) == len(task.vocab), task.name
        assert task.vocab[task.pad_id] == "<pad>"
    assert TASKS["a5"].vocab[0] == "12345"


def test_scan_draws_commands_as_the_split_has_them_and_evaluates_every_one():
    """Action counts are drawn as often as the train split has commands of them (uniform_lengths
    keeps every count equally often), and every_example is each command of a length once."""
    task = TASKS["scan"]
    lengths = task.train_lengths
    counts = {L: len(tasks._scan_by_length()[L]) for L in lengths}
    drawn = tasks.sample_mixed(task, 4000, lengths, rng()).length.tolist()
    share = {L: drawn.count(L) / 4000 for L in (1, 10, 22)}
    total = sum(counts.values())
    for L, s in share.items():                                       # 4000 draws: within 5 sigma
        p = counts[L] / total
        assert abs(s - p) < 5 * (p * (1 - p) / 4000) ** 0.5 + 1e-3, (L, s, p)
    uniform = tasks.sample_mixed(task, 4000, lengths, rng(), uniform_lengths=True).length.tolist()
    assert abs(uniform.count(1) / 4000 - 1 / len(lengths)) < 0.02
    every = task.every_example(24)
    commands = {" ".join(task.decode(row)).split(" = ")[0] for row in every.x}
    assert len(every.x) == len(commands) == counts.get(24, len(tasks._scan_by_length()[24])) == 336


@pytest.mark.parametrize("name", ["scan", "scan_cot"])
def test_scan_batches_equal_the_token_by_token_encoding(name):
    """A sampled batch is the rows of the encoded commands it drew (encoded once per process),
    exactly what encoding those commands one by one gives, padded to the longest drawn row."""
    task = TASKS[name]
    for length in (1, 22, 30):
        batch = task.sample(40, length, np.random.default_rng(5))
        pool = tasks._scan_by_length()[length]
        picks = np.random.default_rng(5).integers(0, len(pool), size=40)
        seqs, n_prompt = zip(*(task.tokens(*pool[i]) for i in picks))
        ref = task.lm_batch(list(seqs), list(n_prompt), length)
        assert torch.equal(batch.x, ref.x) and torch.equal(batch.y, ref.y) and torch.equal(batch.length, ref.length)


@pytest.mark.parametrize("length", [1, 2, 7, 40, 150])
def test_stack_batches_equal_the_reference_tokens(length):
    """The vectorised sampler builds, row by row, exactly `tokens(stack, actions)` of the prompt it
    drew (the initial stack is the prompt's 0/1 prefix, the actions the rest), and draws initial
    stacks of every size from 0 to length."""
    task = TASKS["stack"]
    batch = task.sample(300, length, rng())
    sizes = set()
    for b in range(300):
        prompt = [int(t) for t in prompt_tokens(task, batch, b)[:-1]]
        m = next((j for j, t in enumerate(prompt) if t >= 2), length)
        seq, k = task.tokens(prompt[:m], prompt[m:])
        assert prompt_tokens(task, batch, b) == seq[:k] and answer_tokens(task, batch, b) == seq[k:]
        sizes.add(m)
    assert sizes == set(range(length + 1)) or length == 150


@pytest.mark.parametrize("length", [1, 2, 9, 20])
def test_mul_cot_batches_equal_the_reference_tokens(length):
    """The vectorised sampler builds, row by row, exactly the `tokens(a, b)` of the operands in its
    prompt, padded as lm_batch pads; a has 1..length digits, b exactly length, no leading zeros."""
    task = TASKS["mul_cot"]
    batch = task.sample(200, length, rng())
    seqs, n_prompt, digits_a = [], [], set()
    for r in range(200):
        a, b = "".join(prompt_tokens(task, batch, r))[:-1].split("x")
        assert len(b) == length and str(int(a)) == a and str(int(b)) == b
        seq, k = task.tokens(int(a), int(b))
        seqs.append(seq)
        n_prompt.append(k)
        digits_a.add(len(a))
    ref = task.lm_batch(seqs, n_prompt, length)
    assert torch.equal(batch.x, ref.x) and torch.equal(batch.y, ref.y)
    assert digits_a == set(range(1, length + 1))


def test_a_fixed_training_set_is_visited_once_per_epoch_in_a_new_order():
    """train_set = 64 at batch 16: each epoch of 4 steps shows every problem of the set once, the
    next epoch the same problems in another order; step s's batch depends on the seed and s only."""
    from tasks import TrainBatches
    task = TASKS["parity"]
    data = TrainBatches(task, list(range(1, 17)), 16, 7, 12, train_set=64)
    rows = lambda step: {tuple(r.tolist()) for r in data[step].x}            # noqa: E731
    epoch0 = set().union(*(rows(s) for s in range(4)))
    epoch1 = set().union(*(rows(s) for s in range(4, 8)))
    assert epoch0 == epoch1 and sum(len(rows(s)) for s in range(4)) >= len(epoch0) > 40
    assert [tuple(r.tolist()) for r in data[0].x] != [tuple(r.tolist()) for r in data[4].x]
    again = TrainBatches(task, list(range(1, 17)), 16, 7, 12, train_set=64)
    assert torch.equal(again[5].x, data[5].x) and torch.equal(again[5].y, data[5].y)
    other = TrainBatches(task, list(range(1, 17)), 16, 8, 12, train_set=64)
    assert not torch.equal(other[0].x, data[0].x)


def test_multipliers_drawn_from_a_range_are_every_length_up_to_the_digits():
    """multiplier_low=1: multipliers uniform in 1..999, so of 1, 2 and 3 digits in about the ratio 9 : 90 : 900;
    each row is `tokens` of its own operands (the multiplier not padded), right-padded with <pad> to the longest
    row, the padding unsupervised and outside every slot; multiplier_low=0 (the default) draws as before."""
    mul = TASKS["mul_padded"]
    batch = mul.sample(2000, 5, rng(), multiplier_low=1)
    ids = lambda toks: [IGNORE if t is None else mul.stoi[t] for t in toks]  # noqa: E731
    counts = {1: 0, 2: 0, 3: 0}
    for b in range(2000):
        row = batch.x[b].tolist()
        real = [t for t in row if t != mul.pad_id]
        toks = [mul.vocab[i] for i in real]
        m = toks.index("×")
        a, c = int("".join(toks[:m])), int("".join(t for t in toks[m + 1:] if t != "#"))
        counts[m] += 1
        x, y, slot = mul.tokens(a, c, 20)
        n, pad = len(x), len(row) - len(x)
        assert toks == x and row[n:] == [mul.pad_id] * pad and 1 <= a <= 999 and c < 10 ** 5
        assert batch.y[b].tolist() == ids(y) + [IGNORE] * pad and batch.slot[b].tolist() == slot + [-1] * pad
    assert counts[1] > 0 and 100 < counts[2] < 300 and counts[3] > 1600, counts
    assert torch.equal(mul.sample(50, 5, rng()).x, mul.sample(50, 5, rng(), multiplier_low=0).x)
    with pytest.raises(ValueError, match="multiplier_low must be 0 or from 1 to 999"):
        mul.sample(4, 5, rng(), multiplier_low=1000)


def test_data_workers_outlive_a_stop_signal_sent_while_they_start(tmp_path):
    """Ctrl-C and `timeout` signal the whole process group. A data worker still starting (a spawned one imports
    the main module, torch with it) must not die of it: the run would fail where it should stop at a step
    with a checkpoint. Here the signal goes out at once after the workers are started; the loop still gets
    every batch, and the parent its signal."""
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "main.py"
    script.write_text(f"""import multiprocessing, os, signal, sys
sys.path.insert(0, {str(Path(tasks.__file__).parent)!r})
from tasks import TASKS, TrainBatches
if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    got = []
    signal.signal(signal.SIGINT, lambda s, f: got.append(int(s)))
    stream = TrainBatches(TASKS["parity"], [2, 3], 4, 0, 6).loader(0, 6, workers=2)
    os.killpg(0, signal.SIGINT)
    print(sum(1 for _ in stream), got)
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         start_new_session=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split(None, 1) == ["6", f"[{int(signal.SIGINT)}]\n"], out.stdout
