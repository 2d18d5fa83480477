"""Which way ``fast_launch.Launcher`` sends a launch: Triton's own or the compiled kernel's C launcher.

The launch itself can only run on CUDA (``tests/gpu/test_zero_rows_all.py``
zeroes 40 steps through it against a naive reference and checks that it was
taken). Here a stand-in for Triton's ``JITFunction`` records what each way is
handed: a layout's first launch goes Triton's way and keeps its compiled
kernel; a later launch with the same key hands the C launcher exactly what
Triton's own launch would (grid, stream, function, packed metadata, no hooks,
every argument); a new key, a registered launch hook, or a kernel that is not
a ``JITFunction`` (Triton's interpreter) goes Triton's way.
"""

import pytest

triton = pytest.importorskip("triton")

from triton.knobs import HookChain  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from gdn_pass.kernels import fast_launch  # noqa: E402
from gdn_pass.kernels.fast_launch import Launcher  # noqa: E402

STREAM = 1234


class Compiled:
    """What Triton's launch returns: a compiled kernel whose ``run`` is the C launcher."""

    function, packed_metadata = "cufunction", ("packed",)

    def __init__(self):
        self.c_launches = []

    def run(self, *call):
        self.c_launches.append(call)


class FakeJIT(JITFunction):
    """A ``JITFunction`` that compiles nothing: ``kernel[grid](*args)`` records and returns one kernel."""

    def __init__(self):  # noqa: D107 - no Triton source to parse
        self.compiled = Compiled()
        self.triton_launches = []

    def __getitem__(self, grid):
        return lambda *args: self.triton_launches.append((grid, args)) or self.compiled


@pytest.fixture
def hooks(monkeypatch):
    """Triton's launch-hook chains, as Triton 3.6+ keeps them (empty), and a fixed stream."""
    knobs = type("Runtime", (), {})()
    knobs.launch_enter_hook, knobs.launch_exit_hook = HookChain(), HookChain(reversed=True)

    def bind():
        monkeypatch.setattr(fast_launch, "_knobs", knobs)
        monkeypatch.setattr(fast_launch, "_current_stream", lambda: STREAM)

    monkeypatch.setattr(fast_launch, "_bind_triton", bind)
    return knobs


def test_a_layouts_first_launch_compiles_through_triton_the_next_go_to_the_c_launcher(hooks):
    kernel = FakeJIT()
    launch = Launcher(kernel)
    launch((132, 1, 1), ("int32", True), "table", "slots", 7, 16, 1024)
    assert kernel.triton_launches == [((132, 1, 1), ("table", "slots", 7, 16, 1024))]
    assert kernel.compiled.c_launches == []
    launch((132, 1, 1), ("int32", True), "table", "other slots", 9, 16, 1024)
    assert len(kernel.triton_launches) == 1
    assert kernel.compiled.c_launches == [
        (132, 1, 1, STREAM, "cufunction", ("packed",), None, None, None, "table", "other slots", 9, 16, 1024)]
    assert (launch.triton_launches, launch.fast_launches) == (1, 1)


def test_a_new_key_compiles_again(hooks):
    kernel = FakeJIT()
    launch = Launcher(kernel)
    launch((4, 1, 1), ("int32", True), "a")
    launch((4, 1, 1), ("int32", False), "a")  # say, a slot column whose address is not 16-byte aligned
    assert len(kernel.triton_launches) == 2 and kernel.compiled.c_launches == []


@pytest.mark.parametrize("chain", ["launch_enter_hook", "launch_exit_hook"])
def test_a_registered_launch_hook_sends_every_launch_triton_s_way(hooks, chain):
    """A profiler (Proton) reads the launch metadata Triton's own launch builds for its hooks."""
    kernel = FakeJIT()
    launch = Launcher(kernel)
    launch((4, 1, 1), "key", "a")
    getattr(hooks, chain).add(print)
    launch((4, 1, 1), "key", "a")
    assert len(kernel.triton_launches) == 2 and kernel.compiled.c_launches == []
    getattr(hooks, chain).remove(print)
    launch((4, 1, 1), "key", "a")
    assert len(kernel.compiled.c_launches) == 1


def test_a_kernel_that_is_not_a_jit_function_always_goes_triton_s_way(hooks):
    """Triton's interpreter (``TRITON_INTERPRET=1``) decorates kernels with another class."""
    kernel = FakeJIT()
    interpreted = type("InterpretedFunction", (), {"__getitem__": lambda self, grid: kernel[grid]})()
    launch = Launcher(interpreted)
    for _ in range(3):
        launch((4, 1, 1), "key", "a")
    assert len(kernel.triton_launches) == 3 and kernel.compiled.c_launches == []


@pytest.mark.parametrize("hook, idle", [(None, True), (HookChain(), True), (print, False)])
def test_what_counts_as_no_hook(hook, idle):
    """Triton 3.6+ hands empty chains, never None; older Tritons None or a callable."""
    assert fast_launch._idle(hook) is idle
