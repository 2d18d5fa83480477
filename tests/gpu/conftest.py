import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU tests run with `bash scripts/test-gpu` on a GPU machine",
                allow_module_level=True)
