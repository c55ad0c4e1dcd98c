"""Roofline estimate of one operator's run time on one rank.

Roofline = max(FLOPs / FLOP/s, bytes moved / memory bandwidth). On an asynchronous device
(a GPU) an op costs its roofline floored at the kernel launch overhead and view/metadata ops
are free (they launch no kernel, and the host runs ahead of the device). Where the host runs
every op to completion (eager CPU, ``Hardware.synchronous_ops``) the fixed cost per op adds
to the roofline and a view costs the host's dispatch of it. Arguments arrive
with every tensor already replaced by its LOCAL :class:`TensorInfo`, so sharding shows up
here simply as smaller shapes.

FLOPs come from ``torch.utils.flop_counter.flop_registry`` (keyed by overload packet). Its
formulas only read ``.shape`` from tensors, so each ``TensorInfo`` is turned into a
storage-less ``meta`` tensor, which serves both the shape-wrapped formulas and the few
registered with ``get_raw=True``. Ops without a formula, or whose formula fails on these
arguments, count 0 FLOPs and are priced as memory-bound; this function never raises for an
unfamiliar op.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from autoparallel._torch_internals import OpOverload, tree_flatten, tree_map
from autoparallel.cost.hardware import Hardware
from autoparallel.cost.matmul_table import MatmulTable
from autoparallel.graph.view_ops import is_view_op as is_free_op
from autoparallel.types.tensors import TensorInfo

__all__ = [
    "bytes_moved",
    "compute_cost_us",
    "copy_cost_us",
    "flop_count",
    "is_free_op",
    "matmul_dims",
    "matmul_min_dim",
    "priced_by_table",
]

log = logging.getLogger(__name__)

_US_PER_S = 1e6
_aten = torch.ops.aten


# ---------------------------------------------------------------- CPU SDPA formulas
def _sdpa_forward_flops(query: TensorInfo, key: TensorInfo, value: TensorInfo) -> int:
    """QK^T plus PV matmuls: 2*b*h*s_q*s_kv*(d_qk + d_v) (= 4*b*h*s_q*s_kv*d)."""
    b, h, s_q, d_qk = query.shape
    s_kv = key.shape[-2]
    d_v = value.shape[-1]
    return 2 * b * h * s_q * s_kv * (d_qk + d_v)


def _cpu_flash_fwd(
    query: TensorInfo, key: TensorInfo, value: TensorInfo, *_: Any, **__: Any
) -> int:
    return _sdpa_forward_flops(query, key, value)


def _cpu_flash_bwd(
    grad_out: TensorInfo, query: TensorInfo, key: TensorInfo, value: TensorInfo, *_: Any, **__: Any
) -> int:
    # Backward recomputes the scores and runs four more matmuls: 5 vs 2 -> 2.5x forward.
    return _sdpa_forward_flops(query, key, value) * 5 // 2


def _grouped_mm(rows: TensorInfo, weights: TensorInfo, *_: Any, **__: Any) -> int:
    """One matmul per group over contiguous row groups: every row meets one weight matrix.
    ``[M, K] x [G, K, N]`` is 2*M*K*N; the weights' gradient ``[K, M] x [M, N] -> [G, K, N]``
    is 2*K*M*N."""
    if len(weights.shape) == 3:
        return 2 * rows.shape[0] * rows.shape[1] * weights.shape[2]
    return 2 * rows.shape[0] * rows.shape[1] * weights.shape[-1]


# Formulas over TensorInfo, used only when flop_registry has none for the packet.
_LOCAL_FORMULAS: dict[Any, Callable[..., int]] = {}
for _name, _fn in (
    ("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_fwd),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_bwd),
    ("_grouped_mm", _grouped_mm),
):
    if hasattr(_aten, _name):
        _LOCAL_FORMULAS[getattr(_aten, _name)] = _fn


# ---------------------------------------------------------------- FLOPs and bytes
def _to_meta(x: Any) -> Any:
    if isinstance(x, TensorInfo):
        return torch.empty(x.shape, dtype=x.dtype or torch.float32, device="meta")
    return x


def flop_count(op: Any, args: tuple, kwargs: dict, output: Any) -> int:
    """FLOPs of ``op`` on the given (local ``TensorInfo``) arguments; 0 when unknown."""
    packet = getattr(op, "overloadpacket", op)
    try:
        if packet in flop_registry:
            meta_args, meta_kwargs, meta_out = tree_map(
                _to_meta, (tuple(args), dict(kwargs), output)
            )
            return int(flop_registry[packet](*meta_args, **meta_kwargs, out_val=meta_out))
        if packet in _LOCAL_FORMULAS:
            return int(_LOCAL_FORMULAS[packet](*args, **kwargs))
    except Exception as exc:  # a formula that cannot handle these args: treat as memory-bound
        log.debug("flop formula for %s failed (%s); pricing as memory-bound", op, exc)
    return 0


def _tensor_infos(tree: Any) -> list[TensorInfo]:
    leaves, _ = tree_flatten(tree)
    return [leaf for leaf in leaves if isinstance(leaf, TensorInfo)]


def bytes_moved(args: tuple, kwargs: dict, output: Any) -> int:
    """Bytes read (every tensor input) plus bytes written (every tensor output)."""
    return sum(t.nbytes for t in _tensor_infos((args, kwargs, output)))


def _math_dtype(args: tuple, kwargs: dict, output: Any) -> torch.dtype:
    """The dtype that sets the FLOP rate: first floating input, else first output, else fp32."""
    inputs = _tensor_infos((args, kwargs))
    for info in inputs:
        if info.dtype is not None and info.dtype.is_floating_point:
            return info.dtype
    for info in inputs + _tensor_infos(output):
        if info.dtype is not None:
            return info.dtype
    return torch.float32


_MATMULS = {
    _aten.mm.default: (0, 1),
    _aten.addmm.default: (1, 2),
    _aten.bmm.default: (0, 1),
    _aten.baddbmm.default: (1, 2),
}
"""Matmul ops and the positions of their two factors (M x K and K x N, batched or not)."""


def matmul_dims(op: Any, args: tuple) -> tuple[int, int, int, int] | None:
    """A matmul's (batch, M, K, N) (batch 1 unbatched), or None for any other op."""
    positions = _MATMULS.get(op)
    if positions is None:
        return None
    first, second = (args[i] if i < len(args) else None for i in positions)
    if not (isinstance(first, TensorInfo) and isinstance(second, TensorInfo)):
        return None
    if len(first.shape) < 2 or len(second.shape) < 2:
        return None
    batch = math.prod(first.shape[:-2])
    return batch, first.shape[-2], first.shape[-1], second.shape[-1]


def matmul_min_dim(op: Any, args: tuple) -> int | None:
    """The smallest of a matmul's M, N and K, or None for any other op."""
    dims = matmul_dims(op, args)
    return None if dims is None else min(dims[1:])


def priced_by_table(op: Any, args: tuple, hardware: Hardware) -> bool:
    """Whether ``op`` is a matmul that ``hardware``'s measured table prices (its time then
    includes the host's fixed cost of the call: no launch cost is added)."""
    return hardware.matmul_table is not None and matmul_dims(op, args) is not None


def _table_matmul_us(
    table: MatmulTable,
    dims: tuple[int, int, int, int],
    args: tuple,
    kwargs: dict,
    output: Any,
    hardware: Hardware,
) -> float:
    """A matmul's time from ``table`` (``hardware``'s), scaled from the table's dtype to the
    op's by the peak FLOP/s of each (a bf16 matmul on a host measured in fp32)."""
    batch, m, k, n = dims
    per_matmul_bytes = bytes_moved(args, kwargs, output) / max(1, batch)
    time_us = batch * table.time_us(m, k, n, per_matmul_bytes)
    table_dtype = getattr(torch, table.dtype, torch.float32)
    op_dtype = _math_dtype(args, kwargs, output)
    time_us *= hardware.peak_flops(table_dtype) / hardware.peak_flops(op_dtype)
    if hardware.synchronous_ops:
        return time_us
    return max(time_us, hardware.kernel_launch_us)


def copy_cost_us(nbytes: float, hardware: Hardware) -> float:
    """Time (us) of one copy op reading and writing ``nbytes`` in all (0 for none), priced
    as :func:`compute_cost_us` prices a memory-bound op."""
    if nbytes <= 0:
        return 0.0
    return _op_us(nbytes / hardware.memory_bandwidth * _US_PER_S, hardware)


def _op_us(roofline_us: float, hardware: Hardware) -> float:
    """An op's time from its roofline: plus the launch cost where the host runs each op to
    completion, floored at it where the device runs ahead of the host."""
    if hardware.synchronous_ops:
        return hardware.kernel_launch_us + roofline_us
    return max(roofline_us, hardware.kernel_launch_us)


def compute_cost_us(
    op: OpOverload, args: tuple, kwargs: dict, output: Any, hardware: Hardware
) -> float:
    """Time (us) of ``op`` on one rank: its roofline time plus or floored at the launch cost.

    ``args``/``kwargs``/``output`` are the node's pytrees with tensors replaced by LOCAL
    ``TensorInfo``. On asynchronous hardware a view costs 0 and any other op
    ``max(roofline, kernel_launch_us)``; where ``hardware.synchronous_ops`` (eager CPU) a
    view costs ``view_op_us`` and any other op ``kernel_launch_us + roofline``. Matmuls run
    below the peak when a dimension is small (``Hardware.matmul_half_dim``), or, on a
    calibrated profile, take the time its measured table gives (``Hardware.matmul_table``,
    whose timings include the call's fixed cost). Never raises
    for an unknown op: it is priced by the bytes it touches.
    """
    if is_free_op(op):
        return hardware.view_op_us if hardware.synchronous_ops else 0.0
    kwargs = kwargs or {}
    if hardware.matmul_table is not None:
        dims = matmul_dims(op, args)
        if dims is not None:
            return _table_matmul_us(hardware.matmul_table, dims, args, kwargs, output, hardware)
    flops = flop_count(op, args, kwargs, output)
    compute_s = 0.0
    if flops:
        rate = hardware.peak_flops(_math_dtype(args, kwargs, output))
        smallest = matmul_min_dim(op, args) if hardware.matmul_half_dim else None
        if smallest:
            rate *= smallest / (smallest + hardware.matmul_half_dim)
        compute_s = flops / rate
    memory_s = bytes_moved(args, kwargs, output) / hardware.memory_bandwidth
    return _op_us(max(compute_s, memory_s) * _US_PER_S, hardware)
