"""How long choosing the mesh takes: ``search_mesh`` over every (dp,) / (dp, tp) mesh of N
devices for a LLaMA, and the ranking it gives.

    python -m benchmarks.mesh_search [--model llama3-8b] [--devices 64] [--gpus-per-node 8]
        [--batch 64] [--seq 2048] [--hardware h100] [--layers N] [--pipeline]

Plans on fake meshes (nothing allocated); prints the ranked table and appends one record to
``benchmarks/results/mesh_search.jsonl``: the search's wall time (the issue's goal for the
8B over 64 devices: under 60 s), with every candidate's predicted step, exposed
communication, peak memory and planning time. ``--pipeline`` adds the ``(pp, ...)`` meshes
(``search_mesh(pipeline=True)``): the question then ends in ``-pp``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from autoparallel import search_mesh
from autoparallel.models import Llama, llama_config
from benchmarks.results import record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama3-8b", help="a llama_config preset")
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--layers", type=int, default=None, help="override the depth")
    parser.add_argument("--pipeline", action="store_true", help="pipeline meshes too")
    args = parser.parse_args(argv)
    config = llama_config(args.model, **({} if args.layers is None else {"n_layers": args.layers}))
    with torch.device("meta"):
        model = Llama(config)
    start = time.perf_counter()
    found = search_mesh(
        model,
        lambda: torch.randint(0, config.vocab_size, (args.batch, args.seq)),
        args.devices,
        args.gpus_per_node,
        hardware=args.hardware,
        pipeline=args.pipeline,
    )
    elapsed = time.perf_counter() - start
    print("\n".join(found.table()))
    print(f"[mesh_search] {len(found.candidates)} meshes in {elapsed:.1f} s", file=sys.stderr)
    depth = f"{config.n_layers} layers"
    record(
        "mesh_search",
        {
            "question": f"{args.model}-{args.devices}dev" + ("-pp" if args.pipeline else ""),
            "what": f"wall time of search_mesh, {args.model} ({depth}), {args.devices} devices "
            f"of {args.gpus_per_node} per node, batch {args.batch} x seq {args.seq}, "
            f"{args.hardware}: {len(found.candidates)} meshes"
            + (" with pipeline ones" if args.pipeline else "")
            + f", best {found.best.mesh_text}",
            "figure": round(elapsed, 1),
            "unit": "s",
            "candidates": [
                {
                    "mesh": c.mesh_text,
                    "predicted_ms": c.predicted_ms,
                    "exposed_comm_ms": c.exposed_comm_ms,
                    "peak_memory_gib": c.peak_memory_gib,
                    "fits": c.fits,
                    "planning_s": round(c.planning_s, 2),
                    "skipped": c.skipped,
                }
                for c in found.candidates
            ],
        },
        argv,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
