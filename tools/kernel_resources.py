"""Registers, spills and shared memory of the quantized matmul's launches, from nvcc on any machine (no GPU).

    python3 -m tools.kernel_resources --rows 16,32,64 [--shape 17408x5120] [--staged RW=1,ST=3] [--arch sm_90a]
    python3 -m tools.kernel_resources --rows 16,64 --parts gate+up,down+residual --staged RW=1 --cache-dir DIR
    python3 -m tools.kernel_resources --rows 1,64 --delta 16,48,128,128 --state-dtypes float32,float16
    python3 -m tools.kernel_resources --rows 1 --shape 5120x17408 --launch 8,1,4,3 --launch 8,1,4

Each launch `quantized_matmuls` would make for x [M, K] against an N x K matrix (4-bit, group 64 unless
`--bits`/`--group`), or those `tools.gpu.batch_parts` makes for its `--parts`, is built as MLX builds it
(`kernel_cache.KernelBuild.mlx_source`), without running it, and compiled by nvcc with `-Xptxas -v`: what
ptxas reports per kernel decides how many blocks an SM holds, which a timing on the device then confirms or
not. `--staged` lays the staged launches (2-64 rows) out as `tools.gpu.step_kernels --staged` does
(`KEY=VALUE,...`; repeatable); `--launch W,RT,U[,MINB]` (repeatable) builds each `--shape`'s one-row launch
so, as ENGINE_GEMV_LAUNCH would. `--delta HK,HV,DK,DV` builds the Gated DeltaNet step and scan kernels
instead, for heads of those sizes (qwen27b: 16,48,128,128) at each row count and `--state-dtypes`.
`--cache-dir DIR` also writes each cubin where MLX looks for it (`kernel_cache`): a process on the GPU with
MLX_PTX_CACHE_DIR=DIR (same source tree) then compiles none of them. `--loop` also counts each kernel's main
loop in its SASS (cuobjdump: on PATH, or `pip install nvidia-cuda-cuobjdump`): instructions a HMMA and the
commonest opcodes, what a layout or a change to the kernel's source costs in issue slots before any timing.
Each launch also says how many of its blocks an SM holds (threads, registers, shared memory: Hopper's limits) and
so how many waves its grid makes on `--sms` SMs (132: H100, H200) and how full the last one is: a launch whose
last wave is nearly empty leaves most SMs idle for a block's time before the next launch, which depends on it,
can start. A staged products' launch also says how many bytes of activations its blocks copy from L2 beside the
weights they read: where that is the larger, L2, not memory, bounds the launch (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import mlx.core as mx

from engine.kernels.cuda_source import compact
from engine.kernels.kernel_cache import KernelBuild
from engine.nvrtc import UTILS_HEADER

PTXAS = re.compile(r"Used (\d+) registers.*")
STATIC_SHARED = re.compile(r"Used \d+ registers.*?(\d+) bytes smem")
# Hopper (sm_90: H100, H200): what an SM holds at once
SM_REGISTERS, SM_SHARED, BLOCK_RESERVED, SM_WARPS, SM_BLOCKS = 65536, 233472, 1024, 64, 32
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@contextmanager
def recorded(builds: list):
    """Every custom kernel the quantized matmul's and the DeltaNet core's modules ask for is recorded in `builds`
    (with its launch: grid, block, dynamic shared bytes) and answered with zeros instead of being run."""
    from engine.kernels import gated_delta_scan, gated_delta_step
    from engine.kernels.quantized_gemv import source, staged

    def fake(*, name, input_names, output_names, source, header="", shared_memory=0):
        def call(*, inputs, template=(), output_shapes, output_dtypes, grid, threadgroup, **_):
            build = KernelBuild(
                name,
                tuple(input_names),
                tuple(output_names),
                compact(source),
                compact(header),
                tuple((x.dtype, x.ndim) for x in inputs),
                tuple(output_dtypes),
                tuple(template),
            )
            builds.append((build, grid, threadgroup, shared_memory))
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

        return call

    modules = (source, staged, gated_delta_step, gated_delta_scan)
    caches = (source.kernel, staged.kernel, staged.sum_kernel, gated_delta_step._kernel, gated_delta_scan._kernel)
    saved = [m.cuda_kernel for m in modules]
    for m in modules:
        m.cuda_kernel = fake
    for cached in caches:
        cached.cache_clear()
    try:
        yield
    finally:
        for m, kernel in zip(modules, saved):
            m.cuda_kernel = kernel
        for cached in caches:
            cached.cache_clear()


@cache
def nvcc_compile(build_source: str, arch: str) -> tuple[str, bytes]:
    """nvcc's -Xptxas -v report and cubin for one build's source ("" and b"" where it fails: the report holds
    the error then)."""
    with tempfile.TemporaryDirectory() as tmp:
        inc = Path(tmp) / "mlx" / "backend" / "cuda" / "device"
        inc.mkdir(parents=True)
        (inc / "utils.cuh").write_text(UTILS_HEADER)
        src, out = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        src.write_text(build_source)
        done = subprocess.run(
            [
                "nvcc",
                f"-arch={arch}",
                "-cubin",
                "-o",
                str(out),
                "-I",
                tmp,
                "-Xptxas",
                "-v",
                "--expt-relaxed-constexpr",
                "-std=c++17",
                str(src),
            ],
            capture_output=True,
            text=True,
        )
        return done.stdout + done.stderr, out.read_bytes() if done.returncode == 0 else b""


def nvcc_compiler(arch: str):
    """A `kernel_cache.Compiler` on nvcc: (cubin, the kernel's mangled name, from ptxas's report)."""

    def compile(source: str, kernel: str) -> tuple[bytes, str]:
        report, code = nvcc_compile(source, arch)
        entry = ENTRY.search(report)
        if not code or not entry:
            raise RuntimeError(report[-2000:])
        return code, entry.group(1)

    return compile


ENTRY = re.compile(r"Compiling entry function '([^']+)'")


def compile_report(build: KernelBuild, arch: str) -> dict:
    """ptxas's registers and spill bytes for one build."""
    text, code = nvcc_compile(build.mlx_source(), arch)
    if not code:
        return {"error": text[-3000:]}
    regs = PTXAS.search(text)
    spills = SPILLS.search(text)
    static = STATIC_SHARED.search(text)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "static_shared": int(static.group(1)) if static else 0,
        "spill_stores": int(spills.group(1)) if spills else 0,
        "spill_loads": int(spills.group(2)) if spills else 0,
    }


def blocks_per_sm(threads: int, registers: int, shared: int) -> tuple[int, str]:
    """How many blocks of `threads` an SM holds at once, and what limits it (threads, blocks, registers: allocated
    256 a warp at a time, or shared memory: a block's static and dynamic bytes and 1 KB the SM keeps)."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // 256) * 256
    limits = {
        "threads": SM_WARPS // warps,
        "blocks": SM_BLOCKS,
        "registers": SM_REGISTERS // per_warp // warps,
        "shared": SM_SHARED // (shared + BLOCK_RESERVED),
    }
    limit = min(limits, key=limits.get)
    return limits[limit], limit


def waves_line(blocks: int, threads: int, registers: int, shared: int, sms: int) -> str:
    """A launch's blocks as waves over `sms` SMs (`blocks_per_sm` each) and how full its last wave is: a launch
    the next one depends on leaves the rest of the last wave's SMs idle."""
    per_sm, limit = blocks_per_sm(threads, registers, shared)
    if per_sm == 0:
        return f"does not fit an SM ({limit})"
    waves = blocks / (sms * per_sm)
    last = waves - (-(-blocks // (sms * per_sm)) - 1)
    blocks_an_sm = f"{per_sm} block{'s' * (per_sm != 1)} an SM"
    return f"{blocks_an_sm} ({limit}), {waves:.2f} waves on {sms} SMs, the last {last:.0%} full"


SASS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)(\S*)\s*([^;]*);")


def l2_line(build: KernelBuild, blocks: int) -> str:
    """A staged products' launch's bytes from L2: every block copies its split's chunks of all M activation rows
    (once for its row blocks in turn), against the weights, scales and biases it reads; "" for other launches."""
    t = dict(build.template)
    if not build.name.startswith("engine_affine_sqmm") or "_sum" in build.name:
        return ""
    k, m, s, bits, gs = t["K"], t["M"], t["S"], t["BITS"], t["GS"]
    rows = t.get("NT") or sum(v for key, v in t.items() if re.fullmatch(r"N\d+", key))
    activations = blocks * (k // s) * m * 2
    weights = rows * k * bits / 8 + rows * (k // gs) * 4
    return f"L2 reads {activations / 1e6:.1f} MB of activations for {weights / 1e6:.1f} MB of weights"


def cuobjdump() -> str | None:
    """cuobjdump from PATH or the nvidia-cuda-cuobjdump package (None: neither)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        from nvidia import cu13
    except ImportError:
        return None
    tool = Path(next(iter(cu13.__path__))) / "bin" / "cuobjdump"
    return str(tool) if tool.exists() else None


def loop_mix(sass: str) -> tuple[int, int, Counter]:
    """The main loop of a kernel's SASS (the backward branch whose body holds the most HMMA): its instructions,
    its HMMA and the count of each opcode."""
    code = [(int(a, 16), op, operands) for a, op, _, operands in SASS.findall(sass)]
    best: list[str] = []
    for end, op, operands in code:
        target = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" else None
        if target and int(target.group(1), 16) < end:
            body = [o for a, o, _ in code if int(target.group(1), 16) <= a <= end]
            if body.count("HMMA") > best.count("HMMA"):
                best = body
    return len(best), best.count("HMMA"), Counter(best)


def loop_report(build: KernelBuild, arch: str, tool: str) -> str:
    """`loop_mix` of one build's cubin as a line: instructions a HMMA, then the commonest opcodes."""
    _, code = nvcc_compile(build.mlx_source(), arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(code)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    count, hmma, mix = loop_mix(sass)
    if not hmma:
        return "no HMMA loop"
    top = ", ".join(f"{op} {n}" for op, n in mix.most_common(10))
    return f"loop {count} instructions, {hmma} HMMA ({count / hmma:.2f} a HMMA): {top}"


def layout(spec: str) -> tuple[set[int] | None, dict]:
    """A --staged SPEC as (the row counts it keeps to, None for all; its StagedConfig fields)."""
    from tools.gpu.step_kernels import parse_staged

    return parse_staged(spec)


def delta_launches(heads: str, m: int, state_dtype: str) -> None:
    """The DeltaNet step kernel (as the fast tier calls it, and with its state staged in shared memory) and the
    scan kernel (a 2-token run) for `m` rows of heads 'HK,HV,DK,DV' (bf16 inputs, the state in `state_dtype`, a
    4-position conv); inside `recorded`."""
    from engine.kernels.gated_delta_scan import delta_scan
    from engine.kernels.gated_delta_step import delta_step

    hk, hv, dk, dv = (int(v) for v in heads.split(","))
    c, bf = 2 * hk * dk + hv * dv, mx.bfloat16
    weights = dict(
        conv_w=mx.zeros((c, 4, 1), dtype=bf),
        A_log=mx.zeros((hv,)),
        dt_bias=mx.zeros((hv,), dtype=bf),
        norm_w=mx.zeros((dv,), dtype=bf),
        conv_state=mx.zeros((m, 3, c), dtype=bf),
        state=mx.zeros((m, hv, dv, dk), dtype=getattr(mx, state_dtype)),
    )

    def token_inputs(t: int) -> dict:
        return dict(
            qkv=mx.zeros((m, t, c), dtype=bf),
            z=mx.zeros((m, t, hv * dv), dtype=bf),
            a=mx.zeros((m, t, hv), dtype=bf),
            beta_logits=mx.zeros((m, t, hv), dtype=bf),
        )

    delta_step(**token_inputs(1), **weights, norm_eps=1e-6, heads_k=hk, dk=dk, staged=False)
    delta_step(**token_inputs(1), **weights, norm_eps=1e-6, heads_k=hk, dk=dk, staged=True)
    delta_scan(**token_inputs(2), **weights, norm_eps=1e-6, heads_k=hk, dk=dk)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="16,32,64", help="activation rows M, comma-separated")
    p.add_argument(
        "--shape", action="append", default=[], metavar="NxK", help="matrix shape (repeatable; default 17408x5120)"
    )
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--gated", action="store_true", help="two matrices of the shape as a gated (SwiGLU) launch")
    p.add_argument(
        "--staged", action="append", default=[], metavar="SPEC", help="staged layout KEY=VALUE,... (repeatable)"
    )
    p.add_argument("--parts", default="", help="tools.gpu.batch_parts' parts (comma-separated) instead of --shape")
    p.add_argument(
        "--launch",
        action="append",
        default=[],
        metavar="W,RT,U[,MINB]",
        help="also each --shape's one-row launch with this shape (repeatable; ENGINE_GEMV_LAUNCH's form)",
    )
    p.add_argument("--cache-dir", type=Path, help="also write the cubins here, as MLX_PTX_CACHE_DIR holds them")
    p.add_argument("--list", action="store_true", help="only list the launches (no nvcc)")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--sms", type=int, default=132, help="the card's SMs, for each launch's waves (H100, H200: 132)")
    p.add_argument("--delta", metavar="HK,HV,DK,DV", help="the DeltaNet step and scan kernels for these heads instead")
    p.add_argument("--state-dtypes", default="float32", help="with --delta: the state's dtypes, comma-separated")
    p.add_argument(
        "--loop",
        action="store_true",
        help="also each kernel's main loop from its SASS: instructions a HMMA and the commonest opcodes (needs "
        "cuobjdump: on PATH, or pip install nvidia-cuda-cuobjdump)",
    )
    args = p.parse_args()
    tool = cuobjdump() if args.loop else None
    if args.loop and tool is None:
        p.error("--loop needs cuobjdump (on PATH, or pip install nvidia-cuda-cuobjdump)")

    from engine.kernels.kernel_cache import KernelCache
    from engine.kernels.quantized_gemv import LaunchConfig, quantized_matmuls, staged
    from tools.gpu.step_kernels import staged_layout

    try:
        launches = [(v, LaunchConfig.parse(v)) for v in args.launch]
    except ValueError as e:
        p.error(f"--launch {e}")

    variants = [("", (None, {}))] + [(s, layout(s)) for s in args.staged]
    if args.list and args.cache_dir:
        p.error("--list compiles nothing: no --cache-dir with it")
    cache = KernelCache(args.cache_dir, compiler=nvcc_compiler(args.arch)) if args.cache_dir else None
    seen = {}

    def report(what: str, builds: list) -> None:
        for build, grid, block, shared in builds:
            key = build.module_name()
            if key not in seen:
                seen[key] = {"error": "not compiled (--list)"} if args.list else compile_report(build, args.arch)
                if cache is not None:
                    cache.submit(build)
            r = seen[key]
            res = r.get("error") or (f"{r['registers']} registers, spills {r['spill_stores']}/{r['spill_loads']} B")
            blocks = math.prod(-(-g // b) for g, b in zip(grid, block))
            if "error" not in r:
                threads = math.prod(block)
                res += "; " + waves_line(blocks, threads, r["registers"], shared + r["static_shared"], args.sms)
            l2 = l2_line(build, blocks)
            res += f"; {l2}" if l2 else ""
            print(
                f"{what} {build.name}: grid {grid[0] // block[0]} x {block[0]} threads, {shared} B dynamic "
                f"shared; {res}",
                flush=True,
            )
            if tool is not None and "error" not in r:
                print(f"  {loop_report(build, args.arch, tool)}", flush=True)

    rows = [int(v) for v in args.rows.split(",")]
    if args.delta:
        for m in rows:
            for dtype in args.state_dtypes.split(","):
                builds = []
                with recorded(builds):
                    delta_launches(args.delta, m, dtype)
                report(f"delta {args.delta} M={m} {dtype}", builds)
        return
    if args.parts:
        from tools.gpu import batch_parts

        names = [v.strip() for v in args.parts.split(",") if v.strip()]

        def zeros(n, k, bits, gs):
            return (mx.zeros((n, k * bits // 32), dtype=mx.uint32), *[mx.zeros((n, k // gs), dtype=mx.bfloat16)] * 2)

        batch_parts.random_quantized, batch_parts.time_us = zeros, lambda fn, cfg: [fn()] and 0.0
        for m in rows:
            for label, (counts, fields) in variants:
                if fields and (m < staged.MIN_ROWS or (counts is not None and m not in counts)):
                    continue
                for name in names:  # one part at a time, so each line names its part
                    builds: list = []
                    with recorded(builds), staged_layout(fields):
                        batch_parts.parts(m, None, frozenset({name}))
                    if not builds:
                        p.error(f"--parts: {name!r} launches nothing (see tools.gpu.batch_parts' parts)")
                    report(f"M={m} {name} [{label or 'default'}]", builds)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shape] or (
        [] if args.parts else [(17408, 5120)]
    )
    for n, k in shapes:
        w = mx.zeros((n, k * args.bits // 32), dtype=mx.uint32)
        sc = mx.zeros((n, k // args.group), dtype=mx.bfloat16)
        matrices = [(w, sc, sc)] * (2 if args.gated else 1)
        for m in rows:
            x = mx.zeros((m, k), dtype=mx.bfloat16)
            for label, (counts, fields) in variants:
                if fields and (m < staged.MIN_ROWS or (counts is not None and m not in counts)):
                    continue
                builds = []
                with recorded(builds), staged_layout(fields):
                    quantized_matmuls(x, matrices, args.group, args.bits, gated=args.gated)
                report(f"{n}x{k} M={m} [{label or 'default'}]", builds)
            for label, config in launches if m == 1 else ():
                builds = []
                with recorded(builds):
                    quantized_matmuls(x, matrices, args.group, args.bits, config=config, gated=args.gated)
                report(f"{n}x{k} M=1 [{label}]", builds)
    if cache is not None:
        cache.settle()
        print(f"kernel cache {args.cache_dir}: {cache.stats()}", flush=True)


if __name__ == "__main__":
    main()
