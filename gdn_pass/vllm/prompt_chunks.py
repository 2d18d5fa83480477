"""Prompt tokens on the Lightning builder's speculative decode path (MTP, vLLM's V1 runner).

With ``k`` speculative tokens, ``BailingLinearAttentionMetadataBuilder``
splits its batch with the threshold ``1 + k`` and counts short extends as
decodes, so a row that runs 2 .. 1 + k *prompt* tokens (a prompt's last chunk,
a short prompt) takes ``bailing_linear_attention_decode_spec``, whose launch
``j`` reads column ``num_accepted_tokens - 1`` (``j = 0``) or ``j - 1`` of
the row's slots and writes token ``j``'s state into column ``j``. Two things
then go wrong (H200, vLLM 0.26, traced step by step:
``benchmarks/results/mtp_prompt_chunks_gpu.md``):

1. **The state lands in the wrong column.** A row of ``q`` prompt tokens
   leaves its state in column ``q - 1``; it had no draft tokens, so the next
   step reads column ``num_accepted - 1 = 0``: the state after the chunk's
   first token. Every token after the prompt's first output is computed
   without the chunk's last ``q - 1`` tokens.
2. **A FULL decode graph replays on another step's buffers.** The runner gives
   the builder accepted counts only in a step where some request has draft
   tokens. In a step without any whose rows all have ``1 + k`` tokens (a
   prompt's last chunk alone) the runner has already picked the FULL graph it
   captured for speculative decodes of that shape, while the builder, given
   no counts, splits with threshold 1, calls the rows prefills and stages no
   decode buffer: the replayed spec kernel reads (and writes) the slots of
   the last step that staged them. A request's first token is then garbage,
   in the stream and alone.

The rewrite, for builders that speculate (engine start decides, ``for_builder``):

    before                                       after
    build(common)       # no draft in the step,  build(common, num_accepted_tokens=[1, ...])
                        # rows of 1 + k tokens,   # decodes: the FULL graph's buffers staged
                        # FULL graphs             # for this step's rows
    slots_d[i] = [s0, s1, ...]                   slots_d[i] = [s0, s0, ...]
                        # row i: > 1 prompt token # read s0, leave the state in s0

Invariants: a row with draft tokens (``num_decode_draft_tokens_cpu >= 0``)
is never changed, nor is a row of one token; the columns of a prompt row
all name its column-0 slot, its own block, which is where the next step
reads (``num_accepted = 1``); a step with draft tokens and no prompt row
costs one host check; a step without draft tokens is changed only where the
runner can replay the speculative FULL graph on it (every row ``1 + k``
tokens or padding, FULL graphs captured, the batch within the graphs'
sizes). vLLM's V2 runner (0.31-0.34) passes the Lightning builder no accepted
counts at all: ``accepted_counts`` makes it pass them, and the repair then
applies as on V1 (the V2 runner passes counts on every speculating step, and
keeps steps with a prompt chunk off FULL graphs, so ``call_kwargs`` changes
nothing there).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from gdn_pass._logging import logger
from gdn_pass.vllm import accepted_counts, compat

__all__ = ["PromptChunks", "for_builder"]

_said: set[str] = set()


@dataclasses.dataclass(eq=False, slots=True)
class PromptChunks:
    """The repair for one speculating Lightning builder.

    ``width``: ``1 + k``; ``max_graph_rows``: the builder's largest FULL
    decode batch; ``full_graphs``: the engine captures FULL graphs;
    ``accepted_ones``: ``[max_graph_rows]`` int32 ones on the builder's
    device, the accepted counts of a step without drafts.
    """

    width: int
    max_graph_rows: int
    full_graphs: bool
    accepted_ones: torch.Tensor
    rows_repaired: int = 0
    steps_staged: int = 0

    def call_kwargs(self, common, kwargs: dict) -> dict:
        """``build``'s keyword arguments, with accepted counts where the runner gave none and may
        replay the speculative FULL graph on this step."""
        if not self.full_graphs or kwargs.get("num_accepted_tokens") is not None:
            return kwargs
        if common.max_query_len != self.width or common.num_reqs > self.max_graph_rows:
            return kwargs
        qlens = np.diff(common.query_start_loc_cpu[: common.num_reqs + 1].numpy())
        if not np.all((qlens == self.width) | (qlens == 0)):
            return kwargs  # not the shape of a uniform speculative decode: no FULL graph replays it
        self.steps_staged += 1
        return {**kwargs, "num_accepted_tokens": self.accepted_ones[: common.num_reqs]}

    def keep_state_in_first_column(self, builder, common, draft_counts, metadata) -> int:
        """Point every column of each speculative-path prompt row at its column-0 slot; the count."""
        accepted = getattr(metadata, "num_accepted_tokens", None)
        slots = getattr(metadata, "state_indices_tensor_d", None)
        decodes = int(metadata.num_decodes)
        if accepted is None or slots is None or slots.dim() != 2 or decodes == 0:
            return 0
        no_draft = None
        if draft_counts is not None:  # None: no request of the step has drafts
            drafts = draft_counts.numpy()[:decodes]
            # argmin, not min: numpy's reductions cost about 1.5 us of per-call overhead
            if drafts[drafts.argmin()] >= 0:  # every decode row speculates: the common step
                return 0
            no_draft = drafts < 0
        prompt = np.diff(common.query_start_loc_cpu.numpy()[: decodes + 1]) > 1
        if no_draft is not None:
            prompt &= no_draft
        rows = np.flatnonzero(prompt)
        if rows.size == 0:
            return 0
        staged = builder.decode_state_indices_tensor
        if slots.untyped_storage().data_ptr() != staged.untyped_storage().data_ptr():
            # a view of the runner's block table (no FULL graph this step): the rows of a copy
            slots = slots.clone()
            metadata.state_indices_tensor_d = slots
        index = torch.from_numpy(rows).to(slots.device)
        slots[index] = slots[index, :1].expand(-1, slots.shape[1])
        self.rows_repaired += int(rows.size)
        return int(rows.size)


def for_builder(entry, builder, vllm_config) -> PromptChunks | None:
    """The repair for ``builder`` if it is a speculating Lightning builder (its ``entry`` has slot
    columns); None where none applies. On the V2 runner the builder first gets the runner's accepted
    counts (``accepted_counts.supply``); where it cannot, None, said once."""
    from gdn_pass.vllm import support

    if not entry.spec_columns or not getattr(builder, "use_spec_decode", False):
        return None
    width = 1 + int(builder.num_spec_tokens)
    if support.runs_v2_model_runner(vllm_config):
        why_not = accepted_counts.supply(builder)
        if why_not is not None:
            _say_once("v2", f"gdn-pass: vLLM {compat.vllm_version()}'s V2 model runner passes "
                      f"{type(builder).__name__} no accepted counts, and gdn-pass cannot pass them: {why_not}. "
                      f"Its speculating rows run on the prefill path, which keeps rejected drafts in the state "
                      f"(vLLM's own; gdn-pass guards fresh rows only there)")
            return None
        _say_once("v2-supplied", f"gdn-pass: vLLM {compat.vllm_version()}'s V2 model runner passes "
                  f"{type(builder).__name__} no accepted counts; gdn-pass passes it the ones the runner "
                  "passes GDN's builder, so its speculating rows take its speculative path")
    max_rows = int(builder.decode_cudagraph_max_bs)
    return PromptChunks(width=width, max_graph_rows=max_rows,
                        full_graphs=support.captures_full_graphs(vllm_config),
                        accepted_ones=torch.ones(max_rows, dtype=torch.int32,
                                                 device=builder.decode_state_indices_tensor.device))


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        logger.warning(message)
