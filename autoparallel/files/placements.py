"""Keeping a plan: a small, versioned JSON of its boundary placements.

``save_placements`` writes the placements of every parameter, user input and user output
(in the seed's notation, ``S(0)R``), the mesh shape and a fingerprint of the traced graph.
``load_placements`` reads it back and checks it against the current mesh and graph, so a
training script can pin a plan made elsewhere (a laptop, the CLI) and re-solve in seconds:
with every boundary fixed, only the interior is left to choose.

The format holds no live torch objects and no pickles; unknown versions are refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import Partial

from autoparallel.types.graph import JointGraph
from autoparallel.types.placements import (
    Placements,
    PlacementSyntaxError,
    parse_placements,
    placement_str,
)
from autoparallel.types.plan import Plan

FORMAT_VERSION = 1


class PlacementFileError(ValueError):
    """A placements file that does not match this model, mesh or format version."""


@dataclass
class SavedPlacements:
    mesh_shape: tuple[int, ...]
    graph_fingerprint: str
    params: dict[str, Placements]
    inputs: list[Placements | None]
    outputs: list[Placements | None]


def graph_fingerprint(joint: JointGraph) -> str:
    """A digest of the joint graph's ops and shapes: equal for the same model and inputs."""
    digest = hashlib.sha256()
    for node in joint.graph.nodes:
        value = node.meta.get("val")
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        target = node.op if node.op in ("placeholder", "output") else str(node.target)
        digest.update(f"{target}:{shape};".encode())
    return digest.hexdigest()[:16]


def save_placements(plan: Plan, joint: JointGraph, path: str | Path) -> None:
    data = {
        "format": "autoparallel-placements",
        "version": FORMAT_VERSION,
        "mesh_shape": list(plan.mesh_shape),
        "graph_fingerprint": graph_fingerprint(joint),
        "params": {name: placement_str(p) for name, p in plan.param_placements.items()},
        "inputs": [placement_str(p) if p is not None else None for p in plan.input_placements],
        "outputs": [placement_str(p) if p is not None else None for p in plan.output_placements],
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load_placements(path: str | Path) -> SavedPlacements:
    """The placements saved in ``path`` by :func:`save_placements`.

    Raises :class:`PlacementFileError` naming the file (and the entry) when it is missing,
    unreadable, not a placements file, of another version, or has an entry missing or of
    the wrong type; placements are read in the seed's notation and must be ``S(dim)`` or
    ``R`` (a ``Partial`` cannot be pinned).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PlacementFileError(f"{path} is not a readable placements file ({error})") from error
    if not isinstance(data, dict) or data.get("format") != "autoparallel-placements":
        raise PlacementFileError(f"{path} is not an autoparallel placements file")
    if data.get("version") != FORMAT_VERSION:
        raise PlacementFileError(
            f"{path} has format version {data.get('version')}; this autoparallel reads version {FORMAT_VERSION}"
        )
    for key, kind in _ENTRIES.items():
        if not isinstance(data.get(key), kind):
            raise PlacementFileError(
                f"{path}: its {key!r} entry is missing or not a {kind.__name__}"
            )
    mesh_shape = data["mesh_shape"]
    if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in mesh_shape):
        raise PlacementFileError(f"{path}: 'mesh_shape' {mesh_shape} is not a list of sizes")

    def read(text: str | None, where: str) -> Placements | None:
        if text is None:
            return None
        if not isinstance(text, str):
            raise PlacementFileError(f"{path}: {where} is {text!r}, not placements like 'S(0)R'")
        placements = read_placements(text, path)
        if any(isinstance(p, Partial) for p in placements):
            raise PlacementFileError(f"{path}: {where} is {text}; a Partial cannot be pinned")
        return placements

    return SavedPlacements(
        mesh_shape=tuple(mesh_shape),
        graph_fingerprint=data["graph_fingerprint"],
        params={name: read(text, f"params[{name!r}]") for name, text in data["params"].items()},
        inputs=[read(text, f"inputs[{i}]") for i, text in enumerate(data["inputs"])],
        outputs=[read(text, f"outputs[{i}]") for i, text in enumerate(data["outputs"])],
    )


_ENTRIES = {
    "mesh_shape": list,
    "graph_fingerprint": str,
    "params": dict,
    "inputs": list,
    "outputs": list,
}
"""The entries of a placements file and their JSON types."""


def read_placements(text: str, path: str | Path) -> Placements:
    """Placements written in a file, or :class:`PlacementFileError` naming the file."""
    try:
        return parse_placements(text)
    except PlacementSyntaxError as error:
        raise PlacementFileError(f"{path}: {error}") from error


def check_compatible(
    saved: SavedPlacements, mesh_shape: tuple[int, ...], joint: JointGraph, path: str | Path
) -> None:
    if tuple(mesh_shape) != saved.mesh_shape:
        raise PlacementFileError(
            f"{path} was planned for mesh {saved.mesh_shape}, this mesh is {tuple(mesh_shape)}"
        )
    fingerprint = graph_fingerprint(joint)
    if fingerprint != saved.graph_fingerprint:
        raise PlacementFileError(
            f"{path} was planned for another graph (fingerprint {saved.graph_fingerprint}, this one {fingerprint}): "
            "the model, its inputs' shapes or the torch version differ"
        )
    unknown = sorted(set(saved.params) - set(joint.params))
    if unknown:
        raise PlacementFileError(f"{path} names parameters this model does not have: {unknown[:5]}")
