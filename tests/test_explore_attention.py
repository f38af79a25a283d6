"""benchmarks.explore_attention_sm90 times its kernel variants on an sm90 GPU only: their math is
checked here first, under Triton's interpreter, against PyTorch's SDPA at a tiny shape."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from benchmarks import explore_attention_sm90 as explore
from lanekit.runtime.interpreter import fix_interpreter
from lanekit.runtime.lanes import triton_interpreted
from lanekit.testing import poisoned_outputs

# one variant of each design: pointer loads, descriptor loads, descriptors and warp specialization
NAMES = ("ptr 128x64 w8 s3", "tma 128x64 w8 s3", "tma+ws 128x64 w4 s3")


@pytest.mark.skipif(not triton_interpreted(), reason="the timed run is the GPU's; this checks the math interpreted")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", NAMES)
def test_each_design_computes_attention(name, causal):
    fix_interpreter()   # bf16 decoding, as lanekit's own kernel modules do
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=g).bfloat16() for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    with poisoned_outputs():     # a row the kernel leaves unwritten is NaN
        got = explore.run(explore.VARIANTS[name], q, k, v, causal)
    assert (got.double() - want).abs().max() < 1e-2       # bf16 output: 2^-8 relative, |out| < 1


def test_variants_are_well_formed():
    for bm, bn, tma, ws, warps, stages in explore.VARIANTS.values():
        assert 256 % bm == 0 and 256 % bn == 0 and (warps == 4 or not ws) and (tma or not ws)


@pytest.mark.parametrize("name", ["gluon pipelined 128x128 w8 s2", "gluon ws 128x128 w8 s2"])
def test_the_gluon_designs_compile_for_sm90_without_spilling(name):
    """The Gluon candidates cannot run here (Gluon has no interpreter): they are kept compiling for
    Hopper, with TMA copies, wgmma and (warp-specialized) setmaxnreg in their PTX."""
    glu = pytest.importorskip("benchmarks.explore_attention_gluon", reason="this Triton has no Gluon")
    design = glu.DESIGNS[name]
    # compiled in a process of its own without TRITON_INTERPRET: with it set, the Triton library
    # functions a Gluon kernel calls (gl.max, gl.sum) are interpreted ones, which it cannot compile
    # (a warm Triton cache hid that; a cold one, as in CI, does not)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; from benchmarks import explore_attention_gluon as g; "
            "print(json.dumps(g.compile_for_sm90(128, True, g.DESIGNS[sys.argv[1]])))")
    done = subprocess.run([sys.executable, "-c", code, name], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in r, r
    assert r["smem"] <= explore.SMEM_LIMIT and r["spills"] == 0 and r["tma"] > 0 and r["wgmma"] > 0
    assert (r["setmaxnreg"] > 0) == design[4] and r["warps"] == design[3] + 4 * design[4]
