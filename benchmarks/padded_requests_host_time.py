"""Host time of gdn-pass acting for padded new requests on vLLM's GDN builders (``support.Decision.padded_only``).

Where vLLM's GDN builder routes fresh rows to prefill itself (0.31+) and the
engine speculates (MTP, k = 1 here), gdn-pass acts for one kind of row only:
a new one-token request the scheduler padded with placeholder drafts. Before
that repair it stood down there, and a step cost vLLM's builds alone. This
measures what every step costs now, on this process's vLLM (its real
``GDNAttentionMetadataBuilder`` s, configured, three groups of twelve layers at
Qwen3-Next's per-layer state shapes, and its V2 runner's real
``MambaHybridAttnMetadata``), per step, medians over interleaved blocks:

    vllm_us     vLLM alone: per group, the runner's counts (its method as vLLM ships it)
                and the builder's own build (unhooked): what a stood-down entry costs
    pass_us     with gdn-pass: once per step the padded rows' drafts (``padded_draft_counts``,
                what the wrapped ``prepare_attn`` adds), per group the wrapped method and
                the hooked build (on a padded step: the rows staged and zeroed at build)
    added_us    pass_us - vllm_us

Steps: ``speculating B`` (B rows past their prompt, each a token and its
draft: an MTP engine's common step) and ``padded B`` (the same, one row a new
request the scheduler padded with a placeholder draft; its slot is zeroed).

On CUDA vLLM 0.31+'s V2 runner builds the first group only and derives the
others with ``update_block_table``; this CPU benchmark builds each group (vLLM's
CPU builder does not take that shortcut), so its three builds per step are
the larger case.

    python benchmarks/padded_requests_host_time.py [--batches 1 8 64 256] [--repeat 400] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K = 1  # speculative tokens
NUM_BLOCKS = 32  # state slots per layer (36 layers of Qwen3-Next's shapes: 2.4 GB)


def make_builders(groups: int, layers_per_group: int, num_blocks: int) -> list:
    """``groups`` configured, speculating GDN builders made as vLLM's V2 runner makes them."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    from gdn_pass.vllm import VllmGDNStatePass, metadata_hook, support

    try:  # the prefill-backend probe reads a model config on CUDA; there is no model here
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

        qwen_gdn_linear_attn._resolve_gdn_prefill_backend = lambda cfg: ("triton", "triton")
    except ImportError:
        pass
    VllmConfig.num_speculative_tokens = property(lambda self: K)
    support.runs_v2_model_runner = lambda vllm_config: True  # the V2 runner (vLLM's CPU engine has no MTP)
    metadata_hook.install()
    config = VllmConfig(
        compilation_config=CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": VllmGDNStatePass()}),
        additional_config={"gdn_prefill_backend": "triton"})
    # A real SpeculativeConfig needs a model; the builder reads only these two fields.
    config.speculative_config = SimpleNamespace(num_speculative_tokens=K, parallel_drafting=False)
    context = config.compilation_config.static_forward_context
    shapes, dtypes = ((3, 8192), (32, 128, 128)), (torch.bfloat16, torch.float32)
    spec = MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes)
    made = []
    for group in range(groups):
        names = [f"model.layers.{group * layers_per_group + i}.linear_attn" for i in range(layers_per_group)]
        for name in names:
            context[name] = SimpleNamespace(kv_cache=[torch.zeros(num_blocks, *shape, dtype=dtype)
                                                      for shape, dtype in zip(shapes, dtypes)])
        with set_current_vllm_config(config):
            made.append(GDNAttentionMetadataBuilder(spec, names, config, torch.device("cpu")))
    decision = support.recorded("gdn")
    if decision is None or not decision.padded_only:
        raise SystemExit(f"vLLM here does not make gdn-pass act for padded rows only: {decision}")
    return made


class Step:
    """One step's inputs: B rows of 1 + K tokens; ``padded``: row 0 a new request padded with K drafts."""

    def __init__(self, batch: int, padded: bool):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        from gdn_pass.vllm import accepted_counts

        module, name = accepted_counts.RUNNER_METADATA
        self.runner_metadata = getattr(importlib.import_module(module), name)
        computed = [0 if padded and i == 0 else 17 for i in range(batch)]
        width = 1 + K
        qsl = torch.arange(batch + 1, dtype=torch.int32) * width
        seq = torch.tensor(computed, dtype=torch.int32) + width
        # Slots 1 .. 30, shared by rows at large B: the host's work does not depend on which slots
        blocks = (1 + torch.arange(2 * batch, dtype=torch.int32) % (NUM_BLOCKS - 2)).view(batch, 2)
        self.common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=batch,
            num_actual_tokens=batch * width, max_query_len=width, max_seq_len=int(seq.max()),
            block_table_tensor=blocks, slot_mapping=torch.zeros(batch * width, dtype=torch.int64),
            seq_lens_cpu_upper_bound=seq.clone(),
            **({"is_prefilling": torch.tensor([padded and i == 0 for i in range(batch)])}
               if "is_prefilling" in CommonAttentionMetadata.__dataclass_fields__ else {}))
        # What the V2 runner computes: a row still prefilling gets no drafts (-1)
        drafts = torch.tensor([-1 if padded and i == 0 else K for i in range(batch)], dtype=torch.int32)
        self.metadata = self.runner_metadata(is_prefilling=torch.tensor([padded and i == 0 for i in range(batch)]),
                                             num_accepted_tokens=torch.ones(batch, dtype=torch.int32),
                                             num_decode_draft_tokens_cpu=drafts)
        # The input batch fields padded_draft_counts reads
        self.batch = SimpleNamespace(num_draft_tokens_per_req=np.full(batch, K, dtype=np.int32),
                                     num_scheduled_tokens=np.full(batch, width, dtype=np.int32),
                                     is_prefilling_np=np.array([padded and i == 0 for i in range(batch)]))
        self.n = batch


def run_step(builders, step: Step, with_pass: bool, own_counts) -> None:
    from gdn_pass.vllm import accepted_counts

    if with_pass:  # what the wrapped prepare_attn does once per step, around the builds
        accepted_counts._Step.padded_drafts = accepted_counts.padded_draft_counts(step.batch)
    try:
        for builder in builders:
            if with_pass:
                extra = step.metadata.get_extra_attn_kwargs(builder, step.n)
                builder.build(common_prefix_len=0, common_attn_metadata=copy.copy(step.common), **extra)
            else:
                extra = own_counts(step.metadata, builder, step.n)
                builder.build.__wrapped__(builder, common_prefix_len=0, common_attn_metadata=copy.copy(step.common),
                                          **extra)
    finally:
        accepted_counts._Step.padded_drafts = None


def time_case(builders, step: Step, repeat: int, own_counts) -> tuple[float, float]:
    """Median us per step (with the pass, vLLM alone), interleaved in blocks of 20."""
    on, off = [], []
    for _ in range(max(1, repeat // 20)):
        for with_pass, out in ((True, on), (False, off)):
            start = time.perf_counter()
            for _ in range(20):
                run_step(builders, step, with_pass, own_counts)
            out.append((time.perf_counter() - start) / 20 * 1e6)
    return statistics.median(on), statistics.median(off)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--layers-per-group", type=int, default=12)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--repeat", type=int, default=400)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import vllm

    from gdn_pass.vllm import accepted_counts

    builders = make_builders(args.groups, args.layers_per_group, NUM_BLOCKS)
    module, name = accepted_counts.RUNNER_METADATA
    runner_metadata = getattr(importlib.import_module(module), name)
    own_counts = runner_metadata.get_extra_attn_kwargs  # vLLM's method, before gdn-pass wraps it
    if accepted_counts.supplies(builders[0]) is False:
        raise SystemExit("gdn-pass did not pass this builder the runner's counts")
    rows = []
    for batch in args.batches:
        for padded in (False, True):
            step = Step(batch, padded)
            pass_us, vllm_us = time_case(builders, step, args.repeat, own_counts)
            rows.append(dict(step=f"{'padded' if padded else 'speculating'} {batch}", vllm_us=round(vllm_us, 1),
                             pass_us=round(pass_us, 1), added_us=round(pass_us - vllm_us, 1),
                             ratio=round(pass_us / vllm_us, 4)))
            print(rows[-1], flush=True)
    result = dict(vllm=vllm.__version__, torch=torch.__version__, host=platform.processor() or platform.machine(),
                  groups=args.groups, layers_per_group=args.layers_per_group, k=K, repeat=args.repeat,
                  command="python " + " ".join(sys.argv), rows=rows)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "padded_requests_host_time.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
