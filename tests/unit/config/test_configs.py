"""Every shipped config loads, validates, and names the model it claims."""

from __future__ import annotations

from pathlib import Path

import pytest

from megabeta.config import TrainConfig, describe_fields, load_config
from megabeta.model import ConfigError, get_preset
from support import REPO

CONFIGS = sorted((REPO / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_config_loads(path: Path) -> None:
    config = load_config(path, ["--data.path=data/corpus"])
    assert isinstance(config, TrainConfig)
    if path.stem in ("t19_flash", "beta_1.2_test", "t16_std_tf_rope", "beta_1.2_de10k2"):
        preset = get_preset(path.stem)
        assert config.model.d_model == preset.d_model
        assert config.model.num_layers == preset.num_layers
        assert config.model.arch == preset.arch


def test_overrides_are_typed_and_unknown_keys_are_named(tmp_path: Path) -> None:
    config = load_config(None, ["--optim.lr=1e-3", "--train.steps=7", "--data.path=a,b",
                                "--data.weights=0.25,0.75", "--logging.tensorboard=false",
                                "--model.preset=t19_flash", "--model.block_size=64"])
    assert (config.optim.lr, config.train.steps) == (1e-3, 7)
    assert config.data.path == ["a", "b"] and config.data.weights == [0.25, 0.75]
    assert config.logging.tensorboard is False
    assert config.model.d_model == 1600 and config.model.block_size == 64
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'; did you mean 'optim.lr'"):
        load_config(None, ["--optim.lrr=1"])
    with pytest.raises(ConfigError, match="train.steps = 'many': expected int"):
        load_config(None, ["--train.steps=many"])
    with pytest.raises(ConfigError, match="data.weights .* one weight per data.path"):
        load_config(None, ["--data.path=a,b", "--data.weights=1"])
    with pytest.raises(ConfigError, match="data.seq_len = 4096: exceeds model.max_seq_len"):
        load_config(None, ["--data.seq_len=4096"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_grad_accumulation_must_divide_the_global_batch() -> None:
    config = load_config(None, ["--train.global_batch=8", "--train.micro_batch=4"])
    assert config.grad_accumulation(1) == 2 and config.grad_accumulation(2) == 1
    with pytest.raises(ConfigError, match="train.global_batch = 8 is not a multiple"):
        config.grad_accumulation(3)


def test_every_key_is_documented() -> None:
    lines = describe_fields().splitlines()
    assert len(lines) > 60
    assert all("#" in line and line.split("#", 1)[1].strip() for line in lines), [
        line for line in lines if not line.split("#", 1)[1].strip()]


@pytest.mark.parametrize("key,value,new_place", [
    ("model.use_sdpa", "false", "execution.attention"),
    ("model.activation_checkpoint", "block", "execution.activation_checkpoint"),
    ("parallel.compile", "true", "execution.compile"),
])
def test_moved_key_names_its_new_place(key: str, value: str, new_place: str,
                                       tmp_path: Path) -> None:
    """A setting in its old place, on the command line or in a TOML file, is an error that says
    where it lives now (not a bare 'unknown key')."""
    with pytest.raises(ConfigError, match=f"{key!r} has moved: set {new_place}"):
        load_config(None, [f"--{key}={value}"])
    section, name = key.split(".")
    path = tmp_path / "old.toml"
    path.write_text(f'[{section}]\n{name} = {value if value in ("true", "false") else repr(value)}\n')
    with pytest.raises(ConfigError, match=f"{key!r} has moved: set {new_place}"):
        load_config(path)


def test_a_renamed_key_still_loads_under_its_new_name(tmp_path: Path) -> None:
    """`execution.cell_kernels` (a run's recorded config may carry it) sets
    execution.elementwise_kernels; giving both is an error naming them."""
    path = tmp_path / "old.toml"
    path.write_text('[execution]\ncell_kernels = "torch"\n')
    assert load_config(path).execution.elementwise_kernels == "torch"
    assert load_config(None, ["--execution.cell_kernels=torch"]).execution.elementwise_kernels \
        == "torch"
    with pytest.raises(ConfigError, match="'execution.cell_kernels' and "
                                          "'execution.elementwise_kernels' are the same setting"):
        load_config(path, ["--execution.elementwise_kernels=auto"])


def test_execution_section_is_apart_from_the_model() -> None:
    config = load_config(None, ["--execution.attention=reference",
                                "--execution.activation_checkpoint=block"])
    assert (config.execution.attention, config.execution.activation_checkpoint) == (
        "reference", "block")
    assert "attention" not in config.model.identity()
    with pytest.raises(ConfigError, match="execution.activation_checkpoint = 'layer': must be one"):
        load_config(None, ["--execution.activation_checkpoint=layer"])
