#!/usr/bin/env python
"""Writes docs/cli.md, the command-line reference, from the argparse parsers of ``hf-specdec``
(`hf_specdec.cli.build_parser`): every subcommand with its usage line, its description and a table of its options.

    python scripts/write_cli_reference.py            # rewrite docs/cli.md
    python scripts/write_cli_reference.py --check    # exit 1 if docs/cli.md differs from what the parsers give

tests/unit/test_cli_vocabulary.py fails when docs/cli.md is stale."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts.generated_page import write_or_check  # noqa: E402

OUT = ROOT / "docs" / "cli.md"
WIDTH = 100  # argparse's usage lines are wrapped at this width, whatever the terminal

HEADER = """\
# Command-line reference

Every `hf-specdec` subcommand with its options, as `hf-specdec COMMAND --help` prints them. This page is generated
from the command's argparse parsers by `python scripts/write_cli_reference.py`; a test fails when it is stale.
The same flag means the same thing on every subcommand, spelled as transformers' `generate()` arguments: `--model`,
`--device`, `--dtype`, `--threads`, `--max-new-tokens`, `--do-sample`, `--temperature`, `--top-p`, `--seed`.
How to use the commands: [usage.md](usage.md) (`generate`, `bench`), [heads_training.md](heads_training.md)
(`train`, `eval-heads`), [serving.md](serving.md) (`export`); the terms (τ, acceptance): [glossary.md](glossary.md#tau-τ).
"""


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(full name, one-line help, parser)`` of every leaf subcommand, in the order ``--help`` lists them."""
    out = []
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, sub in action.choices.items():
            full = f"{prefix}{name}"
            nested = subcommands(sub, full + " ")
            out += nested or [(full, helps.get(name, ""), sub)]
    return out


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def option_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            if action.nargs == 0:
                names = ", ".join(f"`{s}`" for s in action.option_strings)
            else:
                metavar = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
                names = ", ".join(f"`{s} {metavar}`" for s in action.option_strings)
        else:
            names = f"`{formatter._format_args(action, formatter._get_default_metavar_for_positional(action))}`"
        text = formatter._expand_help(action) if action.help else ""
        if action.required and action.option_strings:
            text = f"required. {text}"
        rows.append(f"| {cell(names)} | {cell(text)} |")
    return rows


def usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def render() -> str:
    from hf_specdec.cli import build_parser

    parser = build_parser()
    parser.prog = "hf-specdec"
    commands = subcommands(parser)
    lines = [HEADER, "| command | what it does |", "|---|---|"]
    lines += [f"| [`{name}`](#hf-specdec-{name.replace(' ', '-')}) | {cell(text)} |" for name, text, _ in commands]
    lines += ["", "`hf-specdec --version` prints the version; `hf-specdec --help` lists the commands.", ""]
    for name, text, sub in commands:
        lines += [f"## hf-specdec {name}", ""]
        description = " ".join((sub.description or text).split())
        lines += [description, "", "```text", usage(sub), "```", ""]
        rows = option_rows(sub)
        if rows:
            lines += ["| option | what it does |", "|---|---|", *rows, ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(OUT, ROOT, render, "write_cli_reference.py", __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
