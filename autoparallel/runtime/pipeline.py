"""This rank's part of a pipelined model: its stage's parallel module inside one of
torch.distributed.pipelining's schedules.

torch's ``PipelineStage`` runs the stage module per microbatch, sends and receives the
activations and their gradients over the ``pp`` group, and calls autograd on the stage's
outputs; the schedule (``ScheduleGPipe``, ``Schedule1F1B``) orders the microbatches. The stage
module is the planner's parallel module of that stage: it takes and returns local tensors
(the layouts pinned at the cuts, stage_setup.py) and reduces its own gradients over the other
mesh dims in its backward, so nothing here communicates by itself.

Loss: the schedule calls ``loss_fn(output, target)`` per microbatch on the last stage with
that microbatch's local output and target rows; the gradients are those of the mean of the
microbatches' losses (the schedule scales them by ``1 / microbatches``), summed over the ranks
that split the rows, as for the parallel module without stages (divide by the number of
row-splitting ranks for a mean over the whole batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autoparallel.runtime.stage_init import (
    StageKeys,
    init_stage,
    stage_state_dict,
    whole_model_entries,
)
from autoparallel.types.pipeline import PipelineError, PipelinePlan


class ParallelPipeline:
    """This rank's stage of the pipelined model and the schedule that runs it.

    ``module`` is the stage's parallel module (its parameters and state dict under the
    model's own names: ``layers.3.attention.wq.weight``); build the optimizer from
    :meth:`parameters`. Every rank calls :meth:`step` with the same arguments; the first
    stage reads the inputs, the last the targets and the losses list.
    """

    def __init__(
        self,
        module: nn.Module,
        pipeline: PipelinePlan,
        pp_mesh: DeviceMesh,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        whole_model: nn.Module,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if not callable(loss_fn):
            raise PipelineError(
                "a plan with pipeline stages needs loss_fn(output, target) -> loss: pass "
                "apply_placement(plan, loss_fn=...)"
            )
        self.module = module
        self.whole_model = whole_model
        # the first stage's inputs as traced (positional, then keyword): step(**named) order
        self.input_names = [n.name for n in module.graph.nodes if n.op == "placeholder"]
        self.pipeline = pipeline
        device = torch.device(pp_mesh.device_type)
        self.stage = PipelineStage(
            module,
            pipeline.stage_index,
            pipeline.num_stages,
            device,
            group=pp_mesh.get_group(),
        )
        schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[pipeline.schedule]
        self.schedule = schedule_class(
            self.stage, n_microbatches=pipeline.microbatches, loss_fn=loss_fn
        )

    @property
    def is_first(self) -> bool:
        return self.pipeline.is_first

    @property
    def is_last(self) -> bool:
        return self.pipeline.is_last

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        """This stage's entries of the whole model's state dict, under the model's own names
        (DTensors: a ``torch.distributed.checkpoint`` of every rank's is the whole model's
        checkpoint; the model's non-persistent buffers, which the cut holds as persistent
        ones, are left out as the model leaves them out)."""
        return whole_model_entries(self.whole_model, self.module.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> StageKeys:
        """Load this stage's entries of the whole model's state dict (full tensors or
        DTensors); with ``strict``, a key of this stage it lacks or a key of no tensor of the
        model raises ``KeyError`` naming it (runtime/stage_init.py). Returns the keys that
        did not fit, as ``nn.Module.load_state_dict`` does."""
        mine, keys = stage_state_dict(self.whole_model, self.module, state_dict, strict)
        self.module.load_state_dict(mine, strict=False)  # the checks were ours
        return keys

    def to_empty(self, *, device: torch.device | str) -> ParallelPipeline:
        """Give this stage's meta tensors storage on ``device`` (values uninitialized: call
        :meth:`init_weights` or :meth:`load_state_dict` next)."""
        self.module.to_empty(device=device)
        return self

    def init_weights(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``init_weights(*args, **kwargs)``, run so that it initializes this
        stage's parameters and buffers (non-persistent ones included) as it initializes the
        whole model. Call it after :meth:`to_empty` on a model planned on meta. Values drawn
        from torch's global generator differ from one device's: seed each stage apart
        (``torch.manual_seed(seed + pipe.pipeline.stage_index)``); see runtime/stage_init.py."""
        return init_stage(self.whole_model, self.module, "init_weights", *args, **kwargs)

    def step(
        self,
        *inputs: Any,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
        **named_inputs: Any,
    ) -> Any:
        """One forward and backward of this rank's local batch, cut into the plan's
        microbatches (gradients accumulate in ``.grad``; step the optimizer after). Returns
        the last stage's output (None on the others); ``losses`` receives the last stage's
        loss per microbatch. The model's inputs go positionally or by the names of its
        forward's parameters (``pipe.step(**batch)`` for a Hugging Face batch)."""
        if self.is_last and target is None:
            raise PipelineError("the last stage computes the loss: pass step(..., target=...)")
        if self.is_first and named_inputs:
            inputs = self._in_order(inputs, named_inputs)
        return self.schedule.step(
            *(inputs if self.is_first else ()),
            target=target if self.is_last else None,
            losses=losses if self.is_last else None,
        )

    def _in_order(self, inputs: tuple[Any, ...], named: dict[str, Any]) -> tuple[Any, ...]:
        """``inputs`` then ``named`` in the order of the first stage's inputs (the model's
        inputs as it was traced: its positional arguments, then its keyword ones)."""
        names = self.input_names
        rest = names[len(inputs) :]
        unknown = sorted(set(named) - set(rest))
        missing = [name for name in rest if name not in named]
        if unknown or missing:
            raise PipelineError(
                f"pipe.step inputs: the model was planned with inputs {names}; "
                + (f"unknown: {unknown}" if unknown else f"missing: {missing}")
            )
        return (*inputs, *(named[name] for name in rest))

    def __repr__(self) -> str:
        return f"ParallelPipeline({self.pipeline.describe()}; this rank: stage {self.pipeline.stage_index})"
