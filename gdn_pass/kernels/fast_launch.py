"""Launch a Triton kernel through its compiled kernel's own launcher: the host cost of a torch op.

The guards launch one zeroing kernel per step with fresh rows, on the host
thread that enqueues the step. Triton's ``kernel[grid](*args)`` binds the
arguments, derives their specialization, looks the compiled kernel up and
only then calls the compiled kernel's C launcher: about 20 us of host time
on the H200's host, twice a plain torch op (``zero_launch_host_time.md``).
The launch itself is the C launcher's part, a few microseconds. So::

    launcher = Launcher(kernel)                 # a @triton.jit function
    launcher(grid, key, *args)                  # args: every parameter, constexprs included

    compiled = cache[key]                       # the caller's specialization key
    if compiled is None:                        # first launch of this key (or a launch hook is set)
        compiled = kernel[grid](*args)          # Triton's own path: compiles, launches, returns it
        cache[key] = compiled
    else:
        compiled.run(*grid, stream, compiled.function, ..., *args)   # the C launcher alone

**The key is the caller's promise**: two launches with the same key must
compile to the same kernel under Triton's rules, so it holds, for every
parameter Triton specializes, what Triton reads of it: a tensor's dtype and
whether its address is 16-byte aligned, an integer's value where it may be 1
or a multiple of 16 (or the value itself), every constexpr; and the device.
A key that says more than Triton reads only compiles a kernel more often.

Where the launch cannot go this way, it goes Triton's: a launch enter/exit
hook is registered (profilers such as Proton read its metadata; with none
registered, Triton's own launch passes empty hook chains that call nothing),
the kernel is not a ``JITFunction`` (``TRITON_INTERPRET=1``), or this
Triton's compiled kernel lacks the launcher attributes (checked once, on the
first launch; Triton 3.6, the H200's, and 3.9 have them). Triton is imported
on the first launch.
"""

from __future__ import annotations

__all__ = ["Launcher"]


class Launcher:
    """One ``@triton.jit`` kernel, launched through its compiled kernels' C launcher once compiled.

    ``fast_launches`` / ``triton_launches``: launches made each way in this
    process (tests check that the fast way is taken where it can be).
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict = {}  # key -> (C launcher, function handle, packed metadata)
        self._usable: bool | None = None  # None: not asked yet
        self.fast_launches = 0
        self.triton_launches = 0

    def __call__(self, grid: tuple[int, int, int], key: tuple, *args) -> None:
        """Launch ``kernel`` on ``grid`` with ``args`` (every parameter, in order, constexprs included)."""
        entry = self._compiled.get(key)
        if entry is not None and _no_launch_hooks():
            run, function, packed = entry
            run(grid[0], grid[1], grid[2], _current_stream(), function, packed, None, None, None, *args)
            self.fast_launches += 1
            return
        compiled = self.kernel[grid](*args)
        self.triton_launches += 1
        if entry is None and self._can_launch_directly(compiled):
            self._compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)

    def _can_launch_directly(self, compiled) -> bool:
        if self._usable is None:
            import triton

            self._usable = (isinstance(self.kernel, triton.runtime.jit.JITFunction)
                            and all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")))
            if self._usable:
                _bind_triton()
        return self._usable and compiled is not None


def _bind_triton() -> None:
    """Bind Triton's launch-hook knobs and its current-stream call (a GPU driver is active here)."""
    global _knobs, _current_stream
    from triton import knobs
    from triton.runtime import driver

    _knobs = knobs.runtime
    get_stream, get_device = driver.active.get_current_stream, driver.active.get_current_device
    _current_stream = lambda: get_stream(get_device())  # noqa: E731 - bound once


_knobs = None  # triton.knobs.runtime, once a kernel was launched


def _no_launch_hooks() -> bool:
    """No launch hook would run: Triton 3.6+ keeps them as chains (``HookChain``) that are never
    None, and an empty chain calls nothing; older Tritons hold None or a callable."""
    return _idle(_knobs.launch_enter_hook) and _idle(_knobs.launch_exit_hook)


def _idle(hook) -> bool:
    return hook is None or getattr(hook, "calls", None) == []


def _current_stream():  # replaced by Triton's driver call on the first launch
    raise RuntimeError("no Triton kernel launched yet")
