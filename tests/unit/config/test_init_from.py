"""Issue 45, item 5: `model.init_from` in the run config. A run that starts from a model takes
that model's fields as the [model] section's defaults (as a preset gives them); it may change
only what a resumed run may (dropout, max_seq_len, init_std); another value of a field that
shapes the parameters or the function is one error naming it. A run's saved config, which holds
every field, loads back as it is."""

from __future__ import annotations

import pytest
import torch

from megabeta.checkpoint.export import initial_model_config
from megabeta.config import load_config, save_config
from megabeta.model import ConfigError, ModelConfig
from support.hf_helpers import save_export
from support.model_helpers import tiny_model

SOURCE = ModelConfig(vocab_size=300, d_model=48, hidden_dim=80, num_heads=3, num_layers=2,
                     block_size=8, depth_window=1, max_seq_len=96, qk_norm=True)


def read(path: str) -> ModelConfig:
    assert path == "hub/model"
    return SOURCE


def test_the_model_fields_come_from_the_source():
    config = load_config(None, ["--model.init_from=hub/model", "--data.seq_len=64"],
                         read_model=read)
    assert config.model.identity() == SOURCE.identity()
    assert config.model.init_from == "hub/model"


def test_resumable_fields_may_change_and_vocab_minus_one_is_no_change():
    config = load_config(None, ["--model.init_from=hub/model", "--model.max_seq_len=256",
                                "--model.dropout=0.1", "--model.vocab_size=-1",
                                "--data.seq_len=200"], read_model=read)
    assert (config.model.max_seq_len, config.model.dropout) == (256, 0.1)
    assert config.model.vocab_size == 300 and config.model.d_model == 48


def test_a_field_that_shapes_the_model_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"model.d_model = 64, but the model in "
                       r"model.init_from = 'hub/model' has 48.*leave it out"):
        load_config(None, ["--model.init_from=hub/model", "--model.d_model=64",
                           "--model.num_layers=2"], read_model=read)
    with pytest.raises(ConfigError, match="both give the model's shape"):
        load_config(None, ["--model.init_from=hub/model", "--model.preset=beta_1.2_test"],
                    read_model=read)


def test_the_source_is_validated_with_the_run():
    """The run's checks see the source's shape: data.seq_len against its max_seq_len."""
    with pytest.raises(ConfigError, match="data.seq_len = 128: exceeds model.max_seq_len = 96"):
        load_config(None, ["--model.init_from=hub/model", "--data.seq_len=128"],
                    read_model=read)


def test_a_saved_config_loads_back_without_reading_the_source(tmp_path):
    config = load_config(None, ["--model.init_from=hub/model", "--data.seq_len=64"],
                         read_model=read)
    save_config(config, tmp_path / "config.toml")
    assert load_config(tmp_path / "config.toml") == config


def test_the_real_reader_takes_every_kind_and_names_the_key(tmp_path):
    model = tiny_model(torch.float32, vocab_size=50, d_model=24, num_heads=2)
    export = save_export(model, tmp_path / "m.safetensors")
    config = load_config(None, [f"--model.init_from={export}", "--data.seq_len=32"],
                         read_model=initial_model_config)
    assert config.model.identity() == model.config.identity()
    with pytest.raises(ConfigError, match=r"model.init_from = '.*missing': no "
                       "such file"):
        load_config(None, [f"--model.init_from={tmp_path / 'missing'}"],
                    read_model=initial_model_config)
