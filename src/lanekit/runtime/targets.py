"""The GPU targets lanekit's kernels are written for, and their ahead-of-time compilation.

A target is named by its architecture id (see ``tuning.arch_id``). Triton compiles for a GPU that
is not present, so every target can be compiled for, and its assembly inspected, on a machine with
no GPU at all; that is how the AMD targets are kept honest.

What gets compiled are each kernel's *canonical specializations*: the launches that the registered
samples of the ops it is handed (``lanekit.export`` hands it every op of ``lanekit.families``) make
through the Triton lane, as the launcher configures them for that target (its tuning rows,
``tuning.compiling_for``). :func:`capture` runs the samples'
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

# Scratch (spill) bytes per thread a kernel may use on a target, unless its family allows more
# (each family's SPILL_ALLOWANCES in <family>/tuning.py, gathered by lanekit.families.allowances).
SPILL_BUDGET = 0


@dataclass(frozen=True)
class Allowances:
    """Where a kernel may depart from what every target requires, each with its reason, keyed by
    (kernel, target): ``spills`` -> (scratch bytes per thread, reason); ``matrix`` -> (a regular
    expression for another matrix instruction than the target's own, reason)."""

    spills: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict)
    matrix: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)

    def spill_budget(self, kernel: str, target: str) -> int:
        return self.spills.get((kernel, target), (SPILL_BUDGET, ""))[0]

    def matrix_pattern(self, kernel: str, target: str) -> str:
        return self.matrix.get((kernel, target), ("", ""))[0]


# Data types a target does not have: a specialization that needs one is "unsupported" there, not
# failing. target -> (text of the compiler's error, the reason).
UNSUPPORTED: dict[str, tuple[str, str]] = {
    "sm80": ("type fp8e4nv not supported in this architecture",
             "Ampere has no e4m3 type (Triton's fp8e4nv needs sm89 or newer): the e4m3 KV cache and "
             "quantization paths are for sm89+ and AMD"),
}
# More of the same, where a target has the type but not the instructions a kernel needs.
UNSUPPORTED_ALSO: dict[str, tuple[str, str]] = {
    "sm80": ("Feature 'cvt with .e4m3x2/.e5m2x2' requires .target sm_89",
             "Ampere has no fp8 conversions (cvt .e5m2x2 needs sm89): fp8 attention, which rounds P "
             "to V's fp8 format, is for sm89+ and AMD; int8 attention runs on sm80"),
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
    # what the kernel's family allows it on this target (Allowances)
    spill_budget: int = field(default=SPILL_BUDGET, compare=False)
    matrix_allowance: str = field(default="", compare=False)

    @property
    def key(self) -> str:
        """A short stable id of this specialization: the kernel's name and a hash of the rest."""
        text = json.dumps([self.signature, self.constexprs, self.attrs, self.options], sort_keys=True)
        return f"{self.kernel}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"

    @property
    def fingerprint(self) -> str:
        """A hash of everything compiling this specialization and judging its report read: the
        Triton release, the kernel's source and that of every function it calls with the global
        constants they read (Triton's own ``JITFunction.cache_key``, the key of its compile
        cache), this specialization's key and compile options, the family's allowances on the
        target, and this module (the targets, how a report is read and judged). Equal
        fingerprints give equal reports: ``lanekit targets`` compiles again only what changed."""
        from importlib import metadata

        options = {k: v for k, v in self.compile_options.items() if k != "extern_libs"}  # paths of this venv
        text = json.dumps([metadata.version("triton"), self.fn.cache_key if self.fn is not None else None,
                           self.key, self.target, _jsonable(sorted(options.items())), self.spill_budget,
                           self.matrix_allowance, _MODULE_HASH], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def manifest(self) -> dict:
        return {"name": self.kernel, "module": self.module, "key": self.key, "target": self.target,
                "signature": self.signature, "constexprs": self.constexprs, "attrs": self.attrs,
                "num_warps": self.options["num_warps"], "num_stages": self.options["num_stages"],
                "options": self.options, "samples": self.samples}


# This module's own text, in every fingerprint: the targets, and how a report is read and judged.
with open(__file__, "rb") as _f:
    _MODULE_HASH = hashlib.sha256(_f.read()).hexdigest()

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


def capture(target: str, ops: Iterable, allowances: Allowances | None = None) -> list[Specialization]:
    """The distinct specializations that the registered samples of ``ops`` (``Op`` objects: those
    with a Triton lane) launch when compiled for ``target``, in first-launch order; each carries
    its kernel's allowances on that target."""
    from lanekit.runtime import tuning
    from lanekit.runtime.lanes import triton_interpreted

    if triton_interpreted():
        raise RuntimeError("capturing launches needs compiled kernels, but this process runs Triton "
                           "interpreted (TRITON_INTERPRET=1); run `lanekit export` in a process "
                           "without it")
    allowances = allowances or Allowances()
    spec_target = get_target(target)
    chosen = list(ops)
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
            spill_budget=allowances.spill_budget(fn.__name__, target),
            matrix_allowance=allowances.matrix_pattern(fn.__name__, target),
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
    its family's allowances accept). ``problems``: why the target fails, empty when it passes.
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
        for lacking, reason in (UNSUPPORTED.get(spec.target, (None, "")), UNSUPPORTED_ALSO.get(spec.target, (None, ""))):
            if lacking is not None and lacking in message:
                return None, Report(spec.key, spec.kernel, spec.target, False, unsupported=reason)
        return None, Report(spec.key, spec.kernel, spec.target, False,
                            problems=[f"does not compile: {type(e).__name__}: {message[:300]}"])
    return kernel, read_report(kernel, target, spec.key, spec.kernel, spec.matrix_allowance, spec.spill_budget)


def read_report(kernel, target: Target, key: str, name: str, matrix_allowance: str = "",
                spill_budget: int = SPILL_BUDGET) -> Report:
    """The :class:`Report` of a CompiledKernel, its assembly read as ``target``'s; the kernel may
    also use the matrix instructions ``matrix_allowance`` matches, and spill ``spill_budget``
    bytes per thread."""
    report = Report(key, name, target.name, True, shared=kernel.metadata.shared)
    isa = kernel.asm[target.isa]
    if "cubin" in kernel.asm:
        report.registers, report.scratch = _cubin_resources(kernel.asm["cubin"])
    else:
        report.registers, report.sgprs, report.scratch = _amdgcn_resources(isa)
    report.dot = _matrix_operand(kernel.asm["ttir"])
    patterns = [target.matrix] + ([matrix_allowance] if matrix_allowance else [])
    report.matrix = sorted({m for p in patterns for m in re.findall(p, isa)})
    report.problems = judge(report, target, spill_budget)
    return report


def judge(report: Report, target: Target, spill_budget: int = SPILL_BUDGET) -> list[str]:
    """Why ``report`` fails ``target``: missing matrix instructions, too much shared memory, spills
    over ``spill_budget`` bytes per thread."""
    problems = []
    if report.dot and not report.matrix:
        problems.append(f"multiplies {report.dot} matrices without {target.matrix_name} instructions")
    if report.shared > target.max_shared:
        problems.append(f"needs {report.shared} bytes of shared memory, over {target.name}'s "
                        f"{target.max_shared}")
    if report.scratch > spill_budget:
        problems.append(f"spills {report.scratch} bytes per thread to scratch (budget {spill_budget})")
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
