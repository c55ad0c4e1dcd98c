"""Shared fixtures: meshes on torch's fake process group (nothing communicates), and gloo
ranks shared by the multi-rank checks of one test process (an xdist worker)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autoparallel.runtime.launch import RankPool
from autoparallel.runtime.launch import fake_mesh as mesh_on_fake_group

# The files whose tests take longest, longest first (`make test --durations`): run first, so
# that the two workers of `make test` (a file per worker at a time) do not end with one of
# them alone on a long file. Files not listed keep their order, after these.
LONGEST_FILES = (
    "test_runtime_compiled.py",
    "test_runtime.py",
    "test_solver_reductions.py",
    "test_hf_families.py",
    "test_hf_training.py",
    "test_pipeline.py",
    "test_init_weights.py",
    "test_plan_llama.py",
    "test_report_cli.py",
    "test_mesh_search.py",
    "test_soak.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))


# the runtime cases' checks assert in a helper module: let pytest explain their failures
pytest.register_assert_rewrite("helpers")


@pytest.fixture
def fake_mesh():
    """Factory: ``fake_mesh((2, 4), ("dp", "tp"))`` -> a DeviceMesh on a fake process group."""
    created = []

    def make(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
        created.append(True)
        return mesh_on_fake_group(shape, names)

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world_size)`` -> a :class:`RankPool` of that size, started on first use and
    shared by every test of this process: starting ranks, and importing what the checks
    import in them, costs seconds per rank. A pool stops its ranks after any failed check,
    so the next check starts fresh ones (runtime/launch.py)."""
    pools: dict[int, RankPool] = {}

    def pool(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield pool
    for each in pools.values():
        each.close()


def meta(factory):
    """Build a model on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return factory()


@pytest.fixture(scope="session")
def references():
    """``references(model_name)`` -> the single-device training run of a runtime-case model
    (helpers/runtime_cases.reference_of), computed once per test process."""
    from helpers.runtime_cases import reference_of

    cache: dict[str, dict] = {}

    def get(model_name: str) -> dict:
        if model_name not in cache:
            cache[model_name] = reference_of(model_name)
        return cache[model_name]

    return get
