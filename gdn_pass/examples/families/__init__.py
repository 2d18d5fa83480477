"""Tiny seeded checkpoints for the GDN model families of vllm#51562, one module per family.

Each module defines ``CHECKPOINTS = {kind: (config_dict, tensors)}`` where
``tensors(config)`` yields ``(name, shape)`` for every tensor of the Hugging
Face checkpoint, named as vLLM's ``load_weights`` for that architecture
expects them. ``gdn_pass.examples.tiny_checkpoints`` merges them.
"""

FAMILY_MODULES = (
    "qwen3_5",
    "olmo_hybrid",
    "interns2_mobius",
    "bailing_moe_v3",
    "kimi_linear",
)

# Checkpoint kinds the family end-to-end test runs (tests/vllm/test_families.py).
E2E_FAMILIES = (
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "interns2_mobius",
    "olmo_hybrid",
    "bailing_moe_v3",
    "kimi_linear",
)

# Engine arguments a family needs on top of the scenario's.
FAMILY_ENGINE_ARGS: dict[str, tuple[str, ...]] = {
    # Multimodal: without a tokenizer (skip_tokenizer_init) vLLM cannot build
    # the image processor; text-only requests need none.
    "interns2_mobius": ("--engine-arg", 'limit_mm_per_prompt={"image": 0, "video": 0}'),
}

# kind -> a substring of the error vLLM 0.30's CPU backend raises for it (found
# in the failed engine's log). The e2e test skips with that error and fails on
# any other; where the family has a core op, it is guarded directly with
# poisoned slots instead (tests/vllm/test_family_op_guard_*.py).
CPU_LIMITS: dict[str, str] = {
    # OlmoHybridGatedDeltaNetAttention.__init__ calls set_triton_allocator
    # unconditionally; vLLM's CPU build has no Triton.
    "olmo_hybrid": "module 'triton' has no attribute 'set_allocator'",
    # MLA makes the CPU platform turn prefix caching off after the hybrid
    # config set mamba_block_size; VllmConfig then rejects the combination.
    "bailing_moe_v3": "--mamba-block-size can only be set with --enable-prefix-caching",
    "kimi_linear": "--mamba-block-size can only be set with --enable-prefix-caching",
}
