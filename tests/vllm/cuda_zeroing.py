"""The guards' CUDA zeroing path on CPU: the same kernels in Triton's interpreter, on CPU tensors.

On CUDA the guards zero a group's fresh slots in one launch over a
``CacheTable`` of every layer's caches; where the entry reads its decode rows
in vLLM's own device tensors (``StateBuilder.device_rows``) that launch finds
the fresh rows itself (``zero_new_rows_all``) and nothing is staged. CPU
engines never take that path (no table off CUDA). A test module that
supports it runs its cases a second time in a subprocess with Triton's
interpreter on (``run_module_on_the_cuda_path``); there an autouse fixture
calls ``take_the_cuda_path``, which builds a table of the CPU caches, forbids
the staged and per-cache zeroings, and records each device-row launch, so
that a case passes only through the CUDA path.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from gdn_pass.kernels.zero_rows import CacheTable

ENV = "GDN_PASS_TEST_CUDA_ZEROING"
# With ENV: the engine counts as one that captures FULL CUDA graphs (none replays on CPU), so that
# the op guard's groups defer their builds to the step's first guarded op (``metadata_hook``).
DEFER_ENV = "GDN_PASS_TEST_DEFERRED_BUILDS"
ROOT = Path(__file__).resolve().parents[2]


def on_the_cuda_path() -> bool:
    """Is this process the interpreter run of ``run_module_on_the_cuda_path``?"""
    return os.environ.get(ENV) == "1"


def cpu_table(caches: list[torch.Tensor]) -> CacheTable:
    """``CacheTable.build`` accepts CUDA caches only; the same table, for CPU tensors."""
    entries = [(c.data_ptr(), c.stride(0) * c.element_size() // 4, c[0].numel() * c.element_size() // 4)
               for c in caches]
    return CacheTable(caches, torch.tensor(entries, dtype=torch.int64), max(e[2] for e in entries))


def zeroing_guard(monkeypatch) -> list:
    """Name the guard behind each zeroing: a one-item list holding "step" (the step guard zeroes
    at build: its hand-off says ``zeroed_at_build``) or "op" while ``StepHandoff.zero`` or the op
    guard's joint zeroing of a step's groups (``JointZeroing.zero``) runs."""
    from gdn_pass.vllm.handoff import JointZeroing, StepHandoff

    who = [None]
    original = StepHandoff.zero

    def zero(self, caches, *, whole_table):
        who[0] = "step" if self.zeroed_at_build else "op"
        try:
            return original(self, caches, whole_table=whole_table)
        finally:
            who[0] = None

    monkeypatch.setattr(StepHandoff, "zero", zero)
    original_joint = JointZeroing.zero

    def zero_joint(self):
        who[0] = "op"
        try:
            return original_joint(self)
        finally:
            who[0] = None

    monkeypatch.setattr(JointZeroing, "zero", zero_joint)
    return who


def take_the_cuda_path(monkeypatch, launches: list) -> None:
    """Guards zero through the one-launch table and vLLM's device rows only; ``launches`` gets
    ``(guard, cache address)`` for every cache each device-row launch covers."""
    from gdn_pass.kernels import zero_rows
    from gdn_pass.vllm import handoff, metadata_hook

    monkeypatch.setattr(metadata_hook, "_cache_table", lambda caches, device: cpu_table(caches) if caches else None)
    monkeypatch.setattr(zero_rows, "_programs", lambda device: 3)  # fewer programs than work items
    monkeypatch.setattr(zero_rows, "_CHUNK_WORDS", 16)  # a slot spans several chunks
    who = zeroing_guard(monkeypatch)

    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"{who[0]} guard's {name}: the CUDA path stages nothing and zeroes "
                                 "through vLLM's device rows")
        return call

    original = handoff.zero_new_rows_all

    def recorded(table, *args):
        launches.extend((who[0], cache.data_ptr()) for cache in table.caches)
        return original(table, *args)

    monkeypatch.setattr(handoff, "zero_new_rows_all", recorded)
    original_groups = handoff.zero_new_rows_groups

    def recorded_groups(tables, *args):
        launches.extend((who[0], cache.data_ptr()) for table in tables for cache in table.caches)
        return original_groups(tables, *args)

    monkeypatch.setattr(handoff, "zero_new_rows_groups", recorded_groups)
    monkeypatch.setattr(handoff, "zero_rows_all", forbidden("zero_rows_all"))
    monkeypatch.setattr(handoff, "zero_rows", forbidden("zero_rows"))


SITE = Path(__file__).resolve().parent / "cuda_path_site"


def emulate_in_engine() -> None:
    """This process's guards zero only through the CUDA path's kernels, on CPU tensors: a table of
    the CPU caches, Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported),
    the staged and per-cache zeroings forbidden. For an engine process (``engine_env``)."""
    from gdn_pass.kernels import zero_rows
    from gdn_pass.vllm import handoff, metadata_hook

    metadata_hook._cache_table = lambda caches, device: cpu_table(caches) if caches else None
    zero_rows._programs = lambda device: 3  # fewer programs than work items

    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"{name}: the CUDA path stages nothing and zeroes through vLLM's device rows")
        return call

    handoff.zero_rows_all = forbidden("zero_rows_all")
    handoff.zero_rows = forbidden("zero_rows")
    if os.environ.get(DEFER_ENV) == "1":  # as where FULL CUDA graphs are captured: builds are deferred
        from gdn_pass.vllm import support

        support.captures_full_graphs = lambda vllm_config: True


def engine_env(deferred_builds: bool = False) -> dict:
    """Environment entries that put an engine process's guards on the CUDA zeroing path
    (``cuda_path_site``, ``emulate_in_engine``)."""
    return {"TRITON_INTERPRET": "1", ENV: "1", DEFER_ENV: "1" if deferred_builds else "0",
            "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run_module_on_the_cuda_path(module_file: str, runner_test: str, expected_passed: int,
                                timeout: float = 900) -> str:
    """Run ``module_file``'s tests but ``runner_test`` (the caller) in a subprocess with the
    interpreter on and ``ENV`` set; assert that ``expected_passed`` of them passed and none failed
    or was skipped; return pytest's summary line."""
    env = dict(os.environ, TRITON_INTERPRET="1", **{ENV: "1"},
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module_file, "-k", f"not {runner_test}"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)",
                                                     summary)}
    assert counts == {"passed": expected_passed}, summary
    return summary
