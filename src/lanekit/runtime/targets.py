"""The GPU targets lanekit's kernels are written for, and their ahead-of-time compilation.

A target is named by its architecture id (see ``tuning.arch_id``). Triton compiles for a GPU that
is not present, so every target can be compiled for, and its assembly inspected, on a machine with
no GPU at all; that is how the AMD targets are kept honest.

What gets compiled are each kernel's *canonical specializations*: the launches that the registered
samples of every op (``lanekit.ops``) make through the Triton lane, as the launcher configures them
for that target (its tuning rows, ``tuning.compiling_for``). :func:`capture` runs the samples'
host code with every kernel launch intercepted: instead of launching, Triton's own binder computes
the specialization a real launch would compile (argument types, constexprs, the divisibility of
pointers and integers), and it is recorded. :func:`compile_spec` then compiles one specialization
for one target and reads the compiler's resource report (registers, shared memory or LDS, scratch
spills) and the matrix instructions in the assembly.

Capture needs kernels that are compiled, not interpreted: it refuses to run in a process where
``TRITON_INTERPRET=1`` was set (``lanekit export`` and ``lanekit targets`` run in their own).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Iterable

# NVIDIA Ampere and Hopper; AMD CDNA 3 (MI300), RDNA 3.5 (Strix Halo), RDNA 4.
TARGETS: tuple[str, ...] = ("sm80", "sm90", "gfx942", "gfx1151", "gfx1201")

# Scratch (spill) bytes per thread a kernel may use on a target: 0, except for the entries below,
# each with its reason. Keyed by (kernel, target); the value is (bytes, reason).
SPILL_BUDGET = 0
_RDNA_FP32_D256 = ("fp32 at D=256: the q tile and the accumulator (block_m x 256 fp32 each) beside the k "
                   "and v operands exceed wave32's 256 VGPRs at every tile down to 16x16 "
                   "(benchmarks.tune_targets --sweep attn_fwd_fp32); fp32 at D=128 and the 16-bit forward "
                   "do not spill")
_RDNA_DKDV = ("dK and dV (block_n x D fp32 each) stay in registers beside the k and v operands: above D=64, "
              "and in fp32, that exceeds wave32's 256 VGPRs at every tile down to 16x16 "
              "(benchmarks.tune_targets --sweep attn_bwd_dkdv); the rows take the tile that spills least")
_RDNA_DQ_FP32 = ("fp32 at D=256: dQ and the q tile (block_m x 256 fp32 each) beside the k and v operands exceed "
                 "wave32's 256 VGPRs at every tile down to 16x16 (benchmarks.tune_targets --sweep "
                 "attn_bwd_dq_fp32)")
_RDNA_KVCACHE = ("fp32 at D=128 (its one fp32 sample): every candidate tile spills on wave32, 16 keys a step with "
                 "8 warps least (benchmarks.tune_targets --sweep attn_kvcache); the 16-bit paths do not spill")
_NVIDIA_UNCOUNTED = ("spills that ptxas reports as STACK, which the record read as 0 until 2026-12-02 (it "
                     "read LOCAL only): found then, not yet tuned away; ")
_NVIDIA_OTHERS = _NVIDIA_UNCOUNTED + "the worst are a bias with a mask at D=111 and the backward at odd head dims"
_NVIDIA_FWD = _NVIDIA_UNCOUNTED + ("the worst is a bias with a mask at D=111 (on sm80 ptxas falls to 32 registers "
                                   "and 7 KB of stack with the 16-bit D=128 row); fp32 at D=64, 128 and 256 has "
                                   "rows of its own since (tuning.FLASH_ATTN_FWD_FP32: 584 bytes at most, sm90's D=128 "
                                   "row, the fastest timed)")
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {
    **{(kernel, rdna): (limit, why) for rdna in ("gfx1151", "gfx1201") for kernel, limit, why in (
        ("_flash_attn_fwd_kernel", 796, _RDNA_FP32_D256),
        ("_flash_attn_bwd_dkdv_kernel", 2608, _RDNA_DKDV),
        ("_flash_attn_bwd_dq_kernel", 2556, _RDNA_DQ_FP32),
    )},
    ("_flash_attn_kvcache_kernel", "gfx1151"): (168, _RDNA_KVCACHE),
    ("_flash_attn_kvcache_kernel", "gfx1201"): (36, _RDNA_KVCACHE),
    # NVIDIA: the spills there since before the record counted them (largest per kernel; the
    # record itself pins each specialization's figure, so any change still fails --check)
    ("_flash_attn_fwd_kernel", "sm80"): (7336, _NVIDIA_FWD),
    ("_flash_attn_fwd_kernel", "sm90"): (2088, _NVIDIA_FWD),
    **{(kernel, target): (limit, _NVIDIA_OTHERS) for kernel, target, limit in (
        ("_flash_attn_bwd_dkdv_kernel", "sm80", 976), ("_flash_attn_bwd_dkdv_kernel", "sm90", 2112),
        ("_flash_attn_bwd_dq_kernel", "sm80", 656), ("_flash_attn_bwd_dq_kernel", "sm90", 1416),
        ("_gru_cell_fwd_kernel", "sm80", 72), ("_gru_cell_fwd_kernel", "sm90", 280),
        ("_lstm_cell_fwd_kernel", "sm80", 96), ("_lstm_cell_fwd_kernel", "sm90", 472),
        ("_norm_bwd_kernel", "sm80", 112), ("_norm_bwd_kernel", "sm90", 128),
        ("_rms_norm_rope_bwd_kernel", "sm80", 24), ("_rms_norm_rope_bwd_kernel", "sm90", 24),
    )},
}

# Where a kernel may use another matrix instruction than the target's own: (kernel, target) ->
# (a regular expression for it, the reason).
_SMALL_BATCH = ("its batch tiles for B <= 32 (16 and 32 rows) are under wgmma's 64 rows per warpgroup, "
                "so Triton uses Ampere's mma.sync there, still on the tensor cores")
_DECODE_ROWS = ("decode and short appends (Sq x group <= 16 rows of (query, head) pairs) take a 16-row tile, "
                "under wgmma's 64 rows per warpgroup, so Triton uses mma.sync there, still on the tensor cores")
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {
    **{(kernel, "sm90"): (r"\bmma\.sync\.aligned\.\S+", _SMALL_BATCH)
       for kernel in ("_lstm_cell_fwd_kernel", "_gru_cell_fwd_kernel", "_rnn_cell_fwd_kernel")},
    ("_flash_attn_kvcache_kernel", "sm90"): (r"\bmma\.sync\.aligned\.\S+", _DECODE_ROWS),
}

# Data types a target does not have: a specialization that needs one is "unsupported" there, not
# failing. target -> (text of the compiler's error, the reason).
UNSUPPORTED: dict[str, tuple[str, str]] = {
    "sm80": ("type fp8e4nv not supported in this architecture",
             "Ampere has no e4m3 type (Triton's fp8e4nv needs sm89 or newer): the e4m3 KV cache and "
             "quantization paths are for sm89+ and AMD"),
}


@dataclass(frozen=True)
class Target:
    """One GPU architecture: how Triton names it, and what its kernels must show.

    ``matrix``: a regular expression for the target's matrix instructions in ``isa`` (PTX on
    NVIDIA, where ptxas cannot drop them; AMDGCN on AMD). ``max_shared``: shared memory (LDS) one
    program may use, in bytes.
    """

    name: str
    backend: str          # "cuda" or "hip"
    arch: int | str       # 80, 90, "gfx942", ...
    warp_size: int
    matrix: str
    matrix_name: str
    isa: str              # the key of the assembly text in CompiledKernel.asm
    binary: str           # the key of the binary: "cubin" or "hsaco"
    max_shared: int

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


_KIB = 1024
GPU_TARGETS: dict[str, Target] = {
    # sm80: A100's 163 KiB of shared memory per block (opt-in); sm90: H100/H200's 227 KiB.
    "sm80": Target("sm80", "cuda", 80, 32, r"\bmma\.sync\.aligned\.\S+", "mma", "ptx", "cubin", 163 * _KIB),
    "sm90": Target("sm90", "cuda", 90, 32, r"\bwgmma\.mma_async\.\S+", "wgmma", "ptx", "cubin", 227 * _KIB),
    # CDNA 3: wave64, MFMA, 64 KiB of LDS per workgroup.
    "gfx942": Target("gfx942", "hip", "gfx942", 64, r"\bv_mfma_\w+", "v_mfma", "amdgcn", "hsaco", 64 * _KIB),
    # RDNA 3.5 and RDNA 4: wave32, WMMA, 64 KiB of LDS per workgroup.
    "gfx1151": Target("gfx1151", "hip", "gfx1151", 32, r"\bv_wmma_\w+", "v_wmma", "amdgcn", "hsaco", 64 * _KIB),
    "gfx1201": Target("gfx1201", "hip", "gfx1201", 32, r"\bv_wmma_\w+", "v_wmma", "amdgcn", "hsaco", 64 * _KIB),
}
assert tuple(GPU_TARGETS) == TARGETS

# Dot operand types that every target multiplies with its matrix instructions. An fp32 dot is not
# held to the check: RDNA has no fp32 WMMA, and fp32 is chosen for accuracy, not speed.
MATRIX_DTYPES = ("f16", "bf16", "f8E4M3FN", "f8E5M2", "i8")


def get_target(name: str) -> Target:
    if name not in GPU_TARGETS:
        raise ValueError(f"target: expected one of {list(TARGETS)}, got {name!r}")
    return GPU_TARGETS[name]


@dataclass
class Specialization:
    """One compiled form of one kernel, as a launch specializes it for one target.

    ``signature``: parameter name -> Triton type ("*fp16", "i32", "constexpr", ...);
    ``constexprs``: parameter name -> value, for the constexpr parameters and the integers Triton
    specializes to constants (1, None); ``attrs``: parameter name -> attributes such as
    ``[["tt.divisibility", 16]]``; ``options``: num_warps, num_stages and any other compile option
    the launcher passed (waves_per_eu, enable_fp_fusion). ``samples``: "op: sample" for each
    registered sample that launches it.
    """

    kernel: str
    module: str
    target: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    samples: list[str] = field(default_factory=list)
    fn: object = field(default=None, repr=False, compare=False)
    # (signature, constexprs, attrs) keyed as Triton keys them, and Triton's compile options
    triton_args: tuple = field(default=(), repr=False, compare=False)
    compile_options: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def key(self) -> str:
        """A short stable id of this specialization: the kernel's name and a hash of the rest."""
        text = json.dumps([self.signature, self.constexprs, self.attrs, self.options], sort_keys=True)
        return f"{self.kernel}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"

    def manifest(self) -> dict:
        return {"name": self.kernel, "module": self.module, "key": self.key, "target": self.target,
                "signature": self.signature, "constexprs": self.constexprs, "attrs": self.attrs,
                "num_warps": self.options["num_warps"], "num_stages": self.options["num_stages"],
                "options": self.options, "samples": self.samples}


# The compile options a specialization records beside warps and stages, when the launcher set them.
_RECORDED_OPTIONS = ("waves_per_eu", "enable_fp_fusion", "matrix_instr_nonkdim", "maxnreg")


def _jsonable(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


@contextlib.contextmanager
def _intercepted_launches(target: Target, record):
    """Within this block a kernel launch ``kernel[grid](...)`` computes the specialization that
    Triton would compile for ``target`` and passes it to ``record`` instead of launching."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(target.gpu_target())
    binders = {}

    def run(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        if id(self) not in binders:
            binders[id(self)] = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binders[id(self)](*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        record(self, signature, constexprs, attrs, options, kwargs)
        return None

    original = JITFunction.run
    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original


def capture(target: str, ops: Iterable[str] | None = None) -> list[Specialization]:
    """The distinct specializations that the registered samples of ``ops`` (default: every op with
    a Triton lane) launch when compiled for ``target``, in first-launch order."""
    from lanekit.runtime import tuning
    from lanekit.runtime.lanes import get_op, registry, triton_interpreted

    if triton_interpreted():
        raise RuntimeError("capturing launches needs compiled kernels, but this process runs Triton "
                           "interpreted (TRITON_INTERPRET=1); run `lanekit export` in a process "
                           "without it")
    spec_target = get_target(target)
    chosen = [get_op(name) for name in ops] if ops is not None else list(registry().values())
    found: dict[str, Specialization] = {}
    current = [""]

    def record(fn, signature, constexprs, attrs, options, kwargs):
        names = [p.name for p in fn.params]
        spec = Specialization(
            kernel=fn.__name__, module=fn.module, target=target,
            signature={k: _jsonable(v) for k, v in signature.items()},
            constexprs={names[path[0]]: _jsonable(v) for path, v in constexprs.items()},
            attrs={names[path[0]]: _jsonable(v) for path, v in attrs.items()},
            options={"num_warps": options.num_warps, "num_stages": options.num_stages,
                     **{k: kwargs[k] for k in _RECORDED_OPTIONS if k in kwargs}},
            fn=fn, triton_args=(signature, constexprs, attrs), compile_options=dict(options.__dict__),
        )
        spec = found.setdefault(spec.key, spec)
        if current[0] not in spec.samples:
            spec.samples.append(current[0])

    with tuning.compiling_for(target), _intercepted_launches(spec_target, record):
        for op in chosen:
            if "triton" not in op.lanes:
                continue
            lane = op.lane("triton")
            for sample in op.samples("cpu"):
                current[0] = f"{op.name}: {sample.name}"
                lane(**sample.kwargs)
    return list(found.values())


@dataclass
class Report:
    """What compiling one specialization for one target gave.

    ``registers``: per thread (VGPRs on AMD, AGPRs included); ``shared``: bytes of shared memory
    (LDS) per program; ``scratch``: bytes of spill (local / private) memory per thread; ``dot``:
    the kernel multiplies matrices with operands of a type the target's matrix unit takes;
    ``matrix``: the distinct matrix instructions found (the target's, or those an entry of
    MATRIX_ALLOWANCES accepts). ``problems``: why the target fails, empty when it passes.
    """

    key: str
    kernel: str
    target: str
    compiled: bool
    registers: int = 0
    sgprs: int = 0
    shared: int = 0
    scratch: int = 0
    dot: str = ""            # the dot's operand type when it needs the matrix unit, else ""
    matrix: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unsupported: str = ""    # why the target cannot run it (UNSUPPORTED), when it cannot

    @property
    def ok(self) -> bool:
        return not self.problems


def compile_spec(spec: Specialization):
    """Compile ``spec`` for its target: (the CompiledKernel or None, its :class:`Report`)."""
    import triton
    from triton.compiler import ASTSource

    target = get_target(spec.target)
    signature, constexprs, attrs = spec.triton_args
    try:
        kernel = triton.compile(ASTSource(spec.fn, signature, constexprs, attrs),
                                target=target.gpu_target(), options=spec.compile_options)
    except Exception as e:  # the compiler's own message is the report
        message = " ".join(str(e).split())
        lacking, reason = UNSUPPORTED.get(spec.target, (None, ""))
        if lacking is not None and lacking in message:
            return None, Report(spec.key, spec.kernel, spec.target, False, unsupported=reason)
        return None, Report(spec.key, spec.kernel, spec.target, False,
                            problems=[f"does not compile: {type(e).__name__}: {message[:300]}"])
    return kernel, read_report(kernel, target, spec.key, spec.kernel)


def read_report(kernel, target: Target, key: str, name: str) -> Report:
    """The :class:`Report` of a CompiledKernel, its assembly read as ``target``'s."""
    report = Report(key, name, target.name, True, shared=kernel.metadata.shared)
    isa = kernel.asm[target.isa]
    if "cubin" in kernel.asm:
        report.registers, report.scratch = _cubin_resources(kernel.asm["cubin"])
    else:
        report.registers, report.sgprs, report.scratch = _amdgcn_resources(isa)
    report.dot = _matrix_operand(kernel.asm["ttir"])
    patterns = [target.matrix]
    if (name, target.name) in MATRIX_ALLOWANCES:
        patterns.append(MATRIX_ALLOWANCES[name, target.name][0])
    report.matrix = sorted({m for p in patterns for m in re.findall(p, isa)})
    report.problems = judge(report, target)
    return report


def judge(report: Report, target: Target) -> list[str]:
    """Why ``report`` fails ``target``: missing matrix instructions, too much shared memory, spills."""
    problems = []
    if report.dot and not report.matrix:
        problems.append(f"multiplies {report.dot} matrices without {target.matrix_name} instructions")
    if report.shared > target.max_shared:
        problems.append(f"needs {report.shared} bytes of shared memory, over {target.name}'s "
                        f"{target.max_shared}")
    budget = SPILL_ALLOWANCES.get((report.kernel, target.name), (SPILL_BUDGET, ""))[0]
    if report.scratch > budget:
        problems.append(f"spills {report.scratch} bytes per thread to scratch (budget {budget})")
    return problems


def _matrix_operand(ttir: str) -> str:
    """The operand type of the kernel's first ``tt.dot`` that the matrix unit takes, else ""."""
    for line in ttir.splitlines():
        if "tt.dot " in line:
            operand = re.search(r":\s*tensor<(?:\d+x)+(\w+)", line)
            if operand and operand.group(1) in MATRIX_DTYPES:
                return operand.group(1)
    return ""


def _amdgcn_resources(amdgcn: str) -> tuple[int, int, int]:
    """(VGPRs + AGPRs, SGPRs, scratch bytes per work-item) from the AMDGCN metadata."""
    def field_(name):
        found = re.search(rf"^\s*\.{name}:\s*(\d+)", amdgcn, flags=re.MULTILINE)
        return int(found.group(1)) if found else 0
    return (field_("vgpr_count") + field_("agpr_count"), field_("sgpr_count"),
            field_("private_segment_fixed_size"))


def _cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers, spill bytes per thread) from ``cuobjdump -res-usage``, bundled with Triton: its
    STACK (the stack frame, where ptxas spills registers) plus LOCAL (local arrays)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    spill = sum(int(m.group(1)) for m in re.finditer(r"(?:STACK|LOCAL):(\d+)", out))
    return int(regs.group(1)) if regs else 0, spill
