"""``autoparallel_backend()``: the torch.compile backend for parallel modules.

``torch.compile(parallel_model, backend=autoparallel_backend())``: Dynamo captures the
user's code around the parallel module; the module's planned forward and backward appear in
that capture as opaque calls that AOTAutograd traces through DTensor into ATen ops and
torch's functional collectives (see runtime/module.py); the compiler then turns the joint
result into kernels. Gradients, losses and placements are those of the eager module.

Without a CUDA device the default compiler, Inductor, emits C++ for the CPU; the
collectives stay calls into the process group (gloo or nccl). A compiled forward raises
``RankLostError`` for a lost peer as the eager one does; the compiled backward runs inside
autograd, out of this backend's reach (wrap the step in ``translate_rank_loss(parallel)``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from autoparallel import _torch_internals as internals
from autoparallel.runtime.faults import translate_rank_loss

logger = logging.getLogger(__name__)

COMPILERS = ("inductor", "aot_eager")


def autoparallel_backend(
    compiler: str = "inductor",
) -> Callable[[fx.GraphModule, list[Any]], Callable]:
    """A torch.compile backend for modules returned by ``apply_placement``/``auto_parallel``.

    Args:
        compiler: ``"inductor"`` (default: generated kernels) or ``"aot_eager"`` (the traced
            ATen graphs run op by op: for debugging a numerical difference against eager).
    """
    if compiler not in COMPILERS:
        raise ValueError(
            f"autoparallel_backend: compiler must be one of {COMPILERS}, got {compiler!r}"
        )
    backend = internals.lookup_compile_backend(compiler)

    def compile_graph(graph_module: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        calls = sum(1 for node in graph_module.graph.nodes if node.op == "call_function")
        logger.info(
            "autoparallel_backend: compiling a captured graph of %d calls with %s", calls, compiler
        )
        compiled = backend(graph_module, example_inputs)

        @functools.wraps(compiled)  # keeps how Dynamo calls it (``_boxed_call``)
        def run(*args: Any, **kwargs: Any) -> Any:
            with translate_rank_loss():
                return compiled(*args, **kwargs)

        return run

    return compile_graph
