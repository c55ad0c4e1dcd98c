"""The plan as readable torch code (``autoparallel export``, :func:`to_torch_code`).

A reader of the plan, like ``report/``: :mod:`.recipe` maps the plan's placements onto
torch's own parallelization words (FSDP2, tensor-parallel styles, checkpointing) and names
what they cannot say; :mod:`.code` writes that recipe as a ``parallelize(model, mesh)``
function; :mod:`.restrict` plans again within what the styles can say.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autoparallel.export.code import TorchCode, render
from autoparallel.export.recipe import (
    ExportError,
    PlanView,
    TorchRecipe,
    Unexpressed,
    recipe_of,
    view_of_json,
)
from autoparallel.export.restrict import RestrictedPlan, plan_in_torch_styles
from autoparallel.types.plan import Plan

__all__ = [
    "ExportError",
    "PlanView",
    "RestrictedPlan",
    "TorchCode",
    "TorchRecipe",
    "Unexpressed",
    "plan_in_torch_styles",
    "to_torch_code",
    "view_of_json",
]


def to_torch_code(plan: Plan | PlanView, mp_policy: Any = None) -> TorchCode:
    """``plan`` written as a ``parallelize(model, mesh, mp_policy=None)`` function that uses
    torch only; ``.unexpressed`` lists the plan's choices torch's styles cannot write.
    ``mp_policy``: the ``MixedPrecisionPolicy`` the plan was made under (a plan JSON of
    ``autoparallel plan`` records its dtypes itself), written as the function's default."""
    view = plan if isinstance(plan, PlanView) else PlanView.of(plan)
    if mp_policy is not None:
        view = replace(
            view,
            param_dtype=_dtype(mp_policy.param_dtype),
            reduce_dtype=_dtype(mp_policy.reduce_dtype),
        )
    recipe = recipe_of(view)
    return TorchCode(render(recipe), recipe)


def _dtype(dtype: Any) -> str | None:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return None if dtype is None else str(dtype).removeprefix("torch.")
