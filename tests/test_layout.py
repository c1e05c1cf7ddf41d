"""The layout: imports flow one way (kernels at the ground, no circle), and
`python train.py` runs train.py's body once."""
import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = {p.stem: p for p in ROOT.glob("*.py")} | {f"{d}.{p.stem}": p for d in ("kernels", "examples")
                                                     for p in (ROOT / d).glob("*.py") if p.stem != "__init__"}


def imports(path: Path) -> set[str]:
    """The project modules a file imports, at its top or in a function; not in its `__main__` block
    (the hand-over of train.py to cli.py, the one import allowed upward)."""
    tree = ast.parse(path.read_text())
    found = set()

    def visit(node):
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)   # from kernels import path_attention
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(tree)
    return {m for m in found if m in MODULES}


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def test_kernels_import_nothing_of_the_project():
    for name, deps in GRAPH.items():
        if name.startswith("kernels."):
            assert all(d.startswith("kernels.") for d in deps), f"{name} imports {sorted(deps)}"


def test_method_files_import_no_loop():
    for name in ("path_attention", "prism", "vipe", "upe", "model", "tasks", "examples.relative_bias"):
        assert not GRAPH[name] & {"train", "cli", "experiments", "bench"}, f"{name} imports {sorted(GRAPH[name])}"
    assert "cli" not in GRAPH["train"]


def test_the_job_runner_sits_between_the_command_line_and_the_loop():
    """cli -> jobs -> train: the runner imports the loop and below, never the command line or the tables
    (it receives the function that makes one run), and the command line uses it."""
    assert "jobs" in GRAPH["cli"] and "train" in GRAPH["jobs"]
    assert not GRAPH["jobs"] & {"cli", "experiments", "bench"}, sorted(GRAPH["jobs"])


def test_no_import_circle():
    state = {}

    def walk(name, path):
        state[name] = "open"
        for dep in GRAPH[name]:
            if state.get(dep) == "open":
                raise AssertionError("import circle: " + " -> ".join(path + [dep]))
            if dep not in state:
                walk(dep, path + [dep])
        state[name] = "done"
    for name in GRAPH:
        if name not in state:
            walk(name, [name])


def test_the_graph_sees_the_imports():
    """The walk itself: it finds what it must (else the tests above would pass on an empty graph)."""
    assert {"train", "experiments"} <= GRAPH["cli"] and "kernels.path_attention" in GRAPH["path_attention"]
    assert "model" in GRAPH["vipe"] and "bench" in MODULES


# The top-level files of README's Layout (evaluation.py's docstring says why it is not part of train.py)
LAYOUT = {"tasks", "model", "train", "evaluation", "cli", "jobs", "experiments", "prism", "path_attention", "vipe",
          "upe", "bench"}


def test_top_level_files_are_the_layouts_and_train_py_reads_in_one_sitting():
    assert {name for name in MODULES if "." not in name} == LAYOUT
    for name, most in (("train.py", 500), ("cli.py", 700)):   # the loop, and the command line without the plumbing
        lines = len((ROOT / name).read_text().splitlines())
        assert lines <= most, f"{name} has {lines} lines (the layout asks at most {most})"
    assert "evaluation" in GRAPH["train"] and not GRAPH["evaluation"] & {"train", "cli", "experiments"}


def test_python_train_py_runs_its_body_once():
    """`python train.py` hands over to cli.py before its body runs: the registry is built once
    (model.baseline is called for each of the six baselines once, not twice)."""
    code = ("import runpy, sys; import model; calls = []; orig = model.baseline\n"
            "model.baseline = lambda *a, **k: (calls.append(a[0]), orig(*a, **k))[1]\n"
            "sys.argv = ['train.py', '--help-method', 'nope']\n"
            "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print(len(calls), sorted(m for m in sys.modules if m in ('train', '__main__')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split()[0] == "6", out.stdout


def test_help_is_written_for_users(capsys):
    """--help: a paragraph for users (not the module's developer docstring), examples, every
    experiment name and the presets, read from the code."""
    import pytest

    import cli
    import experiments
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert e.value.code == 0 and cli.ABOUT.split()[0] in text and "keeps a run safe" not in text
    assert "examples:" in text and "--resume" in text and "--reproduce path-flipflop" in text
    flat = " ".join(text.split())
    assert all(name in flat for name in experiments.EXPERIMENTS)
    gpu = cli.PRESETS["gpu"]["flipflop"]
    assert f"flipflop: d_model={gpu['d_model']}, n_layers={gpu['n_layers']}" in text


def test_readme_snippet_runs(tmp_path, monkeypatch):
    """README's "Use a method in your own model" snippet, as written, run from the repository's folder."""
    import re
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Use a method in your own model"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(ROOT)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert tuple(scope["y"].shape) == (2, 50, 128) and scope["y"].isfinite().all()


def test_readme_install_block_is_what_ci_runs():
    """CI installs as README says: the CPU line's torch version and the requirements file."""
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    block = readme[readme.index("## Install"):readme.index("## Quick start")]
    assert "pip install torch==2.13.0" in block and "pip install -q torch==2.13.0" in ci
    assert "pip install -r requirements.txt" in block and "pip install -q -r requirements.txt" in ci


def test_the_gpu_suite_deals_every_gpu_test_once_keeping_the_kernels_of_a_group_together():
    """.ci/gpu shares the GPU tests out between its processes (GPU_SUITE_DEAL_ONLY=1 prints the deal): every
    test marked gpu once, every process some, and the tests that differ only in their last parameter (a length,
    the same compiled kernels) in one process."""
    env = {**os.environ, "GPU_SUITE_DEAL_ONLY": "1", "GPU_SUITE_PROCS": "4"}
    dealt = subprocess.run(["bash", str(ROOT / ".ci" / "gpu")], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert dealt.returncode == 0, dealt.stderr
    pairs = [line.split(" ", 1) for line in dealt.stdout.splitlines()]
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu"], cwd=ROOT,
                               capture_output=True, text=True, timeout=300).stdout
    ids = [line for line in collected.splitlines() if "::" in line]
    assert len(ids) > 100 and sorted(test for _, test in pairs) == sorted(ids)
    assert {proc for proc, _ in pairs} == {"0", "1", "2", "3"}
    where = dict((test, proc) for proc, test in pairs)
    group = [t for t in ids if t.startswith("tests/test_path_attention.py::test_triton_gpu_default_blocks[False-16-")
             and "dtype0" in t]
    assert len(group) == 4 and len({where[t] for t in group}) == 1


def test_every_results_folder_is_in_the_results_index():
    """docs/results/README.md names every folder of docs/results (a task's runs or a study), and no other."""
    import re
    root = Path(__file__).resolve().parents[1] / "docs" / "results"
    named = set(re.findall(r"`([\w.-]+)`", (root / "README.md").read_text()))
    folders = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    assert folders - named == set(), "not in docs/results/README.md"
    listed = set(re.findall(r"^\| `([\w.-]+)` \|", (root / "README.md").read_text(), re.M))
    assert listed - folders == set(), "listed in docs/results/README.md but not there"
