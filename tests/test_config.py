from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from unison.config import ConfigError, config_fields, config_to_dict, dump_config, load_config
from unison.serve import ServeConfig
from unison.train.config import TrainConfig


@dataclass
class Optim:
    lr: float = 1e-6
    # peak learning rate
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")


@dataclass
class Loss:
    is_mode: Literal["mask", "truncate"] = "mask"
    """what to do with tokens whose importance ratio leaves [is_min, is_max]"""
    is_max: float | None = None
    eps: float = 0.2  # PPO clip


@dataclass
class Lora:
    rank: int = 8


@dataclass
class Run:
    max_steps: int = 100
    run_name: str = "run"
    bf16: bool = True
    eos_ids: list[int] = field(default_factory=list)
    shape: tuple[int, ...] = (1, 2)
    weights: dict[str, float] = field(default_factory=dict)
    seed: int | str = 0
    optim: Optim = field(default_factory=lambda: Optim(lr=1e-5))  # not the class default: must be kept
    loss: Loss = field(default_factory=Loss)
    lora: Lora | None = None


@dataclass
class Required:
    model: str
    steps: int = 1


def write(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_and_partial_section_keeps_parent_default(tmp_path):
    cfg = load_config(Run)
    assert cfg == Run() and cfg.optim.lr == 1e-5
    cfg = load_config(Run, write(tmp_path, "optim:\n  weight_decay: 0.1\n"))
    assert cfg.optim == Optim(lr=1e-5, weight_decay=0.1)


def test_yaml_then_overrides_in_order(tmp_path):
    path = write(tmp_path, "max_steps: 5\noptim:\n  lr: 2.0e-6\nloss:\n  is_mode: truncate\n")
    cfg = load_config(Run, path, ["--max_steps=10", "optim.lr=1e-5", "--optim.lr=3e-5", "--loss.is_max=2"])
    assert cfg.max_steps == 10
    assert cfg.optim.lr == 3e-5 and isinstance(cfg.optim.lr, float)
    assert cfg.loss.is_mode == "truncate"
    assert cfg.loss.is_max == 2.0 and isinstance(cfg.loss.is_max, float)  # int accepted for float


def test_scalar_types_and_containers():
    cfg = load_config(Run, None, [
        "--bf16=false", "--eos_ids=[1, 2]", "--shape=[3, 4, 5]", "--weights={a: 1, b: 0.5}",
        "--loss.is_max=null", "--optim.betas=[0.8, 0.9]", "--run_name=2024", "--seed=abc",
    ])
    assert cfg.bf16 is False
    assert cfg.eos_ids == [1, 2]
    assert cfg.shape == (3, 4, 5)
    assert cfg.weights == {"a": 1.0, "b": 0.5}
    assert cfg.loss.is_max is None
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.run_name == "2024"  # a str field takes the text as typed
    assert load_config(Run, None, ["--run_name='a b'"]).run_name == "a b"  # YAML quotes still apply
    assert cfg.seed == "abc" and load_config(Run, None, ["--seed=7"]).seed == 7  # int | str: int first


def test_optional_section_created_by_override():
    assert load_config(Run).lora is None
    assert load_config(Run, None, ["--lora.rank=4"]).lora == Lora(rank=4)
    assert load_config(Run, None, ["--lora={}"]).lora == Lora()


@pytest.mark.parametrize("override, message", [
    ("--optim.lrr=1", "unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    ("--max_step=1", "unknown key 'max_step' (did you mean 'max_steps'?)"),
    ("--lr=1", "unknown key 'lr' (did you mean 'optim.lr'?)"),
    ("--optim.lr=abc", "bad value for 'optim.lr': expected float, got 'abc'"),
    ("--loss.is_mode=foo", "'loss.is_mode' must be one of ['mask', 'truncate'], got 'foo'"),
    ("--max_steps=1.5", "bad value for 'max_steps': expected int, got 1.5"),
    ("--max_steps=true", "bad value for 'max_steps': expected int, got True"),
    ("--bf16=1", "bad value for 'bf16': expected bool, got 1"),
    ("--optim.lr=true", "bad value for 'optim.lr': expected float, got True"),
    ("--eos_ids=[1, x]", "bad value for 'eos_ids[1]': expected int, got 'x'"),
    ("--eos_ids=3", "bad value for 'eos_ids': expected list[int], got 3"),
    ("--optim.betas=[0.9]", "bad value for 'optim.betas': expected 2 items, got 1"),
    ("--loss.is_max=big", "bad value for 'loss.is_max': expected float, got 'big'"),
    ("--seed=[1]", "bad value for 'seed': expected int | str, got [1]"),
    ("--optim=3", "bad value for 'optim': expected a mapping of keys, got 3"),
    ("--optim.lr=-1", "optim: lr must be >= 0, got -1.0"),
    ("--max_steps", "bad override '--max_steps': expected --key=value"),
    ("--=3", "bad override '--=3'"),
])
def test_override_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(Run, None, [override])
    assert message in str(err.value)


def test_yaml_errors_name_the_key_or_file(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'loss.is_mod' \(did you mean 'loss.is_mode'\?\)"):
        load_config(Run, write(tmp_path, "loss:\n  is_mod: mask\n"))
    with pytest.raises(ConfigError, match="bad value for 'optim': expected a mapping of keys, got 5"):
        load_config(Run, write(tmp_path, "optim: 5\n"))
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"config file not found: {missing}"):
        load_config(Run, str(missing))
    with pytest.raises(ConfigError, match="top level must be a mapping of keys, got list"):
        load_config(Run, write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="duplicate key 'max_steps' on line 2"):
        load_config(Run, write(tmp_path, "max_steps: 1\nmax_steps: 2\n"))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(Run, write(tmp_path, "max_steps: [1\n"))
    assert load_config(Run, write(tmp_path, "")) == Run()  # an empty file sets nothing


def test_missing_required_key_and_post_init_at_top_level():
    with pytest.raises(ConfigError, match="missing required key 'model'"):
        load_config(Required)
    assert load_config(Required, None, ["model=tiny"]) == Required(model="tiny")


def test_override_into_a_scalar_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot set 'optim.lr': 'optim' is 3, not a section"):
        load_config(Run, write(tmp_path, "optim: 3\n"), ["--optim.lr=1"])


def test_round_trip(tmp_path):
    cfg = load_config(Run, None, [
        "--optim.lr=3e-7", "--shape=[7]", "--loss.is_mode=truncate", "--lora.rank=2", "--weights={x: 2}",
        "--eos_ids=[5]", "--run_name=null", "--loss.is_max=inf", "--seed=1e-5",
    ])
    assert cfg.run_name == "null" and cfg.seed == "1e-5"  # strings YAML would read as other types
    plain = config_to_dict(cfg)
    assert plain["shape"] == [7] and plain["optim"]["betas"] == [0.9, 0.999] and plain["lora"] == {"rank": 2}
    path = tmp_path / "out" / "resolved.yaml"
    dump_config(cfg, path)
    assert load_config(Run, str(path)) == cfg


def test_config_fields_lists_every_key_with_default_and_doc():
    fields = {f.key: f for f in config_fields(Run)}
    assert fields["optim.lr"].default == "1e-05"  # the parent's default instance, not Optim's
    assert fields["optim.lr"].doc == "peak learning rate"
    assert fields["loss.is_mode"].type == "Literal['mask', 'truncate']"
    assert fields["loss.is_mode"].doc.startswith("what to do with tokens")
    assert fields["loss.eps"].doc == "PPO clip"
    assert fields["loss.is_max"].type == "float | None" and fields["loss.is_max"].default == "null"
    assert fields["lora"].default == "null" and fields["lora.rank"].default == "8"
    assert fields["eos_ids"].default == "[]" and fields["shape"].default == "[1, 2]"
    assert {f.key for f in config_fields(Required)} == {"model", "steps"}
    assert config_fields(Required)[0].default == "(required)"


def test_auto_model_dtype_on_every_cuda_device():
    """Under torchrun the device is ``cuda:<local rank>``: auto must still mean bf16 there (it once meant fp32,
    which the GPU's varlen attention refuses)."""
    from unison.models import model_dtype

    assert [model_dtype("auto", d) for d in ("cuda", "cuda:1", "cpu")] == ["bfloat16", "bfloat16", "float32"]
    assert model_dtype("float32", "cuda:0") == "float32"


@pytest.mark.parametrize("override, message", [
    ("--dist.tp=0", "dist.tp must be >= 1"),
    ("--dist.ready_every=0", "dist.ready_every must be >= 1"),
    ("--dist.timeout_s=0", "dist.timeout_s must be > 0"),
])
def test_dist_errors_name_the_key(override, message):
    from unison.config import load_config
    from unison.train.config import TrainConfig

    with pytest.raises(ValueError, match=message):
        load_config(TrainConfig, None, [override])


@pytest.mark.parametrize("cls, override, message", [
    (TrainConfig, "--sync.url=/shared/dir", "'sync.url' is now sync.fsspec.url"),
    (ServeConfig, "--sync_url=/shared/dir", "'sync_url' is now --sync.transport=fsspec"),
    (ServeConfig, "--sync_rank=1", "'sync_rank' is now --sync.dist.rank"),
])
def test_a_renamed_key_names_its_new_name(cls, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(cls, None, [override])
