"""The configuration reference: every key documented in its dataclass, `--help` grouped by section, and the
committed docs/config.md what `python -m unison.config_doc` generates."""

from __future__ import annotations

import pytest

from unison.cli import COMMANDS, _import, main
from unison.config import config_fields
from unison.config_doc import DOC_PATH, config_sections, markdown


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_key_is_documented(command):
    cls = _import(COMMANDS[command].config)
    missing = [f.key for f in config_fields(cls) if not f.doc]
    assert not missing, f"unison {command}: document these fields (a comment or string under each): {missing}"


def test_help_lists_every_key_once_under_its_section(capsys):
    assert main(["train", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    cls = _import(COMMANDS["train"].config)
    headers = [line for line in lines if line.startswith("[") or line == "top-level keys:"]
    assert headers[0] == "top-level keys:" and {"[model]", "[rollout]", "[engine]", "[optim]"} <= set(headers)
    section, listed = None, []
    for line in lines:
        if line in headers:
            section = line.strip("[]") if line.startswith("[") else ""
        elif line.startswith("  ") and not line.startswith("   ") and ": " in line:
            key = line.strip().split(":", 1)[0]
            listed.append(key)
            assert key.split(".", 1)[0] == section or (section == "" and "." not in key), (key, section)
    assert sorted(listed) == sorted(f.key for f in config_fields(cls)) and len(set(listed)) == len(listed)
    assert [s.name for s in config_sections(cls)] == [h.strip("[]") if h.startswith("[") else "" for h in headers]


def test_committed_reference_is_up_to_date():
    text = markdown()
    assert "- **`rollout.min_p`** (`float`, default `0.0`): " in text and "## `unison serve`" in text
    assert DOC_PATH.is_file() and DOC_PATH.read_text() == text, (
        f"{DOC_PATH} is out of date: regenerate it with `python -m unison.config_doc`")
