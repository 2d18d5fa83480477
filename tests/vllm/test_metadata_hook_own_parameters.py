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
