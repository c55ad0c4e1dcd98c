"""This rank's part of a pipelined model: its stage's parallel module inside one of
torch.distributed.pipelining's schedules.

torch's ``PipelineStage`` runs the stage module per microbatch, sends and receives the
activations and their gradients over the ``pp`` group, and calls autograd on the stage's
outputs; the schedule (``ScheduleGPipe``, ``Schedule1F1B``; ``ScheduleInterleaved1F1B`` where
a rank runs several stages, one ``PipelineStage`` each) orders the microbatches. A stage
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

from collections.abc import Callable, Iterator, Mapping, Sequence
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
from autoparallel.types.pipeline import INTERLEAVED, PipelineError, PipelinePlan


class ParallelPipeline:
    """This rank's stages of the pipelined model and the schedule that runs them.

    ``modules`` are this rank's stages' parallel modules, in stage order (one, or several
    under interleaved 1F1B; their parameters and state dict under the model's own names:
    ``layers.3.attention.wq.weight``); build the optimizer from :meth:`parameters`. Every
    rank calls :meth:`step` with the same arguments; the rank of the first stage reads the
    inputs, the rank of the last the targets and the losses list.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        pipeline: PipelinePlan,
        pp_mesh: DeviceMesh,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        whole_model: nn.Module,
    ) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        if not callable(loss_fn):
            raise PipelineError(
                "a plan with pipeline stages needs loss_fn(output, target) -> loss: pass "
                "apply_placement(plan, loss_fn=...)"
            )
        if len(modules) != len(pipeline.rank_stages):
            raise PipelineError(
                f"this rank runs stages {pipeline.rank_stages}, got {len(modules)} modules"
            )
        self.modules = list(modules)
        self.module = self.modules[0]  # this rank's first stage
        self.whole_model = whole_model
        # the first stage's inputs as traced (positional, then keyword): step(**named) order
        self.input_names = [n.name for n in self.module.graph.nodes if n.op == "placeholder"]
        self.pipeline = pipeline
        device = torch.device(pp_mesh.device_type)
        self.stages = [
            PipelineStage(module, index, pipeline.num_stages, device, group=pp_mesh.get_group())
            for module, index in zip(self.modules, pipeline.rank_stages)
        ]
        if pipeline.schedule == INTERLEAVED:
            self.schedule = ScheduleInterleaved1F1B(
                self.stages, n_microbatches=pipeline.microbatches, loss_fn=loss_fn
            )
            return
        schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[pipeline.schedule]
        self.schedule = schedule_class(
            self.stages[0], n_microbatches=pipeline.microbatches, loss_fn=loss_fn
        )

    @property
    def is_first(self) -> bool:
        return self.pipeline.is_first

    @property
    def is_last(self) -> bool:
        return self.pipeline.is_last

    def parameters(self) -> Iterator[nn.Parameter]:
        for module in self.modules:
            yield from module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for module in self.modules:
            yield from module.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        """This rank's stages' entries of the whole model's state dict, under the model's
        own names (DTensors: a ``torch.distributed.checkpoint`` of every rank's is the whole
        model's checkpoint; the model's non-persistent buffers, which the cut holds as
        persistent ones, are left out as the model leaves them out)."""
        entries: dict[str, Any] = {}
        for module in self.modules:
            entries.update(whole_model_entries(self.whole_model, module.state_dict()))
        return entries

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> StageKeys:
        """Load this rank's stages' entries of the whole model's state dict (full tensors or
        DTensors); with ``strict``, a key of these stages it lacks or a key of no tensor of
        the model raises ``KeyError`` naming it (runtime/stage_init.py). Returns the keys
        that did not fit, as ``nn.Module.load_state_dict`` does."""
        missing: list[str] = []
        unexpected: list[str] = []
        for module in self.modules:
            mine, keys = stage_state_dict(self.whole_model, module, state_dict, strict)
            module.load_state_dict(mine, strict=False)  # the checks were ours
            missing += keys.missing_keys
            unexpected = keys.unexpected_keys  # keys of no tensor: alike for every stage
        return StageKeys(missing, unexpected)

    def to_empty(self, *, device: torch.device | str) -> ParallelPipeline:
        """Give this rank's stages' meta tensors storage on ``device`` (values
        uninitialized: call :meth:`init_weights` or :meth:`load_state_dict` next)."""
        for module in self.modules:
            module.to_empty(device=device)
        return self

    def init_weights(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``init_weights(*args, **kwargs)``, run so that it initializes this
        rank's stages' parameters and buffers (non-persistent ones included) as it
        initializes the whole model, once per stage. Call it after :meth:`to_empty` on a
        model planned on meta. Values drawn from torch's global generator differ from one
        device's: seed each stage apart (``torch.manual_seed(seed +
        pipe.pipeline.stage_index)``); see runtime/stage_init.py."""
        result = None
        for module in self.modules:
            result = init_stage(self.whole_model, module, "init_weights", *args, **kwargs)
        return result

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
        stages = ", ".join(str(s) for s in self.pipeline.rank_stages)
        return f"ParallelPipeline({self.pipeline.describe()}; this rank: stage {stages})"
