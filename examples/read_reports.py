"""What the pass did to a graph: its report object, its report files, and the before/after graphs.

    GDN_PASS_LOGGING_LEVEL=DEBUG python examples/read_reports.py

Compiles the torch GDN layer of ``torch_gdn_compile.py`` with a report
directory. The report lists every state read found and how it was gated; the
same report is written as JSON and text (what vLLM users read, since the
engine compiles a copy of the pass). At DEBUG level the before/after graphs
are logged through ``torch._dynamo.utils.lazy_format_graph_code``, the
channel depyf and vLLM's graph dumps read (``gdn-pass dump MODEL --out DIR``
writes depyf dumps with the pass off and on).
"""

import tempfile
from pathlib import Path

import torch

import gdn_pass
from gdn_pass.checker.torch_gdn import GDNShape, TorchGDNLayer
from gdn_pass.report import load_reports

report_dir = Path(tempfile.mkdtemp(prefix="gdn-pass-reports-"))
layer = TorchGDNLayer(GDNShape(hidden=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16))
conv, ssm = layer.new_caches(num_slots=8)
rows = gdn_pass.StagedRowMetadata(max_rows=4, pad_slot_ids=(-1,), scratch_slot=0)
step = torch.compile(layer, options={
    "post_grad_custom_post_pass": gdn_pass.GDNStatePass(rows, report_dir=str(report_dir))})

slots = torch.tensor([3, 5, -1, -1])
rows.stage(num_computed_tokens=torch.tensor([0, 9, 0, 0]), query_lens=torch.tensor([1, 1, 0, 0]),
           state_slots=slots)
with torch.no_grad():
    step(torch.randn(4, 1, 64), conv, ssm, slots)

report = gdn_pass.reports()[-1]  # in this process
print(report.to_text())
print("files:", sorted(p.name for p in report_dir.iterdir()))
print("from disk:", [r["guarded_per_op"] for r in load_reports(report_dir)])
