"""GDNStatePass on graphs without GDN state: a reported no-op; uuid and pickling."""

import pickle

import torch

import gdn_pass
from gdn_pass import GDNStatePass


class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)  # a gather that is not state
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, ids):
        return torch.relu(self.proj(self.embed(ids))).sum(-1)


def test_non_gdn_graph_is_unchanged_and_reported(tmp_path):
    torch.manual_seed(0)
    model, ids = TinyMLP(), torch.randint(0, 64, (4, 3))
    expected = model(ids)
    gdn_pass.clear_reports()
    torch._dynamo.reset()
    compiled = torch.compile(
        model,
        options={"post_grad_custom_post_pass": GDNStatePass(report_dir=str(tmp_path)),
                 "fx_graph_cache": False},
    )
    torch.testing.assert_close(compiled(ids), expected, rtol=0, atol=1e-6)
    (report,) = gdn_pass.reports()
    assert report.reads == [] and not report.graph_changed
    assert "no GDN state reads" in report.summary()
    (written,) = gdn_pass.load_reports(tmp_path)
    assert written["num_nodes"] == report.num_nodes and written["guarded_per_op"] == {}


def test_uuid_follows_options_and_survives_pickling():
    default, off = GDNStatePass(), GDNStatePass(guard_opaque_ops=False)
    assert default.uuid() != off.uuid()
    assert pickle.loads(pickle.dumps(default)).uuid() == default.uuid()
    # Where the report goes does not change the compiled graph.
    assert GDNStatePass(report_dir="/tmp/x").uuid() == default.uuid()
