"""Inductor-side extensions of gdn-pass (lowerings, generated-code inspection).

The vLLM opaque-op guard needs none: it swaps an op for a guarded twin and
Inductor emits it as the same fallback kernel. The masked-load lowering for
graph-visible state gathers lands here with the torch-native path.
"""
