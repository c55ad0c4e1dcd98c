"""Gloo groups with one worker thread: torch's default gloo groups (two workers) corrupt the
heap when two collectives of one group finish at once (runtime/gloo.py), so the launch
helpers start groups with one worker and ``apply_placement`` refuses the others."""

from __future__ import annotations

import torch.distributed as dist
from helpers.gloo_cases import apply_on_default_gloo, worker_threads_of_groups

from autoparallel import serial_gloo_backend
from autoparallel.runtime.gloo import SERIAL_GLOO, check_process_groups


def test_every_group_of_a_launched_rank_has_one_worker_thread(ranks):
    for threads in ranks(2).run(worker_threads_of_groups):
        assert threads == {"default": 1, "new_group": 1, "mesh dp": 1, "mesh tp": 1}


def test_apply_placement_refuses_a_mesh_of_default_gloo_groups(ranks):
    for message in ranks(2).run(apply_on_default_gloo):
        assert message is not None, "a mesh of two-worker gloo groups was applied"
        assert "'dp'" in message and "serial_gloo_backend()" in message


def test_the_backend_is_registered_once_and_named_for_init_process_group():
    assert serial_gloo_backend() == serial_gloo_backend() == SERIAL_GLOO
    assert SERIAL_GLOO in dist.Backend.backend_list
    # a group asks for it by name: plain CPU groups keep torch's default backend
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"


def test_planning_meshes_on_the_fake_group_pass_the_check(fake_mesh):
    check_process_groups(fake_mesh((2, 2), ("dp", "tp")))  # raises where it refuses
