"""Bailing's Lightning builder, ``BailingLinearAttentionMetadataBuilder`` (``vllm/v1/attention/backends/linear_attn.py``).

Bailing-MoE-v2.5 (Ring/Ling 2.5 linear) and its MTP drafter. A subclass of
vLLM's linear-attention builder (``linear_attention``): the same rows, and
with speculative decoding one slot per column of a row (``[rows, 1 + k]``,
``spec_columns``), read by ``bailing_linear_attention_decode_spec``.

Release facts (0.26-0.34, unfixed upstream): the split's threshold is 1, or
``1 + k`` with MTP, and short extends count as decodes, so a new request of
up to ``1 + k`` tokens reads its recycled slot. With MTP two more repairs
apply to this builder: prompt chunks on the speculative path
(``prompt_chunks``) and, on vLLM's V2 runner, the accepted counts the runner
withholds (``accepted_counts``).
"""

from __future__ import annotations

from gdn_pass.vllm.builders import linear_attention
from gdn_pass.vllm.builders.state_builder import StateBuilder

__all__ = ["ENTRY"]

ENTRY = StateBuilder(
    key="bailing_linear", module="v1.attention.backends.linear_attn",
    class_name="BailingLinearAttentionMetadataBuilder",
    models="Bailing-MoE-v2.5 (Ring/Ling 2.5 linear) and its MTP drafter", state="Lightning state [H, D, D]",
    read_by="vllm::linear_attention (linear_decode_forward_triton, bailing_linear_attention_decode_spec)",
    rows=linear_attention.linear_rows, guards=("op", "step"), op_families=("lightning",),
    metadata_class="BailingLinearAttentionMetadata",
    metadata_fields=("num_decodes", "state_indices_tensor", "state_indices_tensor_d", "query_start_loc",
                     "seq_lens"),
    state_layout="square", architectures=("BailingMoeV2_5ForCausalLM",),
    spec_columns=True, device_rows=linear_attention.linear_decode_rows)
