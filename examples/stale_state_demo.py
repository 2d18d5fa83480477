"""vllm#51562 reproduced in real vLLM on CPU, then fixed by GDNStatePass.

    python examples/stale_state_demo.py [--workdir artifacts/demo]

(the README's first command, ``bash scripts/demo``, sets up the environment
and runs this; ``gdn-pass demo`` is the same).
"""

import sys

from gdn_pass.checker.demo import main

if __name__ == "__main__":
    sys.exit(main())
