"""The state-isolation checker behind ``gdn-pass check``, ``demo``, ``report`` and ``dump``.

- ``torch_gdn``, ``gdn_runner``: a plain-PyTorch GDN layer and a small runner
  that compiles it with the pass (the engine-free model ``torch-gdn``);
- ``poison_oracle``: poisons the state caches and checks every row against an
  eager fresh-state run;
- ``checkpoints``, ``qwen_layers``: the bundled tiny seeded checkpoints
  (``tiny-qwen3-next``, ``tiny-llama``);
- ``demo``: runs the vLLM scenarios (``gdn_pass.vllm.checker.scenarios``) each in a
  fresh engine process and compares them.
"""
