"""The hook's ``build`` wrapper with ``build``'s own parameters (``metadata_hook._own_parameters_build``).

vLLM's runners call ``build`` by keyword; a ``*args, **kwargs`` wrapper packs each call into a
tuple and a dict and unpacks them again. The hook makes, from the signature of the ``build`` it
wraps, a wrapper with the same parameters, and keeps the generic one where the signature cannot be
reproduced. Checked here: the real builders of this vLLM get it, with their signature unchanged;
every call reaches vLLM's ``build`` with exactly the arguments it was given (defaults, keyword-only
parameters); and the signatures it must not reproduce fall back. That the deferred builds it runs
itself are guarded as before is ``test_metadata_hook_deferral``'s, which runs on these wrappers.
"""

import inspect

import pytest

from gdn_pass.vllm import builders, metadata_hook


def _parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function, follow_wrapped=False).parameters.values()]


@pytest.mark.parametrize("entry", [e for e, _ in builders.installed()], ids=lambda e: e.key)
def test_every_hooked_build_of_this_vllm_has_its_own_parameters(entry):
    metadata_hook.install()
    cls = dict(builders.installed())[entry]
    hooked = cls.__dict__["build"]
    assert getattr(hooked, builders.HOOK_MARK, False), "not hooked"
    vllm_build = builders.unhooked_build(cls)
    assert _parameters(hooked) == _parameters(vllm_build), "the wrapper's parameters are not build's"
    assert hooked.__wrapped__ is vllm_build


def _recording(calls):
    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None, fast_build=False, *,
              num_decode_draft_tokens_cpu="default"):
        calls.append((common_prefix_len, common_attn_metadata, num_accepted_tokens, fast_build,
                      num_decode_draft_tokens_cpu))
        return "metadata"
    return build


class _Unconfigured:
    """A builder the hook keeps no state for (pass not configured): every build passes through."""


def test_a_build_passes_every_argument_through_as_given():
    calls = []
    original = _recording(calls)
    wrapped = metadata_hook._own_parameters_build(None, original, generic_build=None)
    assert wrapped is not None and _parameters(wrapped) == _parameters(original)
    builder = _Unconfigured()
    assert wrapped(builder, common_prefix_len=0, common_attn_metadata="m") == "metadata"
    wrapped(builder, 3, "n", "accepted", True, num_decode_draft_tokens_cpu="drafts")
    wrapped(builder, common_attn_metadata="o", common_prefix_len=1, fast_build=True)
    expected = []
    for args, kwargs in [((), dict(common_prefix_len=0, common_attn_metadata="m")),
                         ((3, "n", "accepted", True), dict(num_decode_draft_tokens_cpu="drafts")),
                         ((), dict(common_attn_metadata="o", common_prefix_len=1, fast_build=True))]:
        original(builder, *args, **kwargs)
        expected.append(calls.pop())
    assert calls == expected
    with pytest.raises(TypeError):  # as vLLM's build itself would
        wrapped(builder, common_prefix_len=0)


def _variadic(self, *args, **kwargs): ...
def _positional_only(self, common_prefix_len, common_attn_metadata, /): ...
def _no_metadata(self, common_prefix_len, metadata): ...
def _hides_a_name(self, common_prefix_len, common_attn_metadata, state=None): ...
def _hides_a_default(self, common_prefix_len, common_attn_metadata, default_0=None): ...


@pytest.mark.parametrize("build", [_variadic, _positional_only, _no_metadata, _hides_a_name, _hides_a_default],
                         ids=lambda f: f.__name__)
def test_a_signature_it_cannot_reproduce_keeps_the_generic_wrapper(build):
    """Another plugin's ``*args, **kwargs`` wrapper, positional-only parameters, no
    ``common_attn_metadata`` (the deferral reads it by name), or a name the wrapper's own code uses."""
    assert metadata_hook._own_parameters_build(None, build, generic_build=None) is None


def test_a_wrapper_that_cannot_be_made_leaves_the_generic_one(monkeypatch):
    """The hook is installed in every vLLM process: a wrapper whose making fails must not stop it."""
    monkeypatch.setattr(metadata_hook, "_OWN_PARAMETERS_TEMPLATE", "def make(:\n")
    calls = []
    assert metadata_hook._own_parameters_build(None, _recording(calls), generic_build=None) is None


def test_a_build_checked_at_once_runs_in_the_wrapper_alone(monkeypatch):
    """A build the hook does not defer and that changes nothing before vLLM's (the step guard's
    groups: eager engines, the Lightning builders) checks its step in the own-parameters wrapper:
    no generic wrapper, no ``_guard_step``; a step with a new row is still zeroed at build, and a
    step without one gets the builder's hand-off of such steps, nothing zeroed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_metadata_hook import step_of
    from test_step_guard import FRESH_SLOT, LAYERS, NUM_SLOTS, engine

    from gdn_pass.vllm.handoff import handoff_of

    builder, layers = engine(monkeypatch, compiled=False)
    state = metadata_hook.state_of(builder)
    if state.keeps_decodes:
        pytest.skip("this release's GDN builder reroutes fresh rows itself (0.31+): gdn-pass keeps its "
                    "one-token steps on the decode path, through the generic wrapper")
    monkeypatch.setattr(metadata_hook, "_guard_step", lambda *a: pytest.fail("_guard_step called"))
    fresh = builder.build(common_prefix_len=0, common_attn_metadata=step_of([9, 0, 30], [1, 1, 1], [3, 4, 5]))
    assert handoff_of(fresh).zeroed_at_build and handoff_of(fresh).host_fresh == 1
    for layer in layers.values():
        for cache in layer.kv_cache:
            others = [s for s in range(NUM_SLOTS) if s != FRESH_SLOT]
            assert cache[FRESH_SLOT].eq(0).all() and not cache[others].eq(0).all(dim=-1).any()
            cache[FRESH_SLOT].fill_(6.0)
    idle = builder.build(common_prefix_len=0, common_attn_metadata=step_of([10, 1, 31], [1, 1, 1], [3, 4, 5]))
    assert handoff_of(idle) is state.idle and handoff_of(idle).host_fresh == 0
    assert all(not cache.eq(0).any() for name in LAYERS for cache in layers[name].kv_cache), "zeroed a slot"
    # A later step with a new row: checked once (the check can recompute the step's rows), then zeroed.
    checks = []
    real_check = metadata_hook.has_new_rows
    monkeypatch.setattr(metadata_hook, "has_new_rows", lambda common: checks.append(common) or real_check(common))
    again = builder.build(common_prefix_len=0, common_attn_metadata=step_of([11, 0, 32], [1, 1, 1], [3, 4, 5]))
    assert len(checks) == 1, f"the step was checked {len(checks)} times in one build"
    assert handoff_of(again).zeroed_at_build and handoff_of(again).host_fresh == 1
    assert all(cache[FRESH_SLOT].eq(0).all() for name in LAYERS for cache in layers[name].kv_cache)
