"""Run a test module's Triton cases in Triton's CPU interpreter, in a subprocess.

``TRITON_INTERPRET=1`` must be set before Triton defines its own library
functions (``tl.cumsum``, ``tl.sum``), long before a test can set it in the
pytest process. The module, run as a script, prints one JSON line last: its
cases' results, which the tests then read.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_interpreter(script: str, timeout: float = 600) -> dict:
    """``python script`` with the interpreter on and the project importable; its last line, parsed."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
