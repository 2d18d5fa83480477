"""Tiny seeded checkpoints for the GDN model families of vllm#51562, one module per family.

Each module defines ``CHECKPOINTS = {kind: (config_dict, tensors)}`` where
``tensors(config)`` yields ``(name, shape)`` for every tensor of the Hugging
Face checkpoint, named as vLLM's ``load_weights`` for that architecture
expects them. ``harness.tiny_checkpoints`` registers them. A module
may also define ``EXTRA_FILES = {kind: {file_name: text}}``, files written
beside ``config.json`` (``bailing_linear``: its config class, so its
checkpoints need ``trust_remote_code=True``).
"""

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

_NO_MM = ("--engine-arg", 'limit_mm_per_prompt={"image": 0, "video": 0}')
_REMOTE_CODE = ("--engine-arg", "trust_remote_code=true")

# Engine arguments a family needs on top of the scenario's.
FAMILY_ENGINE_ARGS: dict[str, tuple[str, ...]] = {
    # Multimodal: without a tokenizer (skip_tokenizer_init) vLLM cannot build
    # the image processor; text-only requests need none.
    "interns2_mobius": _NO_MM,
    "qwen3_5_vl": _NO_MM,
    "qwen3_5_moe_vl": _NO_MM,
    # the MTP checkpoints also need speculative_config={"method": "mtp", ...}
    "qwen3_5_mtp": _NO_MM,
    "qwen3_5_moe_mtp": _NO_MM,
    # Config class shipped beside config.json (bailing_linear.EXTRA_FILES): no
    # config class in vLLM or transformers fits the Bailing-MoE-v2.5 layout.
    "bailing_moe_v2_5": _REMOTE_CODE,
    "bailing_moe_v2_5_mtp": _REMOTE_CODE,
}

# The first vLLM release whose model registry has the kind's architecture,
# where that is later than 0.26 (the CUDA release this project runs). vLLM
# 0.26 has neither InternS2-Mobius nor Bailing-MoE-v3, and has the text-only
# Qwen3.5 classes but does not register them (nor their ``qwen3_5_text``
# config types).
FIRST_VLLM: dict[str, tuple[int, int]] = {
    "qwen3_5": (0, 27),
    "qwen3_5_moe": (0, 27),
    "interns2_mobius": (0, 28),
    "bailing_moe_v3": (0, 28),
}

# Where a kind cannot load, the checkpoint of the same family that can: the
# released (multimodal) Qwen3.5 layout, which vLLM 0.26 to 0.30 all load.
SAME_FAMILY: dict[str, str] = {"qwen3_5": "qwen3_5_vl", "qwen3_5_moe": "qwen3_5_moe_vl"}


def kind_for_vllm(kind: str, vllm_version: str) -> str | None:
    """The checkpoint kind to run for ``kind`` on ``vllm_version``; None if the family is absent there."""
    release = tuple(int(part) for part in vllm_version.split(".")[:2])
    if release >= FIRST_VLLM.get(kind, (0, 0)):
        return kind
    other = SAME_FAMILY.get(kind)
    return other if other is not None and release >= FIRST_VLLM.get(other, (0, 0)) else None


# kind -> substrings of the errors vLLM 0.30's CPU backend raises for it (found
# in the failed engine's log), one per host kind where they differ. The e2e test
# skips with the error it finds and fails on any other; where the family has a
# core op, it is guarded directly with poisoned slots instead
# (tests/vllm/test_family_op_guard_*.py).
# MLA makes the CPU platform turn prefix caching off after the hybrid config set
# mamba_block_size; VllmConfig then rejects the combination.
_MLA_WITHOUT_AMX = "--mamba-block-size can only be set with --enable-prefix-caching"
# On hosts with AMX tiles vLLM takes its AMX MLA backend instead, which keeps
# prefix caching; the engine then fails at weight loading, in the conv weight
# packing vLLM's CPU backend does on such hosts (no float32 kernel).
_MLA_WITH_AMX = "\"causal_conv1d_fwd_kernel_impl\" not implemented for 'Float'"
CPU_LIMITS: dict[str, tuple[str, ...]] = {
    # OlmoHybridGatedDeltaNetAttention.__init__ calls set_triton_allocator
    # unconditionally; vLLM's CPU build has no Triton.
    "olmo_hybrid": ("module 'triton' has no attribute 'set_allocator'",),
    "bailing_moe_v3": (_MLA_WITHOUT_AMX, _MLA_WITH_AMX),
    "kimi_linear": (_MLA_WITHOUT_AMX, _MLA_WITH_AMX),
}
