"""The ``unison`` command line: ``unison train [CONFIG.yaml] [--key=value ...]``.

Each command is a config dataclass and a function taking it, both imported only when that command is
named, so a command's heavy imports (torch, transformers) never slow down or break another. A config
error prints ``error: <message>`` and exits with status 2, an input that cannot be used (a missing model or data
file, a used output_dir) the same with status 1; neither prints a traceback.
"""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from unison.config import ConfigError, InputError, load_config

USAGE = "usage: unison <command> [CONFIG.yaml] [--key=value ...]"


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    config: str  # "module:ConfigClass"
    run: str  # "module:function", called with the loaded config


COMMANDS = {c.name: c for c in (
    Command("train", "GRPO post-training", "unison.train.config:TrainConfig", "unison.train.loop:train"),
    Command("serve", "a generation server that receives the trainer's weight patches", "unison.serve:ServeConfig",
            "unison.serve:serve"),
)}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``unison`` and ``python -m unison``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(_overview(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(_overview())
        for command in COMMANDS.values():
            print("\n" + command_help(command, _import(command.config)))
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"error: unknown command {args[0]!r} (commands: {', '.join(COMMANDS)})\n{USAGE}", file=sys.stderr)
        return 2
    cfg_cls = _import(command.config)
    if "-h" in args[1:] or "--help" in args[1:]:
        print(command_help(command, cfg_cls))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command(args[1:], cfg_cls, _import(command.run))


def run_command(argv: Sequence[str], cfg_cls: type, run: Callable[[Any], Any]) -> int:
    """Load ``cfg_cls`` from ``argv`` and call ``run(cfg)``; a ``ConfigError`` becomes status 2, an ``InputError``
    status 1, each one ``error:`` line."""
    try:
        run(parse_command_args(argv, cfg_cls))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def parse_command_args(argv: Sequence[str], cfg_cls: type) -> Any:
    """``[CONFIG.yaml] [--key=value | key=value ...]`` -> a ``cfg_cls`` instance. An argument that starts
    with ``-`` or contains ``=`` is an override; the one other argument is the config file."""
    path, overrides = None, []
    for arg in argv:
        if arg.startswith("-") or "=" in arg:
            overrides.append(arg)
        elif path is None:
            path = arg
        else:
            raise ConfigError(f"unexpected argument {arg!r}: give one config file, then --key=value overrides")
    return load_config(cfg_cls, path, overrides)


def command_help(command: Command, cfg_cls: type) -> str:
    """The usage of one command and every key of its config, by section, with default and doc (the same reference
    as docs/config.md: ``unison.config_doc``)."""
    from unison.config_doc import config_sections

    lines = [
        f"usage: unison {command.name} [CONFIG.yaml] [--key=value ...]",
        "",
        f"{command.summary}. CONFIG.yaml sets any of the keys below (nested sections as YAML mappings);",
        "--key=value overrides it, dotted for nested keys (--optim.lr=1e-5). Values are YAML scalars.",
    ]
    for section in config_sections(cfg_cls):
        lines += ["", f"[{section.name}]" if section.name else "top-level keys:"]
        if section.doc:
            lines.append(textwrap.fill(section.doc, width=100, initial_indent="  ", subsequent_indent="  "))
        for field in section.fields:
            lines.append(f"  {field.key}: {field.type} = {field.default}")
            if field.doc:
                lines.append(textwrap.fill(field.doc, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def _overview() -> str:
    commands = "\n".join(f"  {c.name:<10}{c.summary}" for c in COMMANDS.values())
    return f"{USAGE}\n\ncommands:\n{commands}\n\n`unison <command> --help` lists the command's config keys."


def _import(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
