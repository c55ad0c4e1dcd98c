"""Leaving the process groups: after ``shutdown_distributed`` no gloo collective thread of
the rank is left running, so none can outlive the interpreter and abort its exit (see
runtime/shutdown.py), even though torch's caches keep the mesh a trained module used."""

from __future__ import annotations

from helpers.fault_cases import train_then_shut_down

from autoparallel import shutdown_distributed
from autoparallel.runtime.launch import run_distributed


def test_shutdown_joins_every_collective_thread():
    for before, after in run_distributed(train_then_shut_down, 2, timeout_s=300):
        assert "pt_gloo_runloop" in before  # there were threads to stop
        assert after == []


def test_shutdown_without_a_process_group_does_nothing():
    assert shutdown_distributed() == []
