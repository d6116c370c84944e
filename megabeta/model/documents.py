"""Document ids in packed samples (spec §7): what the model makes of them, and the hook between
data.document_mask and the model.

`model(tokens, targets, documents=ids)` bounds every query's key set below by the first
position of its document; `document_starts` turns ids into those positions once per pass, and
each cell reads a view of them (`attention.backend.Reads.lower`).

With `data.document_mask = true` every batch carries its inputs' document ids, and the engines
pass them on. A model whose forward has no `documents` parameter would either fail on the first
step or, worse, if the ids were dropped, train unmasked while the config says masked.
`require_document_mask_support` refuses such a run at start-up instead; the trainer and
`megabeta eval` call it after building the model.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

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


def document_starts(documents: Tensor | None, tokens: Tensor) -> Tensor | None:
    """The first position of each token's document `[B, T]` int64 (spec §7: every key set is
    bounded below by it), from document ids `[B, T]`, non-decreasing along each sample; None
    for None. A malformed `documents` is a ValueError that says what is wrong."""
    if documents is None:
        return None
    if documents.shape != tokens.shape:
        raise ValueError(f"documents= has shape {tuple(documents.shape)}, the tokens "
                         f"{tuple(tokens.shape)}: pass one document id per token")
    if documents.dtype.is_floating_point or documents.dtype.is_complex or \
            documents.dtype == torch.bool:
        raise ValueError(f"documents= must be integer document ids, not {documents.dtype}")
    documents = documents.to(tokens.device)
    length = tokens.shape[1]
    new = torch.ones_like(documents, dtype=torch.bool)
    if length > 1:
        step = documents[:, 1:] - documents[:, :-1]
        # Fake tensors have no values to check (`megabeta bench kernels` compiles the masked
        # kernels from a fake step).
        if not is_fake(step) and bool((step < 0).any()):
            sample, position = (step < 0).nonzero()[0].tolist()
            raise ValueError(f"documents= must be non-decreasing along each sample (documents "
                             f"are contiguous, spec §7): sample {sample} goes from id "
                             f"{int(documents[sample, position])} to "
                             f"{int(documents[sample, position + 1])} at position {position + 1}")
        new[:, 1:] = step != 0
    positions = torch.arange(length, device=tokens.device).expand_as(documents)
    return torch.where(new, positions, 0).cummax(dim=1).values


def padded_starts(starts: Tensor | None, length: int) -> Tensor | None:
    """`starts [B, T]` extended to `length` tokens, each padding token a document of its own
    (it reads only itself; its outputs are dropped)."""
    if starts is None or starts.shape[1] >= length:
        return starts
    tail = torch.arange(starts.shape[1], length, device=starts.device)
    return torch.cat([starts, tail.expand(starts.shape[0], -1)], dim=1)
