"""Plan a LLaMA-style model on a fake (2, 4) ("dp", "tp") mesh, on this CPU.

Nothing is allocated and nothing communicates: the model is built on the meta device and the
mesh lives on torch's fake process group. Prints each parameter's placements (in mesh-dim
order) and the cost totals of the plan.

    python examples/plan_llama.py [--model llama3-8b] [--layers 2] [--batch 8] [--seq 2048]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel, fake_mesh
from autoparallel.models import Llama, llama_config
from autoparallel.report.summary import parameter_lines, solver_lines, totals_lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama3-8b", help="llama3-8b, llama3-70b or tiny")
    parser.add_argument(
        "--layers", type=int, default=2, help="number of transformer blocks to plan"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mesh", default="2x4", help="mesh shape, e.g. 2x4")
    parser.add_argument("--verbose", action="store_true", help="log every node's decision")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    shape = tuple(int(s) for s in args.mesh.split("x"))
    names = ("dp", "tp", "cp")[: len(shape)] if len(shape) <= 3 else None
    mesh = fake_mesh(shape, names)  # one process plans for every rank

    config = llama_config(args.model, n_layers=args.layers)
    with torch.device("meta"):
        model = Llama(config)
    batch_sharded = (Shard(0),) + (Replicate(),) * (len(shape) - 1)

    def input_fn() -> torch.Tensor:
        return torch.randint(0, config.vocab_size, (args.batch, args.seq))

    start = time.perf_counter()
    with AutoParallel(model, input_fn, mesh) as autop:
        autop.add_input_constraints([batch_sharded])
        autop.add_output_constraints([batch_sharded])
        autop.add_parameter_memory_constraint()
        autop.optimize_placement(verbose=args.verbose)
        data = autop.sharding_optimizer.get_json()
    elapsed = time.perf_counter() - start

    print(
        f"\n{args.model} ({args.layers} layers), batch {args.batch} x seq {args.seq}, mesh {dict(zip(names, shape))}"
    )
    for line in parameter_lines(data) + totals_lines(data) + solver_lines(data):
        print(line)
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in autop.stage_times_s.items())
    print(f"planning took {elapsed:.1f} s ({stages})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
