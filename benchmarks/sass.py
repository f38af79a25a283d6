"""SASS of lanekit's launches at the benchmarks' shapes, compiled for sm90 with no GPU.

    python -m benchmarks.sass [case ...] [--dump DIR] [--splits N] [--lines N]

Runs a case of benchmarks.layers, decode, gemm or gemm_4bit through its real launcher on CPU
tensors of the benchmark's shapes, with sm90's tuning rows; every kernel launch is caught before it runs,
compiled by Triton for sm90 with the specialization the launch would get on the GPU (dtypes, ints
equal to 1, strides of 1, 16-byte alignment), and disassembled with the cuobjdump Triton bundles.
Prints, per launch: the grid, the tile (block sizes, warps, stages), registers per thread, shared
memory, the static SASS instruction count and those on the path real inputs take, for the fused
layers that count per element each thread handles (they are straight-line per program, so it is the
issued instructions per element), and the instructions that cost the most issue slots on Hopper
(fp64 and conversions; cvt runs 16 per clock per SM against 128 fp32 operations). A kernel with a
loop (the decode kernel's walk over key blocks) also gets its largest loop's body, as compiled: the
instructions of one pass (of an unrolled loop, several source iterations; of nested loops, the inner
body once) and the opcodes that say what it spends them on (barriers, asynchronous copies,
shared-memory traffic, matrix products, per-key masks and addresses). Nothing is timed: this is the
CPU's view of a kernel. The decode cases allocate their caches on the CPU (about 1 GB at 4k keys, 8
GB at 32k). Their split count is the heuristic's for the CPU (1), where the H200 may pick more; one
split is a kernel of its own (an int argument of 1 is specialized, and it writes the output
directly), so --splits N compiles the launches of N splits instead. --lines N adds, per launch, the
N source lines with the most instructions on the path taken (from the line table Triton compiles in,
read by the bundled nvdisasm), each with its leading opcodes.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile, make_backend
from triton.runtime import jit as triton_jit

from benchmarks import decode, gemm, gemm_4bit, run
from benchmarks import layers as bench
from lanekit.runtime import tuning

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
NVDISASM = os.path.join(os.path.dirname(CUOBJDUMP), "nvdisasm")
# opcodes worth a column: fp64 arithmetic, conversions, shuffles, 64-bit integer address math
WATCH = ("F2F", "I2F", "F2I", "DADD", "DMUL", "DFMA", "MUFU", "SHFL", "IMAD.WIDE", "LDG", "STG")


def _on_cubin(kernel, *commands: list[str]) -> list[str]:
    """The output of each command (a tool and its flags) run on the compiled kernel's cubin."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return [subprocess.run([*command, path], check=True, capture_output=True, text=True).stdout
                for command in commands]


def _sass(kernel) -> tuple[str, int]:
    """(disassembly, registers per thread) of a compiled kernel."""
    sass, usage = _on_cubin(kernel, [CUOBJDUMP, "-sass"], [CUOBJDUMP, "-res-usage"])
    return sass, int(re.search(r"REG:(\d+)", usage).group(1))


def _lines(sass: str) -> list[tuple[int, str]]:
    """(address, text) of each instruction of the disassembly."""
    return [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]


def _addressed(sass: str) -> list[tuple[int, str]]:
    """(address, opcode with modifiers) of each instruction of the disassembly, NOPs left out."""
    ops = [(a, t.split()[1] if t.startswith("@") else t.split()[0]) for a, t in _lines(sass)]
    return [(a, op) for a, op in ops if not op.startswith("NOP")]


def _source_name(file: str) -> str:
    """A source file as printed: its path within the lanekit package (layers/kernels/norm.py: the
    kernel packages' modules share names), else its base name. Any checkout's lanekit counts: a
    kernel's line table holds the path it was first compiled from, which Triton's cache keeps."""
    parts = os.path.abspath(file).split(os.sep)
    if "lanekit" in parts[:-1]:
        at = len(parts) - 1 - parts[::-1].index("lanekit")
        return "/".join(parts[at + 1:])
    return os.path.basename(file)


def _by_line(kernel, cold: set) -> list[tuple[str, int, collections.Counter]]:
    """(file name, line, opcode counts) of each source line's instructions outside the cold
    ranges, most instructions first: the disassembly with its line table (nvdisasm -g), where a
    `//## File "...", line N` comment heads the instructions compiled from line N. Instructions
    inlined from a helper count at the helper's line."""
    (text,) = _on_cubin(kernel, [NVDISASM, "-g", "-c"])
    # re.split with two groups: the text before the first marker, then (file, line, text) triples
    parts = re.split(r'//## File "([^"]+)", line (\d+).*', text)
    counts = collections.defaultdict(collections.Counter)
    for file, line, body in zip(parts[1::3], parts[2::3], parts[3::3]):
        counts[(_source_name(file), int(line))].update(op for a, op in _addressed(body) if a not in cold)
    return sorted(((f, n, c) for (f, n), c in counts.items() if c), key=lambda r: -sum(r[2].values()))


def _last_exit(lines: list[tuple[int, str]]) -> float:
    """The address of the kernel's last EXIT: the out-of-line slow paths come after it."""
    exits = [a for a, t in lines if t.split()[-1] == "EXIT" or t.startswith("EXIT")]
    return exits[-1] if exits else float("inf")


# a branch and its target address: predicated (@P0, @!UP1), with modifiers (.U, .DIV), with a
# predicate or register operand before the target (BRA.U !UP0, 0x...; BRA.DIV UR4, 0x...)
_BRANCH = re.compile(r"(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*|U?R\w+,\s*)?0x([0-9a-f]+)")


def _instructions(sass: str) -> list[str]:
    return [op for _, op in _addressed(sass)]


# Issue cost on sm90 relative to an fp32 add, from the CUDA C Programming Guide's throughput
# table for compute capability 9.0 (results per clock per SM: fp32 128; fp64, 32-bit integer
# add, shift, compare, logic and multiply 64; warp shuffle 32; conversions to or from 64-bit types
# and special functions 16): a crude model of a compute-bound kernel, the fp32 pipe counting 1.
_WEIGHTS = (("F2F.F64", 8), ("F2F.F32.F64", 8), ("I2F.F64", 8), ("MUFU", 8), ("SHFL", 4),
            ("DADD", 2), ("DMUL", 2), ("DFMA", 2), ("FADD", 1), ("FMUL", 1), ("FFMA", 1),
            ("FSEL", 1), ("HFMA2", 1), ("LDG", 1), ("STG", 1), ("LDS", 1), ("STS", 1), ("U", 0),
            ("BRA", 1), ("EXIT", 1), ("BAR", 1))


def _weight(op: str) -> int:
    """Issue slots of one instruction in fp32-add units (uniform-datapath U* ops are free: they
    run once per warp beside the vector pipes); integer and other ALU work counts 2."""
    for prefix, w in _WEIGHTS:
        if op.startswith(prefix):
            return w
    return 2


def _cold_ranges(sass: str) -> set[int]:
    """Addresses of the instructions that real inputs do not reach: those a conditional forward
    branch skips over a block of fp64 conversions or of clamps (the rare tiles of
    _qk_norm_rope_fwd_kernel: a row's max |u| or sum of squares outside [2^-100, 2^100), the tile
    redone with its scales in fp64 and its codes clamped), and those after the kernel's last EXIT."""
    lines = _lines(sass)
    cold = set()
    for addr, text in lines:
        m = _BRANCH.match(text)
        if not m or not text.startswith("@"):   # conditional branches only
            continue
        target = int(m.group(1), 16)
        inside = [(a, t) for a, t in lines if addr < a < target]
        conversions = sum(t.split()[0].startswith("F2F.F64") for _, t in inside)
        clamps = sum(t.startswith("FMNMX") and "|" not in t for _, t in inside)
        if target > addr and (conversions >= 8 or clamps >= 16):
            cold.update(a for a, t in inside if not t.startswith("NOP"))
    # after the last EXIT: the out-of-line slow paths (IEEE division and square root of
    # operands near the ends of their range, shuffles under divergence)
    cold.update(a for a, t in lines if a > _last_exit(lines) and not t.startswith("NOP"))
    return cold


class _Capture:
    """Replaces JITFunction.run: compile for TARGET, record, launch nothing."""

    def __init__(self):
        self.launches = []
        self.backend = make_backend(TARGET)
        self._run = triton_jit.JITFunction.run

    def __enter__(self):
        capture = self

        def run(fn, *args, grid, warmup, **kwargs):
            binder = triton_jit.create_function_from_signature(fn.signature, fn.params, capture.backend)
            bound, specialization, _ = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(capture.backend, kwargs, bound,
                                                                  specialization, None)
            kernel = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET,
                                    options=options.__dict__)
            capture.launches.append((fn.__name__, tuple(grid), dict(bound), kernel))

        triton_jit.JITFunction.run = run
        return self

    def __exit__(self, *exc):
        triton_jit.JITFunction.run = self._run


# opcodes that say what a loop iteration spends its instructions on
LOOP_WATCH = ("BAR", "LDGSTS", "LDGDEPBAR", "DEPBAR", "LDG", "LDS", "LDSM", "STS", "HMMA", "HGMMA", "WARPGROUP",
              "IMAD", "ISETP", "SEL", "LEA", "IADD3", "SHFL", "MUFU", "FMUL", "FFMA", "FADD", "FMNMX",
              "I2F", "F2F", "F2FP", "SHF", "LOP3", "PRMT", "HADD2", "HFMA2")


def _largest_loop(sass: str) -> dict | None:
    """The body of the largest loop (a backward branch and the instructions from its target to
    it, NOPs left out): its instruction count and the LOOP_WATCH opcodes in it; None without one.
    Branches after the kernel's last EXIT (out-of-line slow paths returning to the main body) are
    not loops."""
    lines, ops = _lines(sass), _addressed(sass)
    last_exit = _last_exit(lines)
    best = None
    for addr, text in lines:
        m = _BRANCH.match(text)
        if addr > last_exit or not m or int(m.group(1), 16) >= addr:
            continue
        body = [op for a, op in ops if int(m.group(1), 16) <= a <= addr]
        if best is None or len(body) > len(best):
            best = body
    if best is None:
        return None
    counts = collections.Counter(op.split(".")[0] for op in best)
    return dict(instructions=len(best), ops={k: counts[k] for k in LOOP_WATCH if counts[k]})


def _elements_per_thread(name: str, bound: dict, num_warps: int) -> float:
    """Elements (rows x features) one thread handles, from the launch's tile constexprs; NaN for a
    kernel without such a model (the decode kernel, which loops)."""
    if "BLOCK_H" in bound:   # the RoPE kernels: BLOCK_S * BLOCK_H rows of D
        return bound["BLOCK_S"] * bound["BLOCK_H"] * bound["D"] / (num_warps * 32)
    if name.startswith("_glu_"):   # the GLUs: BLOCK_N outputs a program
        return bound["BLOCK_N"] / (num_warps * 32)
    if name.startswith("_norm_") and bound.get("ONE_BLOCK", True):   # the norms: MOD_ROWS rows of N
        return bound.get("MOD_ROWS", 1) * bound["N"] / (num_warps * 32)
    return float("nan")


def _triton_lane_on_cpu():
    """The Triton lane for CPU tensors (whose launches _Capture catches), with the kernels compiled
    natively: they are imported before the lane check is told the process is interpreted, so they
    are decorated as native kernels, and their launchers, which bind triton_interpreted by name at
    import, keep the real check (False here) and take the GPU's tiles, not the interpreter's."""
    import lanekit.attention.kernels  # noqa: F401
    import lanekit.layers.kernels  # noqa: F401
    from lanekit.runtime import lanes

    lanes.triton_interpreted = lambda: True
    os.environ[lanes.LANE_ENV] = "triton"


def _launch(family, case, splits: int | None = None):
    """A function that makes the case's lanekit call on CPU tensors of the benchmark's shapes (a
    decode case with ``splits`` splits when given, else the CPU's heuristic's)."""
    inputs = family.make_inputs(case, device="cpu")
    if family in (gemm, gemm_4bit):    # (x, lanekit's kwargs)
        return family._lanekit(case, inputs[1])
    if family is decode:
        return decode.runners(case, *inputs, num_splits=splits)["lanekit"]
    return lambda: bench._lanekit(case)(*inputs)


def report(case: dict, dump: str | None = None, family=bench, splits: int | None = None,
           lines: int = 0) -> list[dict]:
    _triton_lane_on_cpu()
    call = _launch(family, case, splits)
    with tuning.compiling_for("sm90"), _Capture() as cap:   # sm90's tuning rows, as on the H200
        call()
    rows = []
    for i, (name, grid, bound, kernel) in enumerate(cap.launches):
        sass, regs = _sass(kernel)
        ops = _instructions(sass)
        counts = collections.Counter(op for op in ops for w in WATCH if op.startswith(w))
        per = _elements_per_thread(name, bound, kernel.metadata.num_warps)
        cold = _cold_ranges(sass)
        hot_ops = [op for addr, op in _addressed(sass) if addr not in cold]
        hot = len(hot_ops)
        weighted = sum(_weight(op) for op in hot_ops)
        rows.append(dict(kernel=name, grid=grid, regs=regs, shared=kernel.metadata.shared,
                         instructions=len(ops), hot=hot, per_element=len(ops) / per, hot_per_element=hot / per,
                         weighted_per_element=weighted / per,
                         watched=dict(sorted(counts.items())), loop=_largest_loop(sass),
                         lines=_by_line(kernel, cold)[:lines] if lines else [],
                         tile={k: bound[k] for k in ("BLOCK_M", "BLOCK_N") if k in bound}
                         | {"num_warps": kernel.metadata.num_warps, "num_stages": kernel.metadata.num_stages}))
        if dump:
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, f"{family.name(case).replace(' ', '_')}.{i}.{name}.sass"), "w") as f:
                f.write(sass)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="*", help="benchmarks.layers, decode, gemm or gemm_4bit case names, or for "
                                            "decode another of their form (default: the q-and-k ones and adaln)")
    p.add_argument("--dump", help="write each launch's SASS into this folder")
    p.add_argument("--splits", type=int, help="decode cases: this split count (default: the CPU's heuristic, 1)")
    p.add_argument("--lines", type=int, default=0, metavar="N",
                   help="the N source lines with the most instructions on the path taken, per launch")
    args = p.parse_args(argv)
    wanted = args.cases or ["rms_norm_rope q,k", "qk_norm_rope_quant e4m3", "adaln"]
    chosen, unknown = [], []
    for name in wanted:   # a bench case's name, or for decode another of its form (run.case_named)
        for family in (bench, decode, gemm, gemm_4bit):
            try:
                chosen.append((family, run.case_named(family, name)))
                break
            except ValueError:
                pass
        else:
            unknown.append(name)
    if unknown:
        p.error(f"unknown case(s) {sorted(unknown)}: expected names of benchmarks.layers, decode, gemm or gemm_4bit "
                "(or of the decode cases' form, e.g. 'decode Sk=32k paged 4')")
    for family, case in chosen:
        for r in report(case, args.dump, family, args.splits, args.lines):
            counts = f"{r['instructions']} SASS, {r['hot']} on the path taken"
            if not math.isnan(r["per_element"]):   # kernels with a model of the elements a thread holds
                counts += (f" ({r['per_element']:.1f} and {r['hot_per_element']:.1f} per element; "
                           f"{r['weighted_per_element']:.1f} fp32-add issue slots)")
            print(f"{family.name(case)}: {r['kernel']} grid {r['grid']}  {r['tile']}  {r['regs']} regs  "
                  f"{r['shared'] // 1024} KiB shared  {counts}  {r['watched']}")
            if r["loop"]:
                print(f"    largest loop: {r['loop']['instructions']} instructions an iteration  {r['loop']['ops']}")
            for file, line, ops in r["lines"]:
                print(f"    {sum(ops.values()):5d}  {file}:{line}  {dict(ops.most_common(4))}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
