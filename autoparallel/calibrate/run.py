"""Run a calibration: on a launched process group (torchrun) or on N spawned local gloo ranks.

Order of work, on every rank together: the device (matmul per dtype and size, memory
bandwidth, a view op as the runtime runs it, AdamW's step on DTensor parameters) and the
first round of the figures timed in rounds (``Rounds``: the largest fp32 matmul and a skinny
one, two traced transformer blocks for the cost of an op); per mesh dim and collective, each
message size from ``min_bytes`` to ``max_bytes`` (x4 apart); how much of an all-reduce hides
behind compute; the other rounds; last, on a CPU host, the runtime's own work. Rank 0 prints one progress line per measurement and the fits with
their largest relative error. The result is one ``Hardware`` whose link figures are the
all-reduce fits (the generic figures a preset would have) and whose ``collectives`` hold every
fit; ``cost/profile.py`` writes it with the raw timings.

This module holds the order of work (what to measure is :class:`~autoparallel.calibrate.settings.CalibrationSettings`), the
collectives' and the overlap's steps, the ``Hardware`` assembled from every figure, and the
local ranks; the device's steps are in :mod:`autoparallel.calibrate.run_device`.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoparallel.calibrate import measure
from autoparallel.calibrate.fit import CollectiveSample, fit_collective
from autoparallel.calibrate.run_device import (
    Rounds,
    bytes_text,
    device_model,
    time_device,
    time_runtime,
)
from autoparallel.calibrate.settings import CalibrationSettings
from autoparallel.cost.hardware import CPU, FITTED_KINDS, CollectiveFit, Hardware
from autoparallel.cost.profile import write_profile
from autoparallel.cost.topology import Topology


@dataclass(frozen=True)
class Calibration:
    """What a calibration found: the Hardware, where it was measured, and the raw timings."""

    hardware: Hardware
    measured_on: dict[str, Any]
    samples: list[dict[str, Any]]

    def write(self, path: str | Path) -> None:
        write_profile(self.hardware, path, self.measured_on, self.samples)


def calibrate_group(
    settings: CalibrationSettings, log: Callable[[str], None] = print
) -> Calibration:
    """Calibrate on the default process group, which every rank must have joined; every rank
    calls this and gets the same result (rank 0 logs)."""
    world = dist.get_world_size()
    mesh_shape = settings.mesh_shape or (world,)
    if math.prod(mesh_shape) != world:
        raise ValueError(
            f"mesh {mesh_shape} has {math.prod(mesh_shape)} ranks; the group has {world}"
        )
    device_type = settings.device or ("cuda" if dist.get_backend() == "nccl" else "cpu")
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    say = log if dist.get_rank() == 0 else (lambda _: None)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    mesh = init_device_mesh(device_type, mesh_shape)
    topology = Topology(mesh_shape, CPU, per_node)
    samples: list[dict[str, Any]] = []
    # The device first, then the collectives, then the other rounds of Rounds: they fall
    # far apart in time, not all in one fast or slow spell of a shared host.
    rounds = Rounds.trace(device, settings)
    device_figures = time_device(device, mesh, settings, say, samples)
    rounds.time_round(settings.repeats, device)
    fits = _fit_links(_time_collectives(mesh, topology, settings, say, samples), say)
    device_figures["overlap_fraction"] = _time_overlap(mesh, settings, say, samples, device)
    for _ in range(settings.rounds - 1):
        rounds.time_round(settings.repeats, device)
    device_figures.update(rounds.fit(device, device_figures, say, samples))
    hardware = _hardware(settings, device, fits, device_figures, per_node)
    # last: the probe is planned and priced on the figures above, the op model included
    if hardware.synchronous_ops:
        hardware = time_runtime(mesh, hardware, settings, say, samples)
    spread = round_spread(samples)
    _say_spread(spread, say)
    measured_on = {
        "round_spread": spread,
        "backend": dist.get_backend(),
        "world_size": world,
        "mesh_shape": list(mesh_shape),
        "devices_per_node": per_node,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "threads_per_rank": torch.get_num_threads(),
        "cores_per_rank": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch": torch.__version__,
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return Calibration(hardware, measured_on, samples)


NOISY_SPREAD = 0.1
"""A figure timed in rounds is noisy when the middle half of its rounds lie further apart
than this share of their median (for three rounds: the range over 20 %); a calibration is
flagged noisy when its median figure is: a second profile of the same machine may then
price plans differently, and the run is worth repeating on a quieter host (or with
``--rounds`` raised)."""

MOST_ROUNDS_FACTOR = 3
"""A noisy collective size is timed in up to this many times the settings' rounds."""


def _time_sizes(
    collective: str, mesh: Any, mesh_dim: int, settings: CalibrationSettings
) -> list[list[CollectiveSample]]:
    """Every size's timings of ``collective`` on ``mesh_dim``: ``settings.rounds`` rounds
    over all sizes, then, for the sizes whose rounds lie further apart than
    ``NOISY_SPREAD``, ``MOST_ROUNDS_FACTOR - 1`` times as many more, in rounds of their own."""
    sizes = settings.sizes()
    per_size: list[list[CollectiveSample]] = [[] for _ in sizes]

    def time_round(which: list[int]) -> None:
        for index in which:
            per_size[index].append(
                measure.time_collective(collective, sizes[index], mesh, mesh_dim, settings.repeats)
            )

    for _ in range(settings.rounds):
        time_round(list(range(len(sizes))))
    noisy = [
        i
        for i, timings in enumerate(per_size)
        if _spread([t.time_us for t in timings]) > NOISY_SPREAD
    ]
    for _ in range(settings.rounds * (MOST_ROUNDS_FACTOR - 1) if noisy else 0):
        time_round(noisy)
    return per_size


def _spread(times: list[float]) -> float:
    """How far apart the middle half of a figure's rounds lie: their interquartile range over
    their median (half the range for three rounds; unlike the range, it does not grow as
    rounds are added); 0 for fewer than two."""
    if len(times) < 2:
        return 0.0
    low, middle, high = statistics.quantiles(times, n=4, method="inclusive")
    return (high - low) / middle if middle > 0 else 0.0


def round_spread(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """How far apart the rounds of every figure timed in rounds lie (:func:`_spread`): the
    median over figures, the three widest, and whether the calibration is noisy."""
    spreads = [
        (_spread(sample["rounds_us"]), _figure_name(sample))
        for sample in samples
        if len(sample.get("rounds_us") or []) >= 2
    ]
    if not spreads:
        return {}
    spreads.sort(reverse=True)
    median = statistics.median(value for value, _ in spreads)
    return {
        "figures": len(spreads),
        "median": round(median, 3),
        "widest": [{"figure": name, "spread": round(value, 3)} for value, name in spreads[:3]],
        "noisy": median > NOISY_SPREAD,
    }


def _figure_name(sample: dict[str, Any]) -> str:
    if "nbytes" in sample:
        return f"{sample['what']} {bytes_text(sample['nbytes'])} mesh dim {sample.get('mesh_dim')}"
    if "shape" in sample:
        return f"{sample['what']} {tuple(sample['shape'])}"
    return str(sample["what"])


def _say_spread(spread: dict[str, Any], say: Callable[[str], None]) -> None:
    if not spread:
        return
    widest = ", ".join(f"{w['figure']} {100 * w['spread']:.0f} %" for w in spread["widest"])
    say(
        f"[calibrate] the middle half of each figure's rounds: {100 * spread['median']:.0f} % "
        f"apart at the median over {spread['figures']} figures (widest: {widest})"
    )
    if spread["noisy"]:
        say(
            f"[calibrate] NOISY: the middle half of the median figure's rounds lie more than "
            f"{100 * NOISY_SPREAD:.0f} % apart; another calibration of this machine may price plans "
            "differently. Calibrate on a quieter host, or with more --rounds."
        )


def _time_collectives(
    mesh: Any,
    topology: Topology,
    settings: CalibrationSettings,
    say: Callable[[str], None],
    samples: list,
) -> dict[str, list[CollectiveSample]]:
    """Timings per link class ("intra"/"inter"), over every mesh dim of that class.

    Every (collective, size) is timed once per round and the median over rounds counts:
    a busy host's slow spells (seconds long) then spread over all sizes instead of bending
    the fit at the few sizes they happened to hit. A size whose rounds lie further apart
    than ``NOISY_SPREAD`` is timed ``MOST_ROUNDS_FACTOR`` times as often, so that its median
    rests on more rounds (every rank decides alike: a timing is the ranks' mean).
    """
    by_link: dict[str, list[CollectiveSample]] = {}
    for mesh_dim, ranks in enumerate(topology.mesh_shape):
        if ranks == 1:
            continue
        link = topology.link(mesh_dim)
        for collective in FITTED_KINDS:
            per_size = _time_sizes(collective, mesh, mesh_dim, settings)
            for timings in per_size:
                sample = dataclasses.replace(
                    timings[0], time_us=statistics.median(t.time_us for t in timings)
                )
                by_link.setdefault(link, []).append(sample)
                samples.append(
                    {
                        "what": collective,
                        "mesh_dim": mesh_dim,
                        "link": link,
                        **dataclasses.asdict(sample),
                        "rounds_us": [t.time_us for t in timings],
                    }
                )
                say(
                    f"[calibrate] {collective:<14} mesh dim {mesh_dim} ({link}, {ranks} ranks) "
                    f"{bytes_text(sample.nbytes):>9}: {sample.time_us:12.1f} us "
                    f"(rounds: {', '.join(f'{t.time_us:.0f}' for t in timings)})"
                )
    return by_link


OVERLAP_PROBE_BYTES = 4 << 20  # an all-reduce of about a bucket's size on a small model


def _time_overlap(
    mesh: Any,
    settings: CalibrationSettings,
    say: Callable[[str], None],
    samples: list,
    device: torch.device,
) -> float:
    """``Hardware.overlap_fraction``: the median over rounds of how much of an all-reduce
    hides behind compute (mesh dim 0; 0 on a single rank, where nothing is reduced)."""
    if mesh.size(0) == 1:
        return 0.0
    rounds = [
        measure.overlap(OVERLAP_PROBE_BYTES, mesh, 0, settings.repeats, device)
        for _ in range(settings.rounds)
    ]
    for sample in rounds:
        samples.append({"what": "overlap", **dataclasses.asdict(sample)})
    fraction = statistics.median(sample.fraction for sample in rounds)
    say(
        f"[calibrate] overlap: all-reduce of {bytes_text(OVERLAP_PROBE_BYTES)} beside matmuls: "
        f"{fraction:.2f} of it hidden (rounds: "
        + ", ".join(
            f"{s.comm_us:.0f} + {s.compute_us:.0f} us -> {s.both_us:.0f} us" for s in rounds
        )
        + ")"
    )
    return fraction


def _fit_links(
    by_link: dict[str, list[CollectiveSample]], say: Callable[[str], None]
) -> list[CollectiveFit]:
    fits = []
    for link, link_samples in by_link.items():
        for collective in FITTED_KINDS:
            fit = fit_collective(
                link, collective, [s for s in link_samples if s.collective == collective]
            )
            fits.append(fit)
            say(
                f"[calibrate] fit {collective:<14} {link}: {fit.latency_us:9.1f} us per ring step, "
                f"{fit.bandwidth / 1e9:8.3f} GB/s; largest error {100 * fit.max_error:.0f}%"
            )
    return fits


def _hardware(
    settings: CalibrationSettings,
    device: torch.device,
    fits: list[CollectiveFit],
    figures: dict[str, Any],
    per_node: int,
) -> Hardware:
    by_link = {(f.link, f.collective): f for f in fits}
    intra = by_link.get(("intra", "all_reduce")) or by_link.get(("inter", "all_reduce"))
    inter = by_link.get(("inter", "all_reduce")) or intra
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
        fp8 = torch.cuda.get_device_capability(device) >= (8, 9)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / per_node
        fp8 = False
    name = settings.name or f"{device.type}-{dist.get_backend()}-{platform.node() or 'host'}"
    return Hardware(
        name=name,
        **device_model(device, figures),
        intra_node_bandwidth=intra.bandwidth if intra else CPU.intra_node_bandwidth,
        inter_node_bandwidth=inter.bandwidth if inter else CPU.inter_node_bandwidth,
        intra_node_latency_us=intra.latency_us if intra else CPU.intra_node_latency_us,
        inter_node_latency_us=inter.latency_us if inter else CPU.inter_node_latency_us,
        kernel_launch_us=figures["kernel_launch_us"],
        optimizer_step_us=figures["optimizer_step_us"],
        optimizer_us_per_tensor=figures["optimizer_us_per_tensor"],
        optimizer_ns_per_element=figures["optimizer_ns_per_element"],
        optimizer_base_numel=figures["optimizer_base_numel"],
        optimizer_large_numel=figures["optimizer_large_numel"],
        optimizer_ns_per_element_large=figures["optimizer_ns_per_element_large"],
        optimizer_step_warm_us=figures["optimizer_step_warm_us"],
        optimizer_warm_bytes=figures["optimizer_warm_bytes"],
        optimizer_cold_bytes=figures["optimizer_cold_bytes"],
        overlap_fraction=figures["overlap_fraction"],
        memory_bytes=memory,
        supports_fp8=fp8,
        collectives=tuple(fits),
        devices_per_node=per_node,
    )


# ---------------------------------------------------------------------------- local ranks


def _calibrate_rank(
    rank: int, world_size: int, settings: CalibrationSettings
) -> Calibration | None:
    result = calibrate_group(settings, log=lambda line: print(line, flush=True))
    return result if rank == 0 else None


def calibrate_local(
    nproc: int, settings: CalibrationSettings, timeout_s: float = 3600, pin_cores: bool = False
) -> Calibration:
    """Calibrate on ``nproc`` gloo ranks spawned on this machine (one thread each; with
    ``pin_cores`` each bound to one core, as the runs the profile prices should be)."""
    from autoparallel.runtime.launch import run_distributed

    return run_distributed(
        _calibrate_rank, nproc, settings, timeout_s=timeout_s, pin_cores=pin_cores
    )[0]
