"""A distributed port range of its own for each engine a GPU test starts.

vLLM picks its distributed init port by binding port 0 and letting it go; with two dozen
engines starting at once on one machine, two of them were handed the same port and one
stopped with ``EADDRINUSE`` (``gpu_tests_h200.md``: the bailing group at ``c7bc831`` and
``1c0c5d2``). vLLM scans upward from ``VLLM_PORT`` when it is set, so each
engine gets a base of its own from a counter shared by every test process on the
machine (a file under a lock), ``SPAN`` ports apart, below Linux's ephemeral range.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

FIRST, SPAN, SLOTS = 12000, 32, 600  # 12000 .. 31200, under the ephemeral 32768
COUNTER = Path(os.environ.get("GDN_PASS_GPU_PORT_COUNTER", Path(tempfile.gettempdir()) / "gdn_pass_engine_ports"))


def next_base() -> int:
    """The next engine's ``VLLM_PORT``: a new slot on every call, in any process."""
    with open(COUNTER, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        taken = int(f.read().strip() or 0)
        f.seek(0)
        f.truncate()
        f.write(str(taken + 1))
    return FIRST + (taken % SLOTS) * SPAN


def engine_env(env: dict) -> dict:
    """``env`` with a ``VLLM_PORT`` of this engine's own, unless the caller chose one."""
    return env if "VLLM_PORT" in env else {**env, "VLLM_PORT": str(next_base())}
