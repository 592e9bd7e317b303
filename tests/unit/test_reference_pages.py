"""The reference pages generated from the code are fresh: docs/cli.md (every ``hf-specdec`` subcommand and option, from
the argparse parsers: scripts/write_cli_reference.py) and docs/api/README.md (every public name of ``hf_specdec``
with its signature and the first paragraph of its docstring: scripts/write_api_reference.py). Each test names the
command that regenerates its page."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_is_fresh():
    writer = script("write_cli_reference")
    assert writer.OUT.read_text(encoding="utf-8") == writer.render(), (
        "docs/cli.md differs from what the hf-specdec parsers give: python scripts/write_cli_reference.py"
    )


def test_the_cli_reference_has_every_subcommand():
    from hf_specdec.cli import build_parser

    writer = script("write_cli_reference")
    text = writer.OUT.read_text(encoding="utf-8")
    for name, _help, parser in writer.subcommands(build_parser()):
        assert f"\n## hf-specdec {name}\n" in text, f"docs/cli.md has no section for hf-specdec {name}"
        for action in parser._actions:
            for flag in action.option_strings:
                if action.help != "==SUPPRESS==" and flag not in ("-h", "--help"):
                    assert f"`{flag}" in text, f"docs/cli.md does not list {name} {flag}"


def test_the_api_reference_is_fresh():
    writer = script("write_api_reference")
    assert writer.OUT.read_text(encoding="utf-8") == writer.render(), (
        "docs/api/README.md differs from the docstrings: python scripts/write_api_reference.py"
    )


def test_the_api_reference_names_every_public_name_and_stays_small():
    import hf_specdec

    text = (ROOT / "docs" / "api" / "README.md").read_text(encoding="utf-8")
    for name in hf_specdec.__all__:
        assert f"### `{name}`" in text, f"docs/api/README.md has no entry for hf_specdec.{name}"
    assert len(text.encode()) < 200_000, "the committed API reference is meant to stay small (the full one: pdoc)"
