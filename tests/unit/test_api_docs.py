"""The API reference (scripts/build_api_docs.sh, pdoc) has something to say about every public name: each name of
``hf_specdec.__all__`` has a docstring, `SpecStats` documents every field, and the examples of the package's
docstring (the reference's front page: writing your own proposer, `register_assistant_resolver`) run as written."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

import hf_specdec
from hf_specdec.assistants import available_assistants
from hf_specdec.generation.proposers import _RESOLVERS

PUBLIC = [*hf_specdec.__all__, "assistants.available_assistants"]


def public(name: str):
    return available_assistants if name == "assistants.available_assistants" else getattr(hf_specdec, name)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_has_a_docstring(name):
    doc = inspect.getdoc(public(name)) or ""
    assert len(doc) >= 60, f"hf_specdec.{name} has no docstring worth reading: {doc!r}"


def test_spec_stats_documents_every_field_and_rate():
    doc = inspect.getdoc(hf_specdec.SpecStats)
    for field in dataclasses.fields(hf_specdec.SpecStats):
        assert re.search(rf"\b{field.name}\b", doc), f"SpecStats' docstring does not describe {field.name}"
    for rate in ("tau", "acceptance_rate", "per_depth_acceptance"):
        assert rate in doc


def docstring_examples(doc: str) -> list[str]:
    """The literal blocks of a docstring (indented text after a line ending in ``::``), dedented."""
    blocks = re.findall(r"::\n\n((?:(?: {4,}.*)?\n)+)", doc + "\n")
    return [inspect.cleandoc("\n" + b) + "\n" for b in blocks]


def test_the_package_docstring_examples_run(monkeypatch):
    from hf_specdec.testing import tiny_causal_lm

    blocks = docstring_examples(hf_specdec.__doc__)
    assert len(blocks) >= 2, "the package docstring lost its examples"
    monkeypatch.setattr("hf_specdec.generation.proposers._RESOLVERS", list(_RESOLVERS))  # the example registers one
    model = tiny_causal_lm()
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5]])
    vanilla = model.generate(ids, max_new_tokens=16, do_sample=False, assistant=None)
    namespace = {"model": model, "ids": ids}
    for i, code in enumerate(blocks):
        exec(compile(code, f"hf_specdec docstring example {i + 1}", "exec"), namespace)  # noqa: S102
        assert torch.equal(namespace["out"], vanilla), "the example's output differs from vanilla generate"
