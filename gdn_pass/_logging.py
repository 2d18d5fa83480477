"""The ``gdn_pass`` logger: one INFO line per compiled graph, warnings for gaps.

Engines configure their own loggers only (vLLM: ``vllm``), so without a
handler of its own the per-graph line would vanish. Level from
``GDN_PASS_LOGGING_LEVEL`` (default INFO).
"""

import logging
import os

logger = logging.getLogger("gdn_pass")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [gdn-pass] %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(_handler)
    logger.setLevel(os.environ.get("GDN_PASS_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False
