"""Session-wide fixtures: a tiny tokenized dataset shared by the training tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The virtual environment's tools first, as if it were activated, for this process and every
# child: JIT builds (the fused CPU kernels, DeepSpeed's shm op) then always run its `ninja`. Two
# ninja versions sharing a build directory discard each other's build logs and rebuild from
# scratch, about 40 s a switch between a job on the test SLURM cluster and a torchrun.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])

# Triton kernels run under Triton's CPU interpreter where no GPU is present. `@triton.jit` reads
# the variable when a kernel is defined, so it is set before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test-fast` runs `-n 2`) the workers share the cores: one intra-op
# thread each, so that two workers' OpenMP pools do not spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(dataset prefix, tokenizer .model)."""
    # Imported here: the data tools need sentencepiece, which a GPU machine running only the
    # device checks (pytest -m gpu tests) may lack.
    from support.train_helpers import build_dataset

    return build_dataset(tmp_path_factory.mktemp("tiny_data"))


@pytest.fixture
def one_torch_thread():
    """Intra-op threads at 1 for a test that trains in this process: a model this small gains
    nothing from a second thread, and on a loaded 2-core machine OpenMP's spinning threads made
    a 5-step run take 25 s instead of 1 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
