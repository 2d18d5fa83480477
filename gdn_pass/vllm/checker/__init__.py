"""The checker's vLLM engines: not the fix, what ``gdn-pass check`` / ``demo`` run.

- ``scenarios``: the scheduling scenarios that expose the stale-slot bug in a
  real vLLM engine, one engine per process (``python -m
  gdn_pass.vllm.checker.scenarios``); the torch side of the checker is
  ``gdn_pass.checker``.
- ``model_loading``: what vLLM needs to load the models the checker runs.

The plugin (``gdn_pass.vllm``) never imports this package; it lives under the
adapter because it imports vLLM, which only ``gdn_pass.vllm`` may.
"""
