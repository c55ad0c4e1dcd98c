"""Shared fixtures: meshes on torch's fake process group (nothing communicates)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def fake_mesh():
    """Factory: ``fake_mesh((2, 4), ("dp", "tp"))`` -> a DeviceMesh on a fake process group."""
    created = []

    def make(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
        created.append(True)
        return init_device_mesh("cpu", shape, mesh_dim_names=names)

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def meta(factory):
    """Build a model on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return factory()
