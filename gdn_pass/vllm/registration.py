"""What the core pass learns from the vLLM adapter, registered when ``gdn_pass.vllm`` is imported.

The core (``gdn_pass.state_pass``) imports no vLLM adapter module; it asks the
registry in ``gdn_pass.opaque_ops``, which this module fills:

- vLLM's GDN/KDA core ops and their schemas, of every supported release
  (``compat.CORE_OPS``);
- who makes their guarded ops and says when one is not needed (``guarded_ops``);
- the adapter modules whose source decides the rewrite, hashed into the
  pass's ``uuid()`` (the compiled-graph cache key).

Every way in imports it: ``gdn_pass.vllm`` (and so ``gdn_pass.vllm.VllmGDNStatePass``,
``gdn_pass.vllm.serve``) and the ``vllm.general_plugins`` entry point
(``gdn_pass.vllm.plugin``). A process that runs the core pass on a vLLM graph
without any of them gets a report naming the missing adapter.
"""

from __future__ import annotations

import sys

from gdn_pass import opaque_ops
from gdn_pass.vllm import builders, compat, guarded_ops, op_guard, piecewise, split_probe, support

__all__ = ["ADAPTER", "NAMESPACE"]

NAMESPACE = "vllm"

ADAPTER = opaque_ops.EngineAdapter(
    namespace=NAMESPACE,
    name="gdn_pass.vllm",
    ops=tuple(opaque_ops.OpaqueStateOp(op.qualname, op.arg_names, op.layer_arg, op.family)
              for op in compat.CORE_OPS),
    guards=guarded_ops,
    # support and split_probe decide whether the GDN core ops are swapped (the entry's stand-down)
    behaviour=(compat, builders, guarded_ops, op_guard, piecewise, support, split_probe, sys.modules[__name__]),
)

opaque_ops.register_engine(ADAPTER)
