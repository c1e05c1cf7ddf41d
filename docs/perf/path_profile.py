"""Where PaTH's Triton forward + backward spends its time, kernel by kernel, and which launch
settings are fastest at a given head dim.

    python docs/perf/path_profile.py --D 128 --H 16                   # today's settings
    python docs/perf/path_profile.py --D 128 --H 16 --sweep 4x1,4x3,8x1,8x3 --blocks 32,64
    python docs/perf/path_profile.py --D 128 --H 16 --split 0,1 --dkl 4x3,8x3 --dkl-tile 1,2   # _bwd_dkl
    python docs/perf/path_profile.py --D 128 --H 16 --carry-wu 0,1             # states carried by W and U
    python docs/perf/path_profile.py --D 128 --H 16 --split-dm 0,1             # dM and dPL in _bwd_dm
    python docs/perf/path_profile.py --D 128 --carry-wu 1 --launch "" --launch "fwd.num_stages=2 dq.IS=2"

For each setting (warps x stages of the three attention kernels `_fwd`, `_bwd_dq`, `_bwd_dkv`,
the block length BL, the fused UT kernels' warps, `_bwd_dkl` or not, CARRY_WU or not, SPLIT_DM or not) it
prints the median fwd+bwd time
(triton.testing.do_bench), the CUDA time of each kernel per fwd+bwd (torch.profiler), and the
registers and spilled registers of each compiled Triton kernel. SDPA (causal, no position
encoding) at the same shape is timed in the same process. Run it from the repository root; the
results of each run go to docs/perf/path.md.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kernels.path_attention as kp  # noqa: E402
import path_attention as pa  # noqa: E402

TRITON_KERNELS = ("_ut_fwd", "_ut_bwd", "_fwd", "_bwd_dq", "_bwd_dkl", "_bwd_dm", "_bwd_dkv", "_chunk_fwd",
                  "_chunk_bwd")


def inputs(B, H, T, D, dtype, gate, device="cuda"):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    w = F.normalize(torch.randn(B, H, T, D, device=device), dim=-1).requires_grad_(True)
    beta = (2 * torch.rand(B, H, T, device=device)).requires_grad_(True)
    g = F.logsigmoid(4 + torch.randn(B, H, T, device=device)).requires_grad_(True) if gate else None
    return q, k, v, w, beta, g


def step_fn(fn, args):
    """fwd+bwd of fn(*args) with a fixed upstream gradient."""
    out = fn(*args)
    do = torch.randn_like(out)
    leaves = [a for a in args if a is not None and a.requires_grad]

    def step():
        torch.autograd.grad(fn(*args), leaves, do)
    return step


def kernel_times(step, reps=5):
    """CUDA milliseconds per call of step(), by kernel name (Triton kernels by their function name,
    everything else summed as 'torch ops')."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for evt in prof.key_averages():
        if "CUDA" not in str(getattr(evt, "device_type", "CUDA")):
            continue
        us = getattr(evt, "device_time_total", None)
        if us is None:
            us = evt.cuda_time_total
        if us <= 0:
            continue
        name = next((n for n in TRITON_KERNELS if evt.key == n or evt.key.startswith(n + "_")), "torch ops")
        out[name] += us / 1e3 / reps
    return dict(out)


def resources():
    """(registers, spilled registers) of every compiled variant of each Triton kernel, by name."""
    res = {}
    for name in TRITON_KERNELS:
        fn = getattr(kp, name)
        seen = []
        for dev_cache in getattr(fn, "device_caches", {}).values():
            for kernel in dev_cache[0].values():
                try:
                    kernel._init_handles()
                    seen.append((kernel.metadata.num_warps, kernel.metadata.num_stages, kernel.n_regs,
                                 kernel.n_spills))
                except Exception as e:  # noqa: BLE001 - a probe; report and go on
                    seen.append(repr(e)[:80])
        if seen:
            res[name] = seen
    return res


# The head-dim sets of kernels.path_attention that switch a kernel variant on, by flag: (name, what 0 and 1 mean)
HEAD_DIM_SETS = {
    "carry_wu": ("CARRY_WU", "a chunk's states carried by M (0) or by W and U (1, CARRY_WU)"),
    "split_dm": ("SPLIT_DM", "dM and dPL inside _bwd_dkv (0) or in _bwd_dm (1, SPLIT_DM)"),
    "chunk_wu": ("CHUNK_WU", "the chunk products' suffix carried by M (0) or by W and U in fp16, one program per "
                 "chunk (1, CHUNK_WU; needs CARRY_WU)"),
    "chunk_wu_bwd": ("CHUNK_WU_BWD", "the chunk backward's dS carried by M (0) or by W and U in fp16 (1, "
                     "CHUNK_WU_BWD; needs CARRY_WU)"),
}


def main(argv=None) -> int:
    import triton.testing

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--gate", action="store_true", help="PaTH-FoX (a forget gate)")
    p.add_argument("--sweep", default="", help="warps x stages of the attention kernels, e.g. 4x1,8x3 "
                   "(default: the kernels' own settings)")
    p.add_argument("--blocks", default="", help="block lengths BL to try (default: block_size(D))")
    p.add_argument("--ut-warps", default="", help="warps of the fused UT kernels to try")
    p.add_argument("--ut-maxnreg", default="", help="registers a thread of the UT kernels may take, to try "
                   "(kernels.path_attention.UT_MAXNREG; 0: as many as they need)")
    p.add_argument("--dkv", default="", help="warps x stages of _bwd_dkv alone to try")
    p.add_argument("--chunk", default="", help="warps x stages of the chunk-product kernels to try")
    p.add_argument("--chunks", default="", help="blocks per chunk R to try (default: CHUNK)")
    p.add_argument("--split", default="", help="0,1: the later chunks' pairs inside _bwd_dkv (0) or in _bwd_dkl "
                   "(1, kernels.path_attention.SPLIT_DKL) (default: as SPLIT_DKL says for D)")
    p.add_argument("--dkl", default="", help="warps x stages of _bwd_dkl to try (with --split 1)")
    p.add_argument("--dkl-tile", default="", help="key blocks per _bwd_dkl program to try (default: DKL_TILE)")
    p.add_argument("--launch", action="append", default=[], help="launch settings over LAUNCH[D], one variant "
                   "each: 'KERNEL.KEY=VALUE ...' (e.g. 'fwd.num_stages=2 dq.IS=2'; '' for LAUNCH as it is)")
    for flag, (_, what) in HEAD_DIM_SETS.items():
        p.add_argument("--" + flag.replace("_", "-"), default="", help=f"0,1: {what}")
    p.add_argument("--out", default="", help="append one JSON line per setting here")
    a = p.parse_args(argv)
    dtype = torch.bfloat16
    args = inputs(a.B, a.H, a.T, a.D, dtype, a.gate)
    q, k, v = args[:3]
    sdpa = step_fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v))
    sdpa_ms = triton.testing.do_bench(sdpa, warmup=25, rep=100)
    print(f"{torch.cuda.get_device_name()}  B={a.B} H={a.H} T={a.T} D={a.D} gate={a.gate}  "
          f"SDPA fwd+bwd {sdpa_ms:.3f} ms", flush=True)
    attn = [None] if not a.sweep else [tuple(int(x) for x in s.split("x")) for s in a.sweep.split(",")]
    blocks = [None] if not a.blocks else [int(x) for x in a.blocks.split(",")]
    ut_warps = [kp.UT_WARPS] if not a.ut_warps else [int(x) for x in a.ut_warps.split(",")]
    ut_regs = [kp.UT_MAXNREG] if not a.ut_maxnreg else [int(x) or None for x in a.ut_maxnreg.split(",")]
    dkv = [None] if not a.dkv else [tuple(int(x) for x in s.split("x")) for s in a.dkv.split(",")]
    chunk = [None] if not a.chunk else [tuple(int(x) for x in s.split("x")) for s in a.chunk.split(",")]
    chunks = [kp.CHUNK] if not a.chunks else [int(x) for x in a.chunks.split(",")]
    splits = [a.D in kp.SPLIT_DKL] if not a.split else [bool(int(x)) for x in a.split.split(",")]
    dkl = [None] if not a.dkl else [tuple(int(x) for x in s.split("x")) for s in a.dkl.split(",")]
    tiles = [kp.DKL_TILE] if not a.dkl_tile else [int(x) for x in a.dkl_tile.split(",")]
    # every combination of the head-dim sets' values asked for (each set as it is where not asked)
    defaults = {flag: set(getattr(kp, name)) for flag, (name, _) in HEAD_DIM_SETS.items()}
    ons = [dict(zip(defaults, c)) for c in itertools.product(*(
        [a.D in defaults[f]] if not getattr(a, f) else [bool(int(x)) for x in getattr(a, f).split(",")]
        for f in defaults))]
    default_launch, default_split, default_tile = kp.launch, set(kp.SPLIT_DKL), kp.DKL_TILE
    default_ut = kp.UT_WARPS, kp.UT_MAXNREG
    variants = [dict(tuple(kv.split("=")) for kv in v.split()) for v in a.launch] or [{}]
    grid = [(BL, R, uw, ur, ws, ks, cs, sp, ls, kt, on, lv) for BL in blocks for R in chunks
            for uw in ut_warps for ur in ut_regs for ws in attn for ks in dkv for cs in chunk for sp in splits
            for ls in (dkl if sp else [None]) for kt in (tiles if sp else [default_tile]) for on in ons
            for lv in variants]
    for BL, R, uw, ur, ws, ks, cs, sp, ls, kt, on, lv in grid:
        def patched(name, D, ws=ws, ks=ks, cs=cs, ls=ls, lv=lv):
            new = (ks if name == "dkv" and ks else ws if name in ("fwd", "dq", "dkv")
                   else cs if name == "chunk" else ls if name == "dkl" else None)
            over = {} if new is None else dict(num_warps=new[0], num_stages=new[1])
            given = {k.split(".")[1]: int(v) for k, v in lv.items() if k.split(".")[0] == name}
            return default_launch(name, D) | over | given
        kp.launch, kp.UT_WARPS, kp.UT_MAXNREG = patched, uw, ur
        kp.SPLIT_DKL, kp.DKL_TILE = (default_split | {a.D} if sp else default_split - {a.D}), kt
        for flag, (name, _) in HEAD_DIM_SETS.items():
            setattr(kp, name, defaults[flag] | {a.D} if on[flag] else defaults[flag] - {a.D})
        label = (f"BL={BL or kp.block_size(a.D)} R={R} ut_warps={uw}"
                 + (f" ut_maxnreg={ur or 0}" if a.ut_maxnreg else "")
                 + f" attn={'default' if ws is None else '%dx%d' % ws}"
                 f" dkv={'default' if ks is None else '%dx%d' % ks}"
                 f" chunk={'default' if cs is None else '%dx%d' % cs}"
                 f" split={int(sp)} " + " ".join(f"{f}={int(v)}" for f, v in on.items())
                 + (" launch=" + ",".join(f"{k}={v}" for k, v in lv.items()) if lv else "")
                 + (f" dkl={'default' if ls is None else '%dx%d' % ls} dkl_tile={kt}" if sp else ""))
        fn = lambda *x, BL=BL, R=R: pa.path_attention_triton(*x[:5], g=x[5], block=BL, chunk=R)  # noqa: E731
        try:
            step = step_fn(fn, args)
            ms = triton.testing.do_bench(step, warmup=25, rep=200)
            per = kernel_times(step)
        except Exception as e:  # noqa: BLE001 - a setting that fails to compile or launch
            print(f"{label}: failed: {repr(e)[:200]}", flush=True)
            torch.cuda.empty_cache()
            continue
        print(f"{label}: {ms:8.3f} ms = {ms / sdpa_ms:5.2f}x SDPA | "
              + "  ".join(f"{n} {t:.2f}" for n, t in sorted(per.items(), key=lambda x: -x[1])), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(dict(label=label, ms=ms, ratio=ms / sdpa_ms, kernels=per, sdpa_ms=sdpa_ms,
                                        shape=vars(a))) + "\n")
    kp.launch, kp.SPLIT_DKL, kp.DKL_TILE = default_launch, default_split, default_tile
    kp.UT_WARPS, kp.UT_MAXNREG = default_ut
    for flag, (name, _) in HEAD_DIM_SETS.items():
        setattr(kp, name, defaults[flag])
    print("registers, spills (warps, stages, regs, spills) per compiled variant:")
    for name, seen in resources().items():
        print(f"  {name:10s} {seen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
