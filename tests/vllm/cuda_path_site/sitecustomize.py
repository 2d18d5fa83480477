"""Put a vLLM CPU engine's guards on the CUDA zeroing path, for a test's engine process only.

A test that wants it starts the engine with this folder first on ``PYTHONPATH``
and ``GDN_PASS_TEST_CUDA_ZEROING=1`` (and ``TRITON_INTERPRET=1``): Python
imports this module at start-up, before the engine, and
``cuda_zeroing.emulate_in_engine`` does the rest. Without that variable it does nothing.
"""

import os

if os.environ.get("GDN_PASS_TEST_CUDA_ZEROING") == "1":
    from tests.vllm.cuda_zeroing import emulate_in_engine

    emulate_in_engine()
