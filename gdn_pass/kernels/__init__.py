"""The Triton kernels gdn-pass launches, and their launchers: one home, no engine imported.

    stage.py         stage_rows_fused: a step's per-row flags and slots in one launch (the core's
                     staged rows, ``gdn_pass.metadata``)
    zero_rows.py     zero_rows, zero_rows_all, zero_new_rows_all, zero_new_rows_groups: the guards'
                     zeroing of fresh state slots, one launch per group of caches or per step
    fast_launch.py   Launcher: a launch through the compiled kernel's C launcher after the first
    _stage_triton.py, _zero_triton.py
                     the ``@triton.jit`` kernels; imported (with Triton) on the first launch only

The vLLM adapter (``gdn_pass.vllm``) calls these; nothing here knows vLLM
(``gdn_pass/README.md``, Triton kernels).
"""
