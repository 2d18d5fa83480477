"""The test-side harness: what only the tests and benchmarks use, not shipped in the wheel.

- ``tiny_checkpoints``: every tiny seeded checkpoint kind (the product's
  Qwen3-Next and Llama of ``gdn_pass.checker.checkpoints``, their variants,
  and the GDN / Lightning families of ``families/``);
- ``fuzz`` and ``fuzz_judge``: the seeded scheduling fuzz and how it judges
  a request; ``step_trace``: the worker extension that records each step;
- ``serve_scenario``: the scenario through ``vllm serve``'s HTTP server;
- ``coverage``: the README's family x mode coverage table;
- ``v1_runner``: vLLM's V1 runner without a model, for its CUDA-graph choice.
"""
