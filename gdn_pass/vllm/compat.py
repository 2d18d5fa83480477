"""What the running vLLM provides, detected rather than assumed (0.30-0.33)."""

from __future__ import annotations

import functools
import importlib

__all__ = ["inductor_pass_base", "pad_slot_ids", "vllm_version", "UnsupportedVLLM"]

# InductorPass moved from vllm.compilation.inductor_pass to
# vllm.compilation.passes.inductor_pass.
_INDUCTOR_PASS_MODULES = (
    "vllm.compilation.passes.inductor_pass",
    "vllm.compilation.inductor_pass",
)


class UnsupportedVLLM(ImportError):
    """The installed vLLM lacks something gdn-pass needs."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


@functools.cache
def inductor_pass_base() -> type:
    for name in _INDUCTOR_PASS_MODULES:
        try:
            return importlib.import_module(name).InductorPass
        except (ImportError, AttributeError):
            continue
    raise UnsupportedVLLM(
        f"vLLM {vllm_version()} has no InductorPass in any of {_INDUCTOR_PASS_MODULES}; "
        "gdn-pass supports vLLM 0.30-0.33. Use gdn_pass.GDNStatePass with plain "
        "torch.compile, or install a supported vLLM."
    )


@functools.cache
def pad_slot_ids() -> tuple[int, ...]:
    """Slot ids that mark a padding row in this vLLM's GDN metadata.

    ``PAD_SLOT_ID = -1`` in older releases; ``NULL_BLOCK_ID = 0`` since
    vllm#39064 (block 0 is then the reserved null block, never a live slot).
    """
    utils = importlib.import_module("vllm.v1.attention.backends.utils")
    ids = [getattr(utils, "PAD_SLOT_ID", -1)]
    if hasattr(utils, "NULL_BLOCK_ID"):
        ids.append(utils.NULL_BLOCK_ID)
    return tuple(dict.fromkeys(ids))
