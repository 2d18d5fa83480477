"""GDNStatePass by qualified name, for ``vllm serve`` (whose config is JSON).

    vllm serve MODEL --compilation-config \
        '{"inductor_passes": {"post_grad_custom_post_pass": "gdn_pass.vllm.serve.GDN_STATE_PASS"}}'

vLLM 0.26-0.30 resolve each value of ``compilation_config.inductor_passes``
as ``__import__(module).__dict__[name]``, and ``__import__("a.b.c")`` returns
the top-level package ``a``: the name is looked up in ``gdn_pass``'s own
namespace, after this module has been imported. So importing this module
binds the pass there too; a resolver that imports the module properly finds
it here. Either way the engine gets this one ``VllmGDNStatePass`` object
(an ``InductorPass``, used as is) under the hook the key names, and the
plugin recognises it exactly as an object passed in Python (and by its name,
published in ``gdn_pass.vllm.configured``).

Reports go where ``GDN_PASS_REPORT_DIR`` says, as for any GDNStatePass
without a ``report_dir``.
"""

from __future__ import annotations

import gdn_pass
from gdn_pass.vllm import configured
from gdn_pass.vllm.configured import SERVE_PASS
from gdn_pass.vllm.gdn_state_pass import VllmGDNStatePass

__all__ = ["GDN_STATE_PASS"]

GDN_STATE_PASS = VllmGDNStatePass()

_name = SERVE_PASS.rsplit(".", 1)[1]
assert SERVE_PASS == f"{__name__}.{_name}"
setattr(gdn_pass, _name, GDN_STATE_PASS)
configured.publish(SERVE_PASS, GDN_STATE_PASS)
