"""GPU tests: run with ``bash scripts/test-gpu`` on a machine with CUDA.

Without CUDA every test here is collected and reported skipped, whether
pytest was given the whole suite, this directory or one file of it (a
module-level skip in this conftest stopped pytest with a traceback when a
file here was named).
"""

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent
_NO_CUDA = pytest.mark.skip(reason="no CUDA device: GPU tests run with `bash scripts/test-gpu` on a GPU machine")


def pytest_collection_modifyitems(config, items):
    # A session-wide hook: only this directory's tests are skipped.
    if torch.cuda.is_available():
        return
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(_NO_CUDA)
