"""gdn-pass: guard GatedDeltaNet recurrent-state reads in compiled graphs.

A brand-new request must start from zero state; engines that recycle state
slots without zeroing them (vllm#51562) let it read a previous owner's state.
This package rewrites the compiled graph so that such reads return zeros.

    import torch, gdn_pass
    compiled = torch.compile(model, options={"post_grad_custom_post_pass": gdn_pass.GDNStatePass()})

vLLM users: ``gdn_pass.vllm.VllmGDNStatePass`` (see the README).
"""

from gdn_pass.metadata import MetadataError, StagedRowMetadata
from gdn_pass.report import PassReport, StateRead, clear_reports, load_reports, reports
from gdn_pass.state_pass import GDNStatePass

__all__ = [
    "GDNStatePass",
    "StagedRowMetadata",
    "MetadataError",
    "PassReport",
    "StateRead",
    "reports",
    "clear_reports",
    "load_reports",
]
