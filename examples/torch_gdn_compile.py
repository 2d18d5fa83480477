"""Guard a torch-native GDN layer's state reads with plain torch.compile.

    python examples/torch_gdn_compile.py

A fresh request on a recycled (poisoned) slot next to a decoding one, and a
padding row: the compiled step reads zero state for the fresh row, leaves the
padding row's sentinel slot alone, and prints the pass's report.
"""

import torch

import gdn_pass
from gdn_pass.checker.torch_gdn import GDNShape, TorchGDNLayer

layer = TorchGDNLayer(GDNShape(hidden=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16))
conv, ssm = layer.new_caches(num_slots=8)
conv.fill_(float("nan"))  # every slot holds someone else's (poisoned) state
ssm.fill_(float("nan"))
ssm[5] = 0.1  # request on slot 5 has real history

rows = gdn_pass.StagedRowMetadata(max_rows=4, pad_slot_ids=(-1,), scratch_slot=0)
step = torch.compile(layer, options={"post_grad_custom_post_pass": gdn_pass.GDNStatePass(rows)})

slots = torch.tensor([3, 5, -1, -1])  # fresh request on recycled slot 3, decode on 5, two padding rows
rows.stage(num_computed_tokens=torch.tensor([0, 9, 0, 0]), query_lens=torch.tensor([1, 1, 0, 0]),
           state_slots=slots)
with torch.no_grad():
    out = step(torch.randn(4, 1, 64), conv, ssm, slots)

print(gdn_pass.reports()[-1].to_text())
print("fresh row output finite:", bool(out[0].isfinite().all()))
print("last slot (where -1 would wrap) untouched:", bool(ssm[7].isnan().all()))
