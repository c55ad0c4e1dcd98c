"""What one device and its links can do: the ``Hardware`` figures the cost model divides by.

Two sources: the presets below (public datasheet peaks, so optimistic by design and meant
for planning a cluster you do not have at hand), and profiles measured on a real cluster by
``autoparallel calibrate`` (``cost/profile.py`` reads them), which also carry one fitted
latency and bandwidth per collective and link class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autoparallel.cost.matmul_table import MatmulTable

__all__ = [
    "A100",
    "B200",
    "COLLECTIVES",
    "FITTED_KINDS",
    "SEND_RECV",
    "CPU",
    "H100",
    "H200",
    "HARDWARE_PRESETS",
    "LINKS",
    "CollectiveFit",
    "Hardware",
]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
SEND_RECV = "send_recv"
"""A point-to-point exchange between two ranks (each sends to the other and receives from
it, as a pipeline stage passes activations one way and gradients the other): what a
pipeline's cut pays per microbatch (cost/pipeline.py)."""
FITTED_KINDS = (*COLLECTIVES, SEND_RECV)
"""What a calibrated profile fits a latency and a bandwidth for, per link class."""
LINKS = ("intra", "inter")


@dataclass(frozen=True)
class CollectiveFit:
    """A measured alpha-beta model of one collective over one link class.

    ``latency_us`` is the cost of one ring step and ``bandwidth`` the bytes/s one rank pushes
    over its link, in the ring model of ``cost/collectives.py`` (so a fit from a group of 2
    ranks predicts a group of 8 the way the datasheet figures do); for ``SEND_RECV``, one
    message's fixed cost and the bytes/s it moves. ``max_error`` is the largest relative
    error of the fit over the sizes measured (0.1: within 10 %).
    """

    link: str  # "intra" or "inter" (node)
    collective: str  # one of FITTED_KINDS
    latency_us: float
    bandwidth: float
    max_error: float = 0.0


_HALF_DTYPES = frozenset({torch.bfloat16, torch.float16})
_FP8_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
)


@dataclass(frozen=True)
class Hardware:
    """Per-device throughput figures, all in SI units (FLOP/s, bytes/s, bytes, us).

    Figures are *dense* peaks from public datasheets; the cost model divides by them, so
    they are optimistic by design and matter mostly in ratio (compute vs. link speeds).
    ``supports_fp8`` says whether fp8 math runs on tensor cores at twice the bf16 rate;
    without it fp8 is priced as bf16 (the kernel upcasts).
    """

    name: str
    flops_fp32: float
    flops_bf16: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency_us: float
    inter_node_latency_us: float
    kernel_launch_us: float
    memory_bytes: float
    supports_fp8: bool = True
    # measured per collective and link class (a calibrated profile); empty for presets, whose
    # link figures above serve every collective
    collectives: tuple[CollectiveFit, ...] = ()
    # ranks per node where the profile was measured (used when the user gives none)
    devices_per_node: int | None = None
    # "preset", or the profile file the figures were read from
    source: str = "preset"
    # True where the host runs each op to completion before issuing the next (eager CPU):
    # an op then costs kernel_launch_us PLUS its roofline time, and a view op view_op_us.
    # False for an asynchronous device (a GPU), where launches hide behind running kernels:
    # max(roofline, kernel_launch_us), views free.
    synchronous_ops: bool = False
    view_op_us: float = 0.0
    # the smallest matmul dimension (of M, N, K) at which a matmul reaches half the peak
    # FLOP/s: rate = peak * d / (d + matmul_half_dim); 0 prices every matmul at the peak
    matmul_half_dim: float = 0.0
    # measured matmul times over a grid of shapes (a calibrated profile): where present, a
    # matmul is priced by it (cost/matmul_table.py) rather than by the peak and
    # matmul_half_dim; None in the presets
    matmul_table: MatmulTable | None = None
    # the optimizer step (measured: AdamW with foreach kernels on the runtime's DTensor
    # parameters): a fixed cost per step, per parameter tensor, and per local element.
    # All 0 (the presets): the step is not priced. A CPU host pays more per element on large
    # tensors (their working set leaves the caches and the step's temporaries land on fresh
    # pages): optimizer_ns_per_element_large is the rate at optimizer_large_numel elements
    # and above, interpolated in log size down to the base rate at optimizer_base_numel;
    # optimizer_large_numel 0: one rate for every size.
    optimizer_step_us: float = 0.0
    optimizer_us_per_tensor: float = 0.0
    optimizer_ns_per_element: float = 0.0
    optimizer_base_numel: float = 0.0
    optimizer_large_numel: float = 0.0
    optimizer_ns_per_element_large: float = 0.0
    # the fixed part depends on how much memory the rest of the step touches: timed after
    # optimizer_cold_bytes of other work it is optimizer_step_us (cold caches, the host's
    # structures evicted), after optimizer_warm_bytes it is optimizer_step_warm_us; a plan
    # whose predicted peak lies between is priced in between (log scale). 0 bytes: always
    # optimizer_step_us.
    optimizer_step_warm_us: float = 0.0
    optimizer_warm_bytes: float = 0.0
    optimizer_cold_bytes: float = 0.0
    # the parallel module's own work per training step outside its traced graphs, on a
    # synchronous host (measured by calibrate on CPU; 0 on a GPU, where the host runs ahead
    # of the kernels, and in the presets): a fixed part (entering and leaving the forward
    # and the backward) and a part per trained parameter (unwrapping it from its DTensor,
    # wrapping and accumulating its gradient)
    runtime_step_us: float = 0.0
    runtime_us_per_parameter: float = 0.0
    # the part of that work done in the forward (unwrapping the parameters, entering the
    # forward's graph), the rest in the backward: for a report that splits a step by phase
    runtime_forward_share: float = 0.0
    # how much of a collective hides behind compute that runs at the same time: hiding
    # min(compute, comm) * overlap_fraction of it. 1 would be a device whose collectives
    # never slow its compute; GPUs lose a little to the SMs NCCL's kernels take (0.9);
    # on a CPU gloo's threads compete with the ops for the cores (calibrate measures it).
    overlap_fraction: float = 0.9

    def optimizer_us(self, local_numel: int) -> float:
        """The optimizer step's time for one parameter tensor of ``local_numel`` elements."""
        if not (self.optimizer_us_per_tensor or self.optimizer_ns_per_element):
            return 0.0
        return (
            self.optimizer_us_per_tensor
            + local_numel * self.optimizer_ns_per_element_at(local_numel) / 1e3
        )

    def optimizer_fixed_us(self, step_bytes: float) -> float:
        """The optimizer step's fixed cost in a training step whose memory peaks at
        ``step_bytes`` on the rank."""
        warm, cold = self.optimizer_warm_bytes, self.optimizer_cold_bytes
        if not (0 < warm < cold) or step_bytes >= cold:
            return self.optimizer_step_us
        if step_bytes <= warm:
            return self.optimizer_step_warm_us
        weight = math.log(step_bytes / warm) / math.log(cold / warm)
        return self.optimizer_step_warm_us + weight * (
            self.optimizer_step_us - self.optimizer_step_warm_us
        )

    def optimizer_ns_per_element_at(self, local_numel: int) -> float:
        """The optimizer's cost per element on a tensor of ``local_numel`` elements."""
        base, large = self.optimizer_base_numel, self.optimizer_large_numel
        if not large or local_numel <= base or large <= base:
            return self.optimizer_ns_per_element
        if local_numel >= large:
            return self.optimizer_ns_per_element_large
        weight = math.log(local_numel / max(base, 1.0)) / math.log(large / max(base, 1.0))
        return self.optimizer_ns_per_element + weight * (
            self.optimizer_ns_per_element_large - self.optimizer_ns_per_element
        )

    def runtime_us(self, parameters: int) -> float:
        """The runtime's own work in one step of a model training ``parameters`` tensors."""
        if not parameters:
            return 0.0
        return self.runtime_step_us + parameters * self.runtime_us_per_parameter

    def collective_fit(self, link: str, collective: str) -> CollectiveFit | None:
        """The measured fit of ``collective`` over ``link``, if the profile has one."""
        for fit in self.collectives:
            if fit.link == link and fit.collective == collective:
                return fit
        return None

    def peak_flops(self, dtype: torch.dtype | None) -> float:
        """Peak dense FLOP/s for math in ``dtype`` (fp32 rate for anything unrecognised)."""
        if dtype in _HALF_DTYPES:
            return self.flops_bf16
        if dtype in _FP8_DTYPES:
            return 2.0 * self.flops_bf16 if self.supports_fp8 else self.flops_bf16
        return self.flops_fp32


_GB = 1e9

# H100 SXM5 80GB: 67 TF fp32 (non-tensor), 989 TF dense bf16, 3.35 TB/s HBM3,
# NVLink4 900 GB/s bidirectional (450 GB/s per direction), 400 Gb/s NIC per GPU.
H100 = Hardware(
    name="h100",
    flops_fp32=67e12,
    flops_bf16=989e12,
    memory_bandwidth=3.35e12,
    intra_node_bandwidth=450 * _GB,
    inter_node_bandwidth=50 * _GB,
    intra_node_latency_us=2.0,
    inter_node_latency_us=6.0,
    kernel_launch_us=3.0,
    memory_bytes=80 * _GB,
)

# A100 SXM4 80GB: 19.5 TF fp32, 312 TF bf16, 2.04 TB/s HBM2e, NVLink3 600 GB/s
# bidirectional, 200 Gb/s HDR NIC per GPU; no fp8 tensor cores.
A100 = Hardware(
    name="a100",
    flops_fp32=19.5e12,
    flops_bf16=312e12,
    memory_bandwidth=2.039e12,
    intra_node_bandwidth=300 * _GB,
    inter_node_bandwidth=25 * _GB,
    intra_node_latency_us=2.5,
    inter_node_latency_us=8.0,
    kernel_launch_us=4.0,
    memory_bytes=80 * _GB,
    supports_fp8=False,
)

# H200 SXM: H100 compute with 141 GB HBM3e at 4.8 TB/s.
H200 = Hardware(
    name="h200",
    flops_fp32=67e12,
    flops_bf16=989e12,
    memory_bandwidth=4.8e12,
    intra_node_bandwidth=450 * _GB,
    inter_node_bandwidth=50 * _GB,
    intra_node_latency_us=2.0,
    inter_node_latency_us=6.0,
    kernel_launch_us=3.0,
    memory_bytes=141 * _GB,
)

# B200 (HGX): ~80 TF fp32, 2.25 PF dense bf16, 8 TB/s HBM3e, 180 GB, NVLink5 1.8 TB/s
# bidirectional, 400 Gb/s NIC per GPU.
B200 = Hardware(
    name="b200",
    flops_fp32=80e12,
    flops_bf16=2.25e15,
    memory_bandwidth=8e12,
    intra_node_bandwidth=900 * _GB,
    inter_node_bandwidth=50 * _GB,
    intra_node_latency_us=2.0,
    inter_node_latency_us=6.0,
    kernel_launch_us=3.0,
    memory_bytes=180 * _GB,
)

# A generic multi-core server CPU running gloo: rough figures, meant for tests and dry
# runs where only the relative ordering of plans matters (calibrate a real machine with
# ``autoparallel calibrate``).
CPU = Hardware(
    name="cpu",
    flops_fp32=1e12,
    flops_bf16=1e12,
    memory_bandwidth=100 * _GB,
    intra_node_bandwidth=20 * _GB,
    inter_node_bandwidth=1.25 * _GB,
    intra_node_latency_us=20.0,
    inter_node_latency_us=100.0,
    kernel_launch_us=5.0,
    memory_bytes=64 * _GB,
    supports_fp8=False,
    overlap_fraction=0.5,
)

HARDWARE_PRESETS: dict[str, Hardware] = {hw.name: hw for hw in (H100, A100, H200, B200, CPU)}
