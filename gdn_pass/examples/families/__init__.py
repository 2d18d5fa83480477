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
E2E_FAMILIES = ("qwen3_next",)

# kind -> a substring of the exact error vLLM's CPU backend raises for it. The
# e2e test skips with that error (and fails on any other); the family's core op
# is then guarded directly with poisoned slots instead.
CPU_LIMITS: dict[str, str] = {}
