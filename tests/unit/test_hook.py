"""``import hf_specdec`` patches `generate` visibly and reversibly: same signature, a docstring and a repr that say
so, and `hf_specdec.uninstall()` restores transformers' own."""

import inspect

import torch
from transformers.generation import GenerationMixin

import hf_specdec
from hf_specdec.generation.hook import _ORIGINAL
from hf_specdec.testing import tiny_causal_lm


def test_patched_generate_keeps_the_signature_and_says_what_it_does():
    patched = GenerationMixin.generate
    assert patched is not _ORIGINAL
    assert inspect.signature(patched) == inspect.signature(_ORIGINAL)
    assert "assistant=" in patched.__doc__ and "hf_specdec.uninstall()" in patched.__doc__
    assert _ORIGINAL.__doc__ in patched.__doc__
    assert "hf_specdec" in repr(patched)
    model = tiny_causal_lm("llama")
    assert inspect.signature(model.generate) == inspect.signature(_ORIGINAL.__get__(model))


def test_uninstall_restores_the_original_and_install_patches_again():
    model = tiny_causal_lm("llama")
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    expected = model.generate(ids, max_new_tokens=5, do_sample=False)
    try:
        hf_specdec.uninstall()
        assert GenerationMixin.generate is _ORIGINAL
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), expected)
    finally:
        hf_specdec.install()
    assert GenerationMixin.generate is not _ORIGINAL
    hf_specdec.install()  # idempotent
    out = model.generate(ids, max_new_tokens=5, do_sample=False, assistant=hf_specdec.NgramAssistant())
    assert torch.equal(out, expected)
