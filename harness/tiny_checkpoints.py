"""Every tiny seeded checkpoint kind the tests and benchmarks use, registered with the checker's writer.

The product bundles ``qwen3_next`` and ``llama`` (``gdn_pass.checker.checkpoints``);
here are the Qwen3-Next variants (MTP, a larger shape, a small state) and the
families of ``harness/families`` (Qwen3.5, OLMo-hybrid, InternS2-Mobius,
Bailing-MoE-v3, Kimi-Linear, Bailing-MoE-v2.5). Importing this module registers
them; ``write_checkpoint`` then writes any kind.

    python -m harness.tiny_checkpoints KIND OUT_DIR [--seed 0] [--tokenizer]
"""

from __future__ import annotations

from collections.abc import Iterator

from gdn_pass.checker.checkpoints import (CHECKPOINTS, EXTRA_FILES, LLAMA_CONFIG, QWEN3_NEXT_CONFIG, main, qwen3_next_layer,
                                          qwen3_next_tensors, register_checkpoints, write_checkpoint,
                                          write_tokenizer)
from harness.families import (bailing_linear, bailing_moe_v3, interns2_mobius, kimi_linear, olmo_hybrid,
                              qwen3_5)

__all__ = ["CHECKPOINTS", "EXTRA_FILES", "LLAMA_CONFIG", "QWEN3_NEXT_CONFIG", "QWEN3_NEXT_1K_CONFIG", "QWEN3_NEXT_MTP_CONFIG",
           "QWEN3_NEXT_SMALL_STATE_CONFIG", "write_checkpoint", "write_tokenizer"]

# A larger Qwen3-Next shape for latency measurements: hidden 1024, 8 layers of
# which 6 GDN.
QWEN3_NEXT_1K_CONFIG = {
    **QWEN3_NEXT_CONFIG,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "num_attention_heads": 8,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}

# Qwen3-Next with a small GDN state (1 key / 2 value heads of 64): vLLM then
# sizes the hybrid model's blocks to 128 tokens (384 for QWEN3_NEXT_CONFIG),
# so prompts of a few hundred tokens hit the prefix cache in "align" mode and
# requests growing into new blocks get preempted (the scheduling fuzz).
QWEN3_NEXT_SMALL_STATE_CONFIG = {
    **QWEN3_NEXT_CONFIG,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
}

# Qwen3-Next with one MTP layer, for speculative decoding (method "mtp").
QWEN3_NEXT_MTP_CONFIG = {**QWEN3_NEXT_CONFIG, "num_nextn_predict_layers": 1}


def _qwen3_next_mtp_tensors(c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The target model plus its multi-token-prediction head (``mtp.*``)."""
    yield from qwen3_next_tensors(c)
    h = c["hidden_size"]
    yield "mtp.fc.weight", (h, 2 * h)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        yield f"mtp.{norm}.weight", (h,)
    for i in range(c["num_nextn_predict_layers"]):
        yield from qwen3_next_layer(f"mtp.layers.{i}", "full_attention", c)


register_checkpoints({
    "qwen3_next_mtp": (QWEN3_NEXT_MTP_CONFIG, _qwen3_next_mtp_tensors),
    "qwen3_next_1k": (QWEN3_NEXT_1K_CONFIG, qwen3_next_tensors),
    "qwen3_next_small_state": (QWEN3_NEXT_SMALL_STATE_CONFIG, qwen3_next_tensors),
})
for _family in (qwen3_5, olmo_hybrid, interns2_mobius, bailing_moe_v3, kimi_linear, bailing_linear):
    register_checkpoints(_family.CHECKPOINTS, getattr(_family, "EXTRA_FILES", None))


if __name__ == "__main__":
    main()
