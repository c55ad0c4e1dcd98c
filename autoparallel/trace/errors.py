"""Why a model could not be traced, in the user's terms.

Tracing runs the model's forward and backward on fake tensors, which have shapes but no
values. What fails there fails deep inside torch, with a traceback through the tracer; the
user needs the construct that cannot be traced, the line of *their* model that uses it, and a
way out. :func:`trace_error` builds that from the exception.
"""

from __future__ import annotations

import os
import traceback
import types

import torch
from torch import nn

from autoparallel import _torch_internals as internals

_TORCH_DIR = os.path.dirname(torch.__file__)
_OUR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODELS_DIR = os.path.join(_OUR_DIR, "models")
_STDLIB_DIR = os.path.dirname(os.__file__)


class TraceError(RuntimeError):
    """The model cannot be traced into a joint graph. The message names the construct, the
    model's source line (file:line, function, code) and what to do instead; the original
    exception is the ``__cause__``."""


def trace_error(exc: BaseException, model: nn.Module) -> TraceError:
    """A :class:`TraceError` explaining ``exc``, raised while tracing ``model``."""
    what, hint = _construct(exc)
    where = _model_frame(exc)
    lines = [f"cannot trace {type(model).__name__}: {what}"]
    if where is not None:
        lines.append(
            f"  at {where.filename}:{where.lineno}, in {where.name}: {(where.line or '').strip()}"
        )
    lines.append(f"  {hint}")
    return TraceError("\n".join(lines))


def _construct(exc: BaseException) -> tuple[str, str]:
    """(what the model did, how to avoid it) for the kinds of failure tracing knows."""
    if isinstance(exc, internals.DATA_DEPENDENT_VALUE_ERRORS):
        return (
            "the forward reads the value of a tensor in Python (bool(t), t.item(), `if t:`, "
            "a comparison used as a condition); tracing sees shapes, not values",
            "compute both branches and select with torch.where, or move the check out of "
            "forward (a value known before tracing can be a Python number)",
        )
    if isinstance(exc, internals.DATA_DEPENDENT_SHAPE_ERRORS):
        return (
            "an op whose output shape depends on the data (nonzero, masked_select, unique, "
            "indexing with a boolean mask)",
            "keep shapes static: multiply by the mask or use torch.where instead of "
            "selecting elements",
        )
    message = str(exc).strip().splitlines()
    first = message[0] if message else type(exc).__name__
    return (
        f"{type(exc).__name__}: {first}",
        "check that input_fn() returns the GLOBAL inputs the model expects (shapes, dtypes, "
        "keyword names) and that the forward runs on them outside autoparallel",
    )


def _model_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the model's own code (neither torch, autoparallel nor the
    standard library) in ``exc``'s traceback or those of its causes."""
    found = None
    for tb in _tracebacks(exc):
        for frame in traceback.extract_tb(tb):
            if not _is_library(frame.filename):
                found = frame
    return found


def _tracebacks(exc: BaseException) -> list[types.TracebackType]:
    chain: list[types.TracebackType] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current.__traceback__ is not None:
            chain.append(current.__traceback__)
        current = current.__cause__ or current.__context__
    return list(reversed(chain))  # the original failure last, so its frames win


def _is_library(filename: str) -> bool:
    """Torch, autoparallel (but for its reference models), the standard library, and code
    generated at run time (``<string>``, FX's ``<eval_with_key>``)."""
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR + os.sep):
        return True
    if path.startswith(_OUR_DIR + os.sep):
        return not path.startswith(_MODELS_DIR + os.sep)
    return path.startswith(_STDLIB_DIR + os.sep) and "site-packages" not in path
