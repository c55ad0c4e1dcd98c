"""A model that cannot be traced gets an error naming the construct, the model's own source
line and what to do instead, not a traceback from inside torch's tracer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoparallel import AutoParallel, TraceError


class _BranchesOnAValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        if y.sum() > 0:  # the value of a tensor as a Python condition
            y = y * 2
        return y


class _SelectsByAMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        return y[y > 0].sum()  # a data-dependent shape


class _Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x)  # fed the wrong width


@pytest.mark.parametrize(
    "model,width,construct,line",
    [
        (_BranchesOnAValue, 8, "reads the value of a tensor", "if y.sum() > 0:"),
        (_SelectsByAMask, 8, "output shape depends on the data", "return y[y > 0].sum()"),
        (_Linear, 16, "RuntimeError: a and b must have same reduction dim", "self.linear(x)"),
    ],
)
def test_an_untraceable_model_names_its_line(fake_mesh, model, width, construct, line):
    mesh = fake_mesh((2,))
    with pytest.raises(TraceError) as raised:
        with AutoParallel(model(), lambda: torch.randn(4, width), mesh):
            pass
    message = str(raised.value)
    assert f"cannot trace {model.__name__}: " in message
    assert construct in message
    assert "test_trace_errors.py:" in message and line in message
    assert raised.value.__cause__ is not None  # torch's own exception stays attached
