"""The engine options have one source: EngineConfig's fields carry their help, the CLI flags show it, and the
README's options table is generated from it (EngineConfig.options_table())."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from pdserve.cli import add_engine_args
from pdserve.config import EngineConfig, shown_default

README = Path(__file__).resolve().parent.parent / "README.md"
REGENERATE = "replace README's options table with EngineConfig.options_table() (pdserve/config.py)"


def readme_table() -> dict[str, str]:
    """{option name: default cell} of the README's options table (a row may name several options)."""
    text = README.read_text(encoding="utf-8")
    start = text.index("| option | default | meaning |")
    rows: dict[str, str] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            rows[name] = cells[1]
    return rows


def option_rows() -> list[tuple[int, str, list[str]]]:
    """(line number, row, option names) of every README table row whose first cell names an engine option,
    wherever it stands: the options table, or a stray copy of some of its rows."""
    names = set(EngineConfig.option_names())
    rows = []
    for n, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("|"):
            first = line.strip("|").split(" | ")[0]
            if found := [x for x in re.findall(r"`([a-z_]+)`", first) if x in names]:
                rows.append((n, line, found))
    return rows


def test_readme_names_each_option_in_one_row_of_the_generated_table() -> None:
    """No duplicate rows, and none that says something else than the fields (e.g. an old copy after the table)."""
    generated = set(EngineConfig.options_table().splitlines())
    seen: dict[str, int] = {}
    for n, line, found in option_rows():
        assert line in generated, f"README.md:{n} contradicts EngineConfig's help: {line[:100]}; {REGENERATE}"
        for name in found:
            assert name not in seen, f"README.md:{n} repeats option {name} (first at line {seen[name]})"
            seen[name] = n


def test_every_field_has_help() -> None:
    for f in dataclasses.fields(EngineConfig):
        text = f.metadata.get("help")
        assert text and "|" not in text, f"EngineConfig.{f.name} needs option(..., help) without '|'"


def test_readme_table_lists_every_field_with_its_default() -> None:
    rows = readme_table()
    names = EngineConfig.option_names()
    assert not set(rows) - set(names), f"README names options that do not exist: {sorted(set(rows) - set(names))}"
    for f in dataclasses.fields(EngineConfig):
        assert f.name in rows, f"README's options table lacks {f.name}; {REGENERATE}"
        assert rows[f.name] == shown_default(f), f"README shows {f.name}={rows[f.name]}, not {shown_default(f)}"


def test_readme_table_is_generated_from_the_fields() -> None:
    assert EngineConfig.options_table() in README.read_text(encoding="utf-8"), REGENERATE


def test_cli_help_comes_from_the_fields() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    by_flag = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for f in dataclasses.fields(EngineConfig):
        action = by_flag["--" + f.name.replace("_", "-")]
        assert action.help is not None and action.help.startswith(f.metadata["help"].replace("%", "%%"))
        assert action.default == f.default
        if f.default is not None:
            assert f"(default: {shown_default(f)})" in action.help
    assert "--tokenizer" not in by_flag and "tokenizer" not in EngineConfig.option_names()
    parser.format_help()  # every help string survives argparse's %-formatting
