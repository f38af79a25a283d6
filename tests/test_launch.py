"""lanekit.runtime.launch: a launch whose specialization was seen before calls the compiled
kernel's launcher directly, every parameter in order; anything that could change Triton's
specialization takes Triton's own path again.

The shortcut only runs on an NVIDIA GPU, so here Triton's JITFunction.run and the compiled kernel
are stand-ins that record what they were given (on the GPU every native test goes through it)."""

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from lanekit.runtime import launch as launch_mod


def _kernel_fn(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):
    pass


class _Compiled:
    function = "function"
    packed_metadata = "packed"

    def __init__(self, launched):
        self.launched = launched

    @property
    def run(self):
        return lambda *args: self.launched.append(args)


@pytest.fixture
def kernel(monkeypatch):
    """A JITFunction whose Triton launch is recorded: (slow, fast) lists of calls."""
    k = JITFunction(_kernel_fn)
    slow, fast = [], []
    compiled = _Compiled(fast)

    def run(*args, grid, warmup, **kwargs):
        slow.append((grid, args, kwargs))
        return compiled

    k.run = run
    monkeypatch.setattr(launch_mod, "_device_and_stream", lambda driver: (0, "stream"))
    monkeypatch.setattr(launch_mod, "_JIT", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("LANEKIT_FAST_LAUNCH", "1")
    return k, slow, fast


def test_a_repeated_launch_calls_the_compiled_kernel_with_every_parameter(kernel):
    k, slow, fast = kernel
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    launch_mod.launch(k, (3, 2), x, y, 7, 0.5, BLOCK=16, num_warps=4)
    assert len(slow) == 1 and not fast
    assert slow[0] == ((3, 2), (x, y, 7, 0.5), {"BLOCK": 16, "num_warps": 4})
    launch_mod.launch(k, (3, 2), x, y, 7, 0.5, BLOCK=16, num_warps=4)
    assert len(slow) == 1
    # grid padded to three, the stream, the handles, no launch metadata or hooks, then every
    # parameter in the kernel's order, the default of FLAG included (num_warps is an option)
    assert fast == [(3, 2, 1, "stream", "function", "packed", None, None, None, x, y, 7, 0.5, 16, True)]


@pytest.mark.parametrize("change", ["misaligned pointer", "dtype", "int value", "int as bool", "constexpr",
                                    "option", "float value"])
def test_what_could_change_the_specialization_takes_tritons_path(kernel, change):
    k, slow, fast = kernel
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    args, kwargs = [x, y, 7, 0.5], {"BLOCK": 16, "num_warps": 4}
    launch_mod.launch(k, (1,), *args, **kwargs)
    if change == "misaligned pointer":
        args[0] = x[1:]
    elif change == "dtype":
        args[1] = y.to(torch.int64)
    elif change == "int value":
        args[2] = 8
    elif change == "int as bool":
        args[2], kwargs["BLOCK"] = 1, 16
        launch_mod.launch(k, (1,), *args, **kwargs)
        args[2] = True
    elif change == "constexpr":
        kwargs["FLAG"] = False
    elif change == "option":
        kwargs["num_warps"] = 8
    else:
        args[3] = 0.25
    before = len(slow)
    launch_mod.launch(k, (1,), *args, **kwargs)
    assert len(slow) == before + 1 and not fast


def test_hooks_and_patched_launches_take_tritons_path(kernel, monkeypatch):
    from triton import knobs

    k, slow, fast = kernel
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    launch_mod.launch(k, (1,), x, y, 7, 0.5, BLOCK=16)
    monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [lambda *a: None])
    launch_mod.launch(k, (1,), x, y, 7, 0.5, BLOCK=16)
    assert len(slow) == 2 and not fast
    monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [])
    monkeypatch.setattr(JITFunction, "run", lambda *a, **kw: None)   # as lanekit export intercepts
    launch_mod.launch(k, (1,), x, y, 7, 0.5, BLOCK=16)
    assert len(slow) == 3 and not fast


def test_the_interpreter_launches_as_written(device):
    """Under the interpreter (no GPU) a kernel is no JITFunction: launch is kernel[grid](...)."""
    from lanekit import layers

    if device != "cpu":
        pytest.skip("the interpreter's case")
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    y = layers.rms_norm(x, None, lane="triton")
    torch.testing.assert_close(y.float(), torch.nn.functional.rms_norm(x.float(), (40,), eps=1e-6),
                               atol=1e-2, rtol=1e-2)


def test_a_first_launch_inside_an_interception_is_not_taken_for_tritons_own(kernel, monkeypatch):
    """lanekit export replaces JITFunction.run before any launch: launch must not remember the
    replacement as Triton's run (it would then skip the interception's record)."""
    k, slow, fast = kernel

    def intercepted(self, *args, grid, warmup, **kwargs):
        return None

    monkeypatch.setattr(JITFunction, "run", intercepted)
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    for _ in range(2):
        launch_mod.launch(k, (1,), x, y, 7, 0.5, BLOCK=16)
    assert len(slow) == 2 and not fast and launch_mod._JIT is None


def test_lanekit_fast_launch_0_sends_every_launch_through_tritons_path(kernel, monkeypatch):
    k, slow, fast = kernel
    monkeypatch.setenv("LANEKIT_FAST_LAUNCH", "0")
    x = torch.empty(4)
    for _ in range(3):
        launch_mod.launch(k, (1,), x, x, 3, 0.5, BLOCK=16)
    assert len(slow) == 3 and not fast


def test_the_shortcut_is_on_by_default(kernel, monkeypatch):
    k, slow, fast = kernel
    monkeypatch.delenv("LANEKIT_FAST_LAUNCH")
    x = torch.empty(4)
    for _ in range(3):
        launch_mod.launch(k, (1,), x, x, 3, 0.5, BLOCK=16)
    assert len(slow) == 1 and len(fast) == 2
