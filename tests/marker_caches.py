"""Caches behind a marker row, to catch a read or write one row outside a cache.

``behind_a_marker`` makes each named cache of a runner a view one row into a larger buffer
whose first row holds ``MARKER``: a load through a sentinel index (-1) left unwrapped reads
that row, and its write-back lands the marker in a slot. ``assert_only_slots_changed`` checks what
happened. Shared by ``tests/test_gated_reads.py`` (CPU) and ``tests/gpu/test_cuda_graph_replay.py``.
"""

import torch

MARKER = 777.0


def behind_a_marker(runner, names, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Give each cache ``runner.<name>`` random contents in a view behind a marker row; returns
    ``(buffer, contents before)`` per cache."""
    caches = []
    for name in names:
        cache = getattr(runner, name)
        buffer = torch.full((cache.shape[0] + 1, *cache.shape[1:]), MARKER, dtype=cache.dtype, device=cache.device)
        buffer[1:].copy_(torch.randn(cache.shape, generator=generator, device=cache.device))
        setattr(runner, name, buffer[1:])
        caches.append((buffer, buffer[1:].clone()))
    return caches


def assert_only_slots_changed(caches, allowed: list[int]) -> None:
    """The marker row is intact, no slot holds the marker, and the slots that changed are ``allowed``
    (or none)."""
    for buffer, before in caches:
        assert bool((buffer[0] == MARKER).all()), "a write went one row before the cache"
        changed = (buffer[1:] != before).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed in ([], allowed), changed
        assert not bool((buffer[1:] == MARKER).any()), "a read outside the cache was written into it"
