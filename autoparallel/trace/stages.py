"""Cut a model into pipeline stages at the boundaries of its layer stack.

torch.distributed.pipelining's ``pipeline`` traces the model once (torch.export, on the
model's own device: meta is fine) and splits the traced program before the layers named in
its split spec; each stage is then a GraphModule that owns its parameters under their
original names (``layers.3.attention.wq.weight``), so state dicts, plans and checkpoints keep
the model's vocabulary. What flows between stages is whatever the program passes across the
cut (the hidden states, and e.g. the rotary tables a LLaMA slices once in its forward); the
placeholders of each stage carry their shapes, which become that stage's example inputs.

Contract: ``split_stages`` returns one :class:`StageModule` per stage, in order; the first
takes the model's inputs, the last returns the model's outputs; every other input of a stage
is an output of the stage before it, in the order of the stage's placeholders.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autoparallel import _torch_internals as internals
from autoparallel.types.pipeline import PipelineError


@dataclass(frozen=True)
class LayerStack:
    """The model's stack of layers: the container's path and its children's keys."""

    path: str
    keys: tuple[str, ...]

    def names(self, start: int, stop: int) -> tuple[str, ...]:
        return tuple(f"{self.path}.{key}" for key in self.keys[start:stop])


@dataclass(frozen=True)
class StageModule:
    """One stage: the module that runs it, the layers it holds and example inputs for a
    microbatch (meta tensors of the stage's input shapes; floating ones of a stage after
    the first require grad, since their gradients go back to the stage before)."""

    index: int
    module: nn.Module
    layers: tuple[str, ...]
    example_inputs: tuple[torch.Tensor, ...]


def find_layer_stack(model: nn.Module) -> LayerStack:
    """The outermost ``ModuleList``/``ModuleDict`` of at least two children of one class
    (the longest where there are several): the stack the stages are cut from."""
    best: LayerStack | None = None
    for path, container in model.named_modules():
        if not path or not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            continue
        if best is not None and path.startswith(best.path + "."):
            continue
        children = list(container.named_children())
        if len(children) < 2 or len({type(child) for _, child in children}) > 1:
            continue
        if best is None or len(children) > len(best.keys):
            best = LayerStack(path, tuple(key for key, _ in children))
    if best is None:
        raise PipelineError(
            f"{type(model).__name__} has no stack of layers (a ModuleList or ModuleDict of "
            "modules of one class) to cut into pipeline stages; plan it without a 'pp' mesh dim"
        )
    return best


def stage_layer_counts(
    num_layers: int, num_stages: int, fixed: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """Layers per stage: ``fixed`` when given (checked), else as even as possible with the
    earlier stages taking the remainder."""
    if num_stages > num_layers:
        raise PipelineError(
            f"the 'pp' mesh dim asks for {num_stages} stages but the model's stack has "
            f"{num_layers} layers: use at most {num_layers} stages"
        )
    if fixed is not None:
        if len(fixed) != num_stages or sum(fixed) != num_layers:
            raise PipelineError(
                f"stage_layers {fixed} must give one count per stage ({num_stages}) summing to "
                f"the stack's {num_layers} layers"
            )
        return fixed
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if i < extra else 0) for i in range(num_stages))


def split_stages(
    model: nn.Module,
    microbatch_args: tuple[Any, ...],
    microbatch_kwargs: dict[str, Any],
    num_stages: int,
    stage_layers: tuple[int, ...] | None = None,
    compute_dtype: torch.dtype | None = None,
) -> list[StageModule]:
    """Cut ``model`` into ``num_stages`` stages once (see :class:`StageTracer`)."""
    tracer = StageTracer(model, compute_dtype)
    return tracer.split(microbatch_args, microbatch_kwargs, num_stages, stage_layers)


class StageTracer:
    """Cuts one model into pipeline stages (see the module docstring), exporting it once per
    microbatch shape: torch.export is most of a cut's time, and the planner prices several
    cuts at one microbatch shape (other layer splits, two stages per rank). The export marks
    a cut before every layer of the stack; each split keeps the markers where its stages
    begin (``_torch_internals.split_at_markers``), as torch's ``pipeline`` would cut there.

    ``compute_dtype`` (a mixed-precision policy's ``param_dtype``): the model is traced
    computing in it, as it will run (its parameters' stand-ins in that dtype take, on a
    materialized model, that much memory of its device while it is traced), and the stages
    then own the model's own parameters. Traced in float32 instead, torch.export records the
    dtype each cast produced then: ``x.float()`` of a float32 ``x`` is ``x`` itself, so a
    norm's ``self._norm(x.float()).type_as(x)`` comes out keeping float32, and
    ``.to(x.dtype)`` is recorded as ``.to(float32)``; under the policy the stage would then
    compute its residual stream and matmuls in float32."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.compute_dtype = compute_dtype
        self.stack = find_layer_stack(model)
        self._exports: dict[tuple[Any, ...], Any] = {}  # torch.export.ExportedProgram

    def split(
        self,
        microbatch_args: tuple[Any, ...],
        microbatch_kwargs: dict[str, Any],
        num_stages: int,
        stage_layers: tuple[int, ...] | None = None,
    ) -> list[StageModule]:
        """The model cut into ``num_stages`` stages of ``stage_layers`` layers each (default:
        as even as possible); the example microbatch gives the shapes they are traced with."""
        model, stack = self.model, self.stack
        counts = stage_layer_counts(len(stack.keys), num_stages, stage_layers)
        starts = [sum(counts[:i]) for i in range(num_stages)]
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        args = tuple(_zeros_like(a, device) for a in microbatch_args)
        kwargs = {k: _zeros_like(v, device) for k, v in microbatch_kwargs.items()}
        try:
            with (
                _computing_in(model, self.compute_dtype) as own,
                _aliases_unregistered(model) as aliases,
            ):
                marked = self._marked(args, kwargs)
                pipe = internals.split_at_markers(model, marked, {s - 1 for s in starts[1:]})
        except Exception as error:  # torch.export's own errors, long and deep
            raise PipelineError(
                f"torch.distributed.pipelining could not trace {type(model).__name__} to cut "
                f"it into {num_stages} stages: {_first_lines(error)}"
                + _alias_hint(aliases)
                + _cache_hint(error)
            ) from error
        if pipe.num_stages != num_stages:
            raise PipelineError(
                f"cutting before {', '.join(stack.names(1, len(stack.keys)))} gave "
                f"{pipe.num_stages} stages, not {num_stages}: does the forward call every "
                f"layer of `{stack.path}` in order?"
            )
        return _stage_modules(pipe, num_stages, starts, counts, stack, device, own)

    def _marked(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model exported for this microbatch's shapes, marked before every layer but
        the first (cached)."""
        key = (
            *(_shape_of(value) for value in args),
            *((name, _shape_of(value)) for name, value in sorted(kwargs.items())),
        )
        if key not in self._exports:
            before = list(self.stack.names(1, len(self.stack.keys)))
            with _forwards_restored(self.model, before):
                self._exports[key] = internals.export_with_cut_markers(
                    self.model, args, kwargs, before
                )
        return self._exports[key]


def _shape_of(value: Any) -> Any:
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else repr(value)


def _stage_modules(
    pipe: Any,
    num_stages: int,
    starts: list[int],
    counts: tuple[int, ...],
    stack: LayerStack,
    device: torch.device,
    own: dict[str, torch.Tensor],
) -> list[StageModule]:
    """The stages of torch's ``Pipe``, each made to run on its own (see ``split_stages``)."""
    modules = [pipe.get_stage_module(index) for index in range(num_stages)]
    _pass_skipped_values(pipe.split_gm.graph, modules)
    stages = []
    for index, start in enumerate(starts):
        module = modules[index]
        _drop_device_checks(module)
        _devices_from_inputs(module, device)
        _give_back(module, own)
        examples = _placeholder_examples(module, needs_grads=index > 0)
        stages.append(
            StageModule(index, module, stack.names(start, start + counts[index]), examples)
        )
    return stages


def _pass_skipped_values(top: fx.Graph, modules: list[nn.Module]) -> None:
    """Make every stage's outputs exactly the next stage's inputs, in the order of its
    placeholders (the module docstring's contract, which torch's manual ``PipelineStage``
    relies on: a stage receives only from the stage before it).

    torch's split lets a value skip stages: a LLaMA's rotary tables, made by the first
    stage, are read by every later stage straight from it (``top``, the split program,
    passes them so). Each stage between the maker and a reader then takes the value as
    an extra input and passes a copy of it on as an extra output, so it travels stage to
    stage, its gradient back the same way."""
    calls = [node for node in top.nodes if node.op == "call_module"]
    made_by = {call: index for index, call in enumerate(calls)}

    def maker(value: fx.Node) -> int:
        source = value.args[0] if value.target is operator.getitem else value
        return made_by.get(source, -1)  # -1: the model's own input

    takes = [list(call.args) for call in calls]
    for index in range(len(calls) - 1, 0, -1):
        for value in takes[index]:
            if maker(value) < index - 1 and value not in takes[index - 1]:
                if index - 1 == 0:
                    raise PipelineError(
                        f"stage {index} reads the model input `{value.name}`, which the first "
                        "stage does not take: only the first stage receives the model's inputs"
                    )
                takes[index - 1].append(value)
    (returned,) = next(node for node in top.nodes if node.op == "output").args
    outputs: list[fx.Node] = []
    fx.node.map_arg(returned, outputs.append)
    if any(maker(value) != len(calls) - 1 for value in outputs):
        raise PipelineError("a model output is made before the last stage: it cannot be cut")
    for index, module in enumerate(modules[:-1]):
        _thread(module, takes[index], takes[index + 1], index, maker, calls, modules)


def _thread(
    module: nn.Module,
    takes: list[fx.Node],
    gives: list[fx.Node],
    index: int,
    maker: Any,
    calls: list[fx.Node],
    modules: list[nn.Module],
) -> None:
    """Stage ``index``'s module taking ``takes`` and returning ``gives`` (top-level values
    of the split program), the ones it does not make passed through as copies."""
    graph = module.graph
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    output = next(node for node in graph.nodes if node.op == "output")
    made = output.args[0]
    for value in takes[len(placeholders) :]:
        with graph.inserting_after(placeholders[-1]):
            added = graph.placeholder(value.name)
        added.meta["val"] = _example_of(value, calls, modules)
        placeholders.append(added)
    returned = []
    for value in gives:
        if maker(value) == index:
            position = value.args[1] if value.target is operator.getitem else None
            returned.append(made if position is None else made[position])
            continue
        with graph.inserting_before(output):
            copy = graph.call_function(
                torch.ops.aten.clone.default, (placeholders[takes.index(value)],)
            )
        copy.meta["val"] = placeholders[takes.index(value)].meta["val"]
        returned.append(copy)
    output.args = (returned[0] if len(returned) == 1 else tuple(returned),)
    graph.eliminate_dead_code()
    graph.lint()
    _recompile(module)


def _example_of(value: fx.Node, calls: list[fx.Node], modules: list[nn.Module]) -> Any:
    """The traced value of a top-level value, from a stage that takes it."""
    for call, module in zip(calls, modules):
        if value in call.args:
            placeholders = [node for node in module.graph.nodes if node.op == "placeholder"]
            return placeholders[list(call.args).index(value)].meta.get("val")
    return None


@contextlib.contextmanager
def _forwards_restored(model: nn.Module, names: list[str]) -> Iterator[None]:
    """``pipeline`` marks its cuts by replacing the ``forward`` of the modules named in the
    split spec on the user's model, in place, and leaves them so (a second split of the
    model then recurses without end); put them back as they were."""
    modules = [model.get_submodule(name) for name in names]
    saved = [(m, m.__dict__.get("forward"), "_orig_forward" in m.__dict__) for m in modules]
    try:
        yield
    finally:
        for module, forward, had_original in saved:
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
            if not had_original:
                module.__dict__.pop("_orig_forward", None)


@contextlib.contextmanager
def _computing_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[dict[str, torch.Tensor]]:
    """Give ``model`` stand-ins of its floating parameters in ``dtype`` (same shapes and
    device, values never read) while it is traced; yields the originals by name (empty
    where ``dtype`` is None: nothing is swapped) and puts them back after. Buffers keep
    their dtype, as under the policy (it casts parameters only)."""
    if dtype is None:
        yield {}
        return
    own: dict[str, torch.Tensor] = {}
    stand_ins: dict[int, torch.Tensor] = {}  # a tied tensor gets one stand-in
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.is_floating_point() or param.dtype == dtype:
            continue
        own[name] = param
        if id(param) not in stand_ins:
            blank = torch.empty(param.shape, dtype=dtype, device=param.device)
            stand_ins[id(param)] = nn.Parameter(blank, requires_grad=param.requires_grad)
        _set(model, name, stand_ins[id(param)])
    try:
        yield own
    finally:
        for name, tensor in own.items():
            _set(model, name, tensor)


@contextlib.contextmanager
def _aliases_unregistered(model: nn.Module) -> Iterator[list[tuple[str, str]]]:
    """``model`` with every tensor registered under one name only (its first, in
    ``named_parameters``/``named_buffers`` order) while it is cut: torch's splitter moves a
    tensor to the stages by one name and then looks it up by the other (a rotary table kept
    as ``freqs_cis`` and as ``rope.cache``). A forward that reads the other name then fails
    to trace, and the error names the pair (yielded: (kept name, removed name)). Every
    registration is put back after."""
    first: dict[int, str] = {}
    removed: list[tuple[nn.Module, str, str, str]] = []  # owner, kind, leaf, the alias
    named = (
        *(("_parameters", n, t) for n, t in model.named_parameters(remove_duplicate=False)),
        *(("_buffers", n, t) for n, t in model.named_buffers(remove_duplicate=False)),
    )
    for kind, name, tensor in named:
        if id(tensor) not in first:
            first[id(tensor)] = name
            continue
        owner_path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_path) if owner_path else model
        removed.append((owner, kind, leaf, name))
    taken = [getattr(owner, kind).pop(leaf) for owner, kind, leaf, _ in removed]
    try:
        yield [(first[id(tensor)], alias) for tensor, (*_, alias) in zip(taken, removed)]
    finally:
        for (owner, kind, leaf, _), tensor in reversed(list(zip(removed, taken))):
            getattr(owner, kind)[leaf] = tensor


def _causes(error: BaseException, limit: int = 16) -> list[BaseException]:
    """``error`` and the exceptions it was raised from or during, outermost first."""
    chain = [error]
    while len(chain) < limit and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    return chain


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def _first_lines(error: BaseException) -> str:
    """The error's first line, and its root cause's where that is another (torch.export
    wraps the reason in "cannot capture your model as a full graph")."""
    root = _causes(error)[-1]
    said = _first_line(error)
    return said if root is error else f"{said} Cause: {_first_line(root)}"


def _cache_hint(error: BaseException) -> str:
    """Hugging Face models return their key/value cache unless told not to."""
    if not any("Cache" in str(e) and "not a known type" in str(e) for e in _causes(error)):
        return ""
    return " (a Hugging Face model returns its key/value cache: set config.use_cache = False)"


def _alias_hint(aliases: list[tuple[str, str]]) -> str:
    if not aliases:
        return ""
    shown = ", ".join(f"{kept} is {other}" for kept, other in aliases[:3])
    return (
        f" (the model holds tensors under two names: {shown}; the cut keeps the first name "
        "only, so a forward that reads the other cannot be cut: read one name, or untie "
        "them, e.g. tied embeddings across the first and last stage)"
    )


def _give_back(stage: nn.Module, own: dict[str, torch.Tensor]) -> None:
    """The stage holds the stand-ins it was traced with: give it the model's own
    parameters (under every name: tied ones stay tied)."""
    for name, _ in stage.named_parameters(remove_duplicate=False):
        if name in own:
            _set(stage, name, own[name])


def _set(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner), leaf, tensor)


def _drop_device_checks(stage: nn.Module) -> None:
    """torch.export checks the device and dtype of a ``.to()``/``.float()`` result against the
    trace's (``aten._assert_tensor_metadata``): a model cut on the meta device would then
    refuse to run anywhere else, and planning traces the stage again on fake tensors of the
    mesh's device. The values are computed as before without the checks."""
    check = torch.ops.aten._assert_tensor_metadata.default
    for module in stage.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        checks = [n for n in graph.nodes if n.op == "call_function" and n.target is check]
        for node in checks:
            graph.erase_node(node)
        if checks:
            _recompile(module)


def _devices_from_inputs(stage: nn.Module, traced_on: torch.device) -> None:
    """torch.export records the device a factory op or a ``.to()`` got while the model was
    traced (``torch.arange(n, device=x.device)``, Hugging Face's cache positions and masks):
    on a model cut on the meta device, meta, where the stage never runs. Each such device
    becomes the device of the graph's first input, read when the graph runs. Graphs without
    a tensor input keep theirs."""
    if traced_on.type != "meta":
        return
    for module in stage.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        uses = [n for n in graph.nodes if n.op == "call_function" and _names_meta(n)]
        first_input = next((n for n in graph.nodes if n.op == "placeholder"), None)
        if not uses or first_input is None:
            continue
        with graph.inserting_after(first_input):
            device = graph.call_function(getattr, (first_input, "device"))
        for node in uses:
            node.args = _on(node.args, device)
            node.kwargs = _on(node.kwargs, device)
        _recompile(module)


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.device) and value.type == "meta"


def _names_meta(node: fx.Node) -> bool:
    return any(_is_meta(value) for value in (*node.args, *node.kwargs.values()))


def _on(values: Any, device: fx.Node) -> Any:
    if isinstance(values, dict):
        return {key: device if _is_meta(value) else value for key, value in values.items()}
    return tuple(device if _is_meta(value) else value for value in values)


def _recompile(module: nn.Module) -> None:
    if isinstance(module, fx.GraphModule):
        module.recompile()
    generated = module.__dict__.get("graph_module")  # an unflattened InterpreterModule's
    if isinstance(generated, fx.GraphModule):
        generated.recompile()


def _zeros_like(value: Any, device: Any) -> Any:
    """A stand-in of ``value`` for tracing (only its shape and dtype are read)."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.zeros(value.shape, dtype=value.dtype, device=device)


def _placeholder_examples(module: nn.Module, needs_grads: bool) -> tuple[torch.Tensor, ...]:
    examples = []
    for node in module.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise PipelineError(
                f"stage input `{node.name}` is a {type(value).__name__}, not a tensor: only "
                "tensors can flow between pipeline stages"
            )
        example = torch.empty(value.shape, dtype=value.dtype, device="meta")
        examples.append(example.requires_grad_(needs_grads and value.dtype.is_floating_point))
    return tuple(examples)
