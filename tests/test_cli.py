from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from typing import Literal

import pytest

from unison import cli
from unison.cli import Command, command_help, main, parse_command_args, run_command
from unison.config import ConfigError, InputError


@dataclass
class Optim:
    lr: float = 1e-6
    # peak learning rate


@dataclass
class Toy:
    max_steps: int = 3
    mode: Literal["a", "b"] = "a"
    optim: Optim = field(default_factory=Optim)


CALLS: list[Toy] = []


def record(cfg: Toy) -> None:
    CALLS.append(cfg)


@pytest.fixture
def toy_commands(monkeypatch):
    CALLS.clear()
    toy = Command("toy", "A toy command", f"{__name__}:Toy", f"{__name__}:record")
    monkeypatch.setattr(cli, "COMMANDS", {"toy": toy})
    return toy


def test_run_command_loads_yaml_and_overrides(tmp_path):
    path = tmp_path / "toy.yaml"
    path.write_text("max_steps: 7\noptim:\n  lr: 1.0e-4\n")
    got = []
    assert run_command([str(path), "--optim.lr=2e-5", "mode=b"], Toy, got.append) == 0
    assert got == [Toy(max_steps=7, mode="b", optim=Optim(lr=2e-5))]


def test_unknown_key_exits_2_with_message_and_no_traceback(capsys):
    got = []
    assert run_command(["--optim.lrr=1"], Toy, got.append) == 2
    err = capsys.readouterr().err
    assert err == "error: unknown key 'optim.lrr' (did you mean 'optim.lr'?)\n"
    assert got == []


def test_bad_value_and_missing_file_exit_2(tmp_path, capsys):
    assert run_command(["--mode=c"], Toy, print) == 2
    assert "error: 'mode' must be one of ['a', 'b'], got 'c'" in capsys.readouterr().err
    assert run_command([str(tmp_path / "missing.yaml")], Toy, print) == 2
    assert f"error: config file not found: {tmp_path / 'missing.yaml'}" in capsys.readouterr().err


def test_one_config_file_only(tmp_path):
    with pytest.raises(ConfigError, match="unexpected argument 'b.yaml'"):
        parse_command_args(["a.yaml", "b.yaml"], Toy)


def test_command_help_lists_every_key():
    text = command_help(Command("toy", "A toy command", "", ""), Toy)
    assert text.startswith("usage: unison toy [CONFIG.yaml] [--key=value ...]")
    assert "  max_steps: int = 3\n" in text
    assert "  mode: Literal['a', 'b'] = a\n" in text
    assert "  optim.lr: float = 1e-06\n      peak learning rate" in text


def test_main_dispatches_and_helps(toy_commands, capsys):
    assert main(["toy", "--max_steps=9"]) == 0
    assert CALLS == [Toy(max_steps=9)]
    assert main(["toy", "--bogus=1"]) == 2
    assert capsys.readouterr().err == "error: unknown key 'bogus'\n"
    assert main(["toy", "--help"]) == 0
    assert "optim.lr: float = 1e-06" in capsys.readouterr().out
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "toy       A toy command" in out and "usage: unison toy" in out and "max_steps: int = 3" in out
    assert main(["nope"]) == 2
    assert "error: unknown command 'nope' (commands: toy)" in capsys.readouterr().err
    assert CALLS == [Toy(max_steps=9)]


def test_python_m_unison_exit_codes():
    proc = subprocess.run([sys.executable, "-m", "unison"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: unison <command>")
    assert "train" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "unison", "nope"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "error: unknown command 'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_input_errors_exit_1_with_one_line(capsys):
    def fails(cfg: Toy) -> None:
        raise InputError("data file /data/rows.jsonl:3 is not UTF-8 text")

    assert run_command([], Toy, fails) == 1
    assert capsys.readouterr().err == "error: data file /data/rows.jsonl:3 is not UTF-8 text\n"


def test_train_on_missing_inputs_exits_1_without_traceback(tmp_path, capsys):
    """A missing model folder, an unknown model name, an output_dir that is a file: one line naming it, status 1."""
    (tmp_path / "a_file").write_text("")
    cases = {f"--model.name_or_path={tmp_path / 'no-such-model'}": str(tmp_path / "no-such-model"),
             "--model.name_or_path=NoSuchModel": "NoSuchModel",
             f"--output_dir={tmp_path / 'a_file'}": str(tmp_path / "a_file")}
    for override, named in cases.items():
        args = ["train", f"--output_dir={tmp_path / 'run'}", override]
        assert main(args) == 1, override
        err = capsys.readouterr().err
        assert err.startswith("error: ") and named in err and "Traceback" not in err, err
