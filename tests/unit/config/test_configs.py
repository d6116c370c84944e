"""The run config (megabeta/config.py): every shipped config loads, validates, and names the model
it claims; overrides, moved and renamed keys; `--help-config`.

`model.init_from`: a run that starts from a model takes that model's fields as the [model]
section's defaults (as a preset gives them); it may change only what a resumed run may (dropout,
max_seq_len, init_std); another value of a field that shapes the parameters or the function is
one error naming it. A run's saved config, which holds every field, loads back as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megabeta.checkpoint.export import initial_model_config
from megabeta.config import TrainConfig, describe_fields, load_config, save_config
from megabeta.model import ConfigError, ModelConfig, get_preset
from support import REPO
from support.hf_helpers import save_export
from support.model_helpers import tiny_model

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


def test_a_list_override_in_the_config_files_spelling() -> None:
    """`--eval.lm_eval_tasks=["a", "b"]`, as the TOML file writes a list, is that list (not the
    one task named `["a"`); comma-separated as before."""
    config = load_config(None, ['--eval.lm_eval_tasks=["hellaswag", "arc_easy"]',
                                "--data.path=a,b", "--data.weights=[0.25, 0.75]"])
    assert config.eval.lm_eval_tasks == ["hellaswag", "arc_easy"]
    assert config.data.path == ["a", "b"] and config.data.weights == [0.25, 0.75]
    with pytest.raises(ConfigError, match=r'eval.tasks = \["a",: not a TOML list'):
        load_config(None, ['--eval.tasks=["a",'])


def test_t19_flash_trains_at_the_micro_batch_an_80gb_gpu_holds() -> None:
    """configs/t19_flash.toml's micro-batch: the memory model's largest that fits 85 % of an
    80 GB GPU or a little less (kept a divisor of the global batch), never more."""
    from megabeta.model.memory import step_memory

    config = load_config(REPO / "configs" / "t19_flash.toml",
                         ["--data.path=data/corpus", "--model.vocab_size=55000"])
    step = step_memory(config.model, config.execution, config.data.seq_len,
                       param_bytes=2 if config.parallel.fsdp_param_dtype == "bf16" else 4)
    largest = step.largest_batch(80e9)
    assert 1 < config.train.micro_batch <= largest < 2 * config.train.micro_batch
    assert config.train.global_batch % config.train.micro_batch == 0


def test_cuda_graphs_under_zero3_are_refused_by_name() -> None:
    """DeepSpeed ZeRO-3 gathers parameters around module calls the captured pass never makes:
    refused at start-up, naming the setting and what to use; ZeRO-1/2 are accepted."""
    graphed = ["--parallel.backend=deepspeed", "--execution.cuda_graphs=true",
               "--execution.activation_checkpoint=block"]
    with pytest.raises(ConfigError, match=r"execution\.cuda_graphs.*zero_stage = 3.*fsdp"):
        load_config(None, [*graphed, "--parallel.zero_stage=3"])
    for stage in (1, 2):
        assert load_config(None, [*graphed, f"--parallel.zero_stage={stage}"]).execution.cuda_graphs


# ---------------------------------------------------------------- model.init_from

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
