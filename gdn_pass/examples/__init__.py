"""Bundled workloads: tiny seeded checkpoints, vLLM scheduling scenarios, GDN
reference layers, a small runner and the poison oracle.

They back the command line (``gdn-pass demo|report|dump|check``), the tests
and the benchmarks; the scripts in the repository's ``examples/`` folder are
thin entry points to them.
"""
