"""The README says what the code does: its format table, its CLI flags and its ``LLM(...)`` settings.

Stale documentation is a bug a user hits first (issue 12: a flag the README promised for
``generate`` that it did not have, a help text listing half the formats, an alias table that
missed aliases), so the README's checkable claims are checked against the code here.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from kvpage.cli import build_parser
from kvpage.engine.config import EngineConfig
from kvpage.formats import available_formats, format_aliases

README = Path(__file__).resolve().parents[1] / "README.md"

#: pip's flags, not kvpage's.
NOT_KVPAGE = {"--no-deps"}


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _format_rows() -> dict[str, set[str]]:
    """``kv_cache_dtype`` -> aliases, from the README's "KV formats" table."""
    rows: dict[str, set[str]] = {}
    section = _section(README.read_text(encoding="utf-8"), "KV formats")
    table = section[section.index("| `kv_cache_dtype` |"):].split("\n\n")[0]  # the table, up to its blank line
    for line in table.splitlines()[2:]:  # past the header and the rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`([a-z0-9_]+)`", cells[0])
        assert m, f"not a format row: {line}"
        rows[m.group(1)] = set(re.findall(r"`([a-z0-9_]+)`", cells[1]))
    return rows


def test_format_table_lists_every_format_with_all_its_aliases() -> None:
    rows = _format_rows()
    assert set(rows) == set(available_formats())
    expected: dict[str, set[str]] = {name: set() for name in available_formats()}
    for alias, canon in format_aliases().items():
        expected[canon].add(alias)
    for name in available_formats():
        assert rows[name] == expected[name], f"README row of {name}: aliases {sorted(rows[name])}, code {sorted(expected[name])}"


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    out: set[str] = set()
    for action in parser._actions:
        out.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _flags(sub)
    return out


def test_every_cli_flag_in_the_readme_exists() -> None:
    flags = _flags(build_parser())
    # BooleanOptionalAction flags have a --no- form
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", README.read_text(encoding="utf-8"))) - NOT_KVPAGE
    assert mentioned, "the README mentions no flag: the pattern is broken"
    missing = sorted(f for f in mentioned if f not in flags)
    assert not missing, f"README mentions flags kvpage does not have: {missing}"


def test_flags_the_readme_says_work_for_generate_do() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    generate, serve = _flags(sub.choices["generate"]), _flags(sub.choices["serve"])
    text = README.read_text(encoding="utf-8")
    m = re.search(r"kvpage serve [^\n]*#\s*([^\n]*)as for generate", text)
    assert m, "the README's serve line no longer says which flags work as for generate"
    for flag in re.findall(r"--[a-z][a-z0-9-]*", m.group(1)):
        assert flag in generate and flag in serve, flag


def test_llm_signature_in_the_readme_names_real_settings() -> None:
    text = README.read_text(encoding="utf-8")
    m = re.search(r"`LLM\(model=None, (.*?)\)`:", text, flags=re.S)
    assert m, "the README's LLM(...) signature line is gone"
    names = re.findall(r"(?:^|,\s*|\|\s*)([a-z_]+)=", m.group(1))
    assert len(names) >= 10
    unknown = sorted(set(names) - set(EngineConfig.field_names()))
    assert not unknown, f"README's LLM(...) names settings EngineConfig does not have: {unknown}"
