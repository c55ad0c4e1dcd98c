"""Uneven shards: which placements the planner offers, and each rank's local piece."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from autoparallel.runtime.shards import wrap_shard
from autoparallel.strategies.rules import all_shard_replicate, shardable
from autoparallel.types.tensors import local_shape, local_shape_at


@pytest.mark.parametrize(
    "placements, shape, mesh_shape, offered",
    [
        ((Shard(0),), (50257, 8), (4,), True),  # 12565 x 3 + 12562
        ((Shard(0),), (255, 8), (4,), True),  # 64, 64, 64, 63
        ((Shard(0),), (5, 8), (4,), False),  # 2, 2, 1, 0: a rank without a piece
        ((Shard(0),), (3, 8), (4,), False),  # fewer rows than ranks
        ((Shard(0),), (33, 8), (2,), False),  # 17 and 16: too small to be worth offering
        ((Shard(0),), (193, 8), (4,), False),  # 49 x 3 + 46: pieces under 64
        ((Shard(0), Shard(0)), (6, 8), (2, 2), False),  # nested uneven pieces
        ((Shard(0), Shard(0)), (8, 8), (2, 2), True),
        ((Replicate(), Shard(1)), (4, 129), (2, 2), True),
    ],
)
def test_the_planner_offers_uneven_shards_that_leave_no_rank_empty(
    placements, shape, mesh_shape, offered
):
    assert shardable(placements, shape, mesh_shape) == offered


def test_every_combination_offered_for_an_odd_dimension_shards_it():
    combos = all_shard_replicate((129, 4), (2,))
    assert (Shard(0),) in combos and (Shard(1),) in combos and (Replicate(),) in combos


def test_each_rank_holds_its_torch_chunk_piece():
    placements, mesh_shape = (Replicate(), Shard(0)), (2, 4)
    rows = [local_shape_at((50257, 64), placements, mesh_shape, (0, i))[0] for i in range(4)]
    assert rows == [12565, 12565, 12565, 12562]
    assert [len(c) for c in torch.arange(50257).chunk(4)] == rows
    assert local_shape((50257, 64), placements, mesh_shape) == (12565, 64)  # what is priced


def test_a_local_piece_wraps_to_the_global_shape_it_came_from(fake_mesh):
    mesh = fake_mesh((4,))  # this process is rank 0: it holds 3 of 10 rows
    full = torch.arange(40.0).view(10, 4)
    local = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).to_local()
    wrapped = wrap_shard(local, mesh, (Shard(0),), (10, 4))
    assert tuple(wrapped.shape) == (10, 4) and tuple(wrapped.stride()) == (4, 1)
    assert tuple(wrap_shard(local, mesh, (Shard(0),), (12, 4)).shape) == (12, 4)  # even
