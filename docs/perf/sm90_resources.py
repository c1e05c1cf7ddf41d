"""Registers, spilled bytes and shared memory of the Triton kernels a call launches, compiled for an H100/H200
(sm_90) on a machine without a GPU: a kernel's launch settings checked before any device time is spent.

    python docs/perf/sm90_resources.py prism_scores                  # PRISM's cursor scores, a training shape
    python docs/perf/sm90_resources.py path --head-dim 128 --length 256 --triton DIR
    python docs/perf/sm90_resources.py prism_scan | upe --head-dim 96

The call runs through Triton's interpreter with every launch recorded and skipped (so the shapes, not the
values, matter: big shapes cost nothing). Each distinct launch (kernel, argument types, constexprs, warps,
stages, and the arguments Triton's launcher would specialise as multiples of 16) is then compiled for sm_90 in a
second process without the interpreter (a Triton imported for one cannot compile), by this environment's Triton
or, with --triton DIR, by the one installed there (`pip install --target DIR --no-deps triton==3.6.0`, the GPU
machine's). ptxas -v gives the registers a thread and the bytes spilled; shared memory is Triton's. A kernel
that asks for more shared memory than sm_90 has (232,448 bytes a block) would fail at launch there. Results:
docs/perf/prism.md, docs/perf/path.md.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

COMPILE = "--compile" in sys.argv                 # the second process: compile what the first recorded
if not COMPILE:
    os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported: launches are recorded, not run
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
SHARED_MAX = 232448                               # bytes of shared memory a block may take on sm_90
TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
         torch.int32: "*i32", torch.int8: "*i8", torch.bool: "*i1", torch.uint8: "*u8"}


def record(call) -> list[tuple]:
    """(function, {argument name: value}, launch options) of every kernel launch `call()` makes."""
    launches, real = [], interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
        launches.append((self.fn, {**dict(zip(self.arg_names, args)), **kwargs}, options))
    interpreter.InterpretedFunction.run = run
    try:
        call()
    finally:
        interpreter.InterpretedFunction.run = real
    return launches


def signature(jit: JITFunction, values: dict) -> tuple[dict, dict, list]:
    """The argument types, the constexprs and the arguments a launch specialises as multiples of 16 (pointers
    aligned to 16 bytes, integers divisible by 16, as Triton's launcher does) of one launch."""
    sig, consts, sixteen = {}, {}, []
    for p in jit.params:
        v = values.get(p.name, p.default)
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif torch.is_tensor(v):
            sig[p.name] = TYPES[v.dtype]
            sixteen += [p.name] if v.data_ptr() % 16 == 0 else []
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            sixteen += [p.name] if v % 16 == 0 else []
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            sig[p.name], consts[p.name] = "constexpr", v
    return sig, consts, sixteen


def compiled(fn, sig: dict, consts: dict, sixteen: list, options: dict) -> dict:
    """Compile for sm_90; the resources of the result."""
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in sixteen}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    out = ""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(kernel.asm["ptx"])
        for name in ("ptxas-blackwell", "ptxas"):          # the first that reads this Triton's PTX version
            ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
            run = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(Path(tmp) / "k.ptx"), "-o",
                                  str(Path(tmp) / "k.o")], capture_output=True, text=True) if ptxas.exists() else None
            if run is not None and run.returncode == 0:
                out = run.stdout + run.stderr
                break
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return {"registers": int(regs.group(1)) if regs else None, "spill_stores": int(spills.group(1)) if spills else None,
            "spill_loads": int(spills.group(2)) if spills else None, "shared": kernel.metadata.shared}


def specs(launches: list[tuple]) -> list[dict]:
    """The distinct launches, each as {"module", "name", "sig", "consts", "options"}."""
    out = []
    for fn, values, options in launches:
        sig, consts, sixteen = signature(JITFunction(fn), values)
        spec = {"module": fn.__module__, "name": fn.__qualname__, "sig": sig, "consts": consts, "sixteen": sixteen,
                "options": options}
        if spec not in out:
            out.append(spec)
    return out


def report(spec: dict) -> str:
    fn = getattr(importlib.import_module(spec["module"]), spec["name"])     # a JIT function in this process
    r = compiled(fn, spec["sig"], spec["consts"], spec["sixteen"], spec["options"])
    shown = ", ".join(f"{k}={v}" for k, v in spec["consts"].items() if v is not None)
    warn = "  (more shared memory than sm_90 has)" if r["shared"] > SHARED_MAX else ""
    o = spec["options"]
    return (f"{spec['module']}.{spec['name']} [{shown}; {o.get('num_warps', 4)} warps, "
            f"{o.get('num_stages', 3)} stages" + (f", maxnreg {o['maxnreg']}" if o.get("maxnreg") else "") + "]: "
            f"{r['registers']} registers, spills {r['spill_stores']} / {r['spill_loads']} bytes (stores / loads), "
            f"{r['shared']} bytes shared{warn}")


def prism_scores_call(a):
    from kernels import prism_scores
    from kernels.prism_scores import cursor_dots_triton
    prism_scores._precision = lambda x: "tf32"              # as on a GPU (the recording's tensors are on the CPU)
    H, O = 35, 4
    hist = torch.rand(2, a.batch, H * O, a.length, a.bins, requires_grad=True)     # (sides, B, H O, T, P)
    dots, sq = cursor_dots_triton(hist, torch.rand(a.bins, a.bins), H)
    (dots.sum() + sq.sum()).backward()


def path_call(a):
    from path_attention import path_attention_triton
    B, H, T, D = a.batch, 1, a.length, a.head_dim
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    w = torch.randn(B, H, T, D, dtype=torch.bfloat16, requires_grad=True)
    beta = torch.rand(B, H, T, requires_grad=True)
    out = path_attention_triton(q, k, v, w, beta)
    out.float().sum().backward()


def prism_scan_call(a):
    from kernels.prism_scan import histogram_scan_triton
    gates = [torch.rand(a.batch, 280, a.length, requires_grad=True) for _ in range(4)]     # 35 heads x 4 cursors
    gamma = torch.full((a.batch, 280), 2.0, requires_grad=True)
    histogram_scan_triton(*gates, gamma, a.bins).sum().backward()


def upe_call(a):
    from kernels.upe_attention import upe_attention_triton
    B, H, T, D, K = a.batch, 8, a.length, a.head_dim, 16
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    rel, uni = torch.randn(H, 2 * K + 1, D, requires_grad=True), torch.randn(H, 4, D, requires_grad=True)
    slot = torch.randint(-1, 4, (B, T))
    upe_attention_triton(q, k, v, rel, uni, slot).float().sum().backward()


CALLS = {"prism_scores": prism_scores_call, "prism_scan": prism_scan_call, "path": path_call, "upe": upe_call}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("call", nargs="?", choices=sorted(CALLS))
    p.add_argument("--triton", metavar="DIR", help="compile with the Triton installed in DIR (pip install --target "
                   "DIR triton==3.6.0: the GPU machine's) instead of this environment's")
    p.add_argument("--compile", metavar="JSON", help=argparse.SUPPRESS)   # the second process's input
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--length", type=int, default=96, help="tokens (PRISM: 96, add_cot's padded length)")
    p.add_argument("--bins", type=int, default=128, help="PRISM: histogram bins")
    p.add_argument("--head-dim", type=int, default=64, help="PaTH: head dim")
    a = p.parse_args(argv)
    if a.compile:
        print(f"Triton {triton.__version__}, sm_90:")
        shown = []
        for spec in json.loads(Path(a.compile).read_text()):
            line = report(spec)
            if line not in shown:                            # launches that differ only in alignment
                print(line, flush=True)
                shown.append(line)
        return 0
    if not a.call:
        p.error("name a call: " + ", ".join(sorted(CALLS)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "launches.json"
        path.write_text(json.dumps(specs(record(lambda: CALLS[a.call](a)))))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([*([a.triton] if a.triton else []), root, env.get("PYTHONPATH", "")])
        return subprocess.run([sys.executable, __file__, "--compile", str(path)], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
