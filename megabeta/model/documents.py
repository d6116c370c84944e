"""The hook between data.document_mask and the model: ids are handed over only to a model that
takes them.

With `data.document_mask = true` every batch carries its inputs' document ids, and the engines
pass them as `model(tokens, targets, documents=ids)` (spec §7). A model whose forward has no
`documents` parameter would either fail on the first step or, worse, if the ids were dropped,
train unmasked while the config says masked. `require_document_mask_support` refuses such a run
at start-up instead; the trainer and `megabeta eval` call it after building the model.
"""

from __future__ import annotations

import inspect

from torch import nn

from megabeta.model.config import ConfigError


def takes_documents(model: nn.Module) -> bool:
    """Whether `model`'s forward accepts a `documents` argument (by name)."""
    return "documents" in inspect.signature(model.forward).parameters


def require_document_mask_support(model: nn.Module, setting: str = "data.document_mask") -> None:
    """ConfigError when `setting` asks for document masking and `model` (unwrapped) cannot
    apply it."""
    if not takes_documents(model):
        raise ConfigError(f"{setting} = true needs a model that takes documents= "
                          f"({type(model).__name__}.forward has no `documents` parameter, so "
                          "attention would cross document boundaries unmasked); set "
                          f"{setting} = false, with data.align = packed or document")
