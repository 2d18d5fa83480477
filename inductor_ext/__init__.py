"""Inductor-side extensions of gdn-pass.

- ``gated_gather``: the ``gdn_pass::gated_gather`` op and its Inductor
  lowering, a masked indirect load that fuses into the kernels Inductor
  generates (Triton and C++).

The vLLM op guard needs no lowering: the pass swaps an op for a guarded op
that Inductor emits as the same fallback kernel.
"""
