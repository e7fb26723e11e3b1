"""Muon's optimizer step on several ranks: every rank orthogonalising every block matrix (under ddp, as before
issue 27) against each rank its share (optim.Muon shared, under ddp and under fsdp).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 -m dev.muon_shares --model gpt2 --steps 3
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=8 -m dev.muon_shares --n_layer 4 --variant 1
    torchrun --standalone --nproc_per_node=8 -m dev.muon_shares --model gpt2     # 8 GPUs (NCCL)

Prints rank 0's median milliseconds per Muon step (after one untimed step) and how many matrices each rank ran
Newton–Schulz on. The gradients are random and the same on every rank, as after DDP's all-reduce: the step's work
does not depend on where they came from. The README's Muon timing table comes from this script. Each rank holds a
whole model, its block matrices' gradients and momentum (1.5-2 GB for GPT-2 124M): where 8 of them do not fit the
RAM, --n_layer keeps 124M's shapes with fewer of them, and --variant runs one variant per launch.
"""
import argparse
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from model import GPT, PRESETS, GPTConfig
from training import optim
from training.config import TrainConfig
from training.distributed import setup_distributed, synchronize, teardown_distributed
from training.parallel import shard

VARIANTS = {"every rank all matrices (ddp)": ("ddp", False),
            "each rank its share (ddp)": ("ddp", True),
            "each rank its share (fsdp)": ("fsdp", True)}


def time_muon_step(config: GPTConfig, parallel: str, shared: bool, steps: int, device: torch.device) -> tuple:
    """(median ms of a Muon step over `steps` steps after an untimed one, Newton–Schulz calls per step here)."""
    torch.manual_seed(0)
    model = GPT(config)
    if parallel == "fsdp":
        shard(model, torch.float32, init_device_mesh(device.type, (dist.get_world_size(),)))
    else:
        model.to(device)
    muon = optim.build_optimizers(model, TrainConfig(optimizer="muon"), device.type, shared=shared).by_name["muon"]
    generator = torch.Generator().manual_seed(1)
    for p in optim.split_for_muon(model)[0]:
        grad = torch.randn(p.shape, generator=generator).to(device)
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad
    calls, real = [0], optim.newton_schulz

    def counted(stack, *args):  # a stack of one shape's matrices
        calls[0] += stack.size(0)
        return real(stack, *args)

    optim.newton_schulz = counted
    try:
        milliseconds = []
        for _ in range(steps + 1):
            dist.barrier()
            synchronize(device)
            t0 = time.perf_counter()
            muon.step()
            synchronize(device)
            milliseconds.append(1000 * (time.perf_counter() - t0))
    finally:
        optim.newton_schulz = real
    return statistics.median(milliseconds[1:]), calls[0] // (steps + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=list(PRESETS))
    parser.add_argument("--n_layer", type=int, help="fewer layers than the preset's (its matrices' shapes, fewer)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--variant", type=int, choices=range(len(VARIANTS)),
                        help="only this one (0, 1, 2: the order printed), e.g. where the RAM fits one model per rank")
    args = parser.parse_args()
    dist_env = setup_distributed(args.device, "fsdp")  # (fsdp: a process group even for one process)
    config = replace(PRESETS[args.model], n_layer=args.n_layer or PRESETS[args.model].n_layer)
    rows = []
    for i, (name, (parallel, shared)) in enumerate(VARIANTS.items()):
        if args.variant is not None and i != args.variant:
            continue
        ms, calls = time_muon_step(config, parallel, shared, args.steps, dist_env.device)
        per_rank = [None] * dist_env.world_size
        dist.all_gather_object(per_rank, calls)
        rows.append((name, ms, per_rank))
    if dist_env.is_master:
        print(f"{args.model}, {config.n_layer} layers: Muon step over {4 * config.n_layer} block matrices, "
              f"{dist_env.world_size} rank(s) on "
              f"{dist_env.device} ({torch.get_num_threads()} thread(s) each), median of {args.steps} steps")
        for name, ms, per_rank in rows:
            print(f"{name:48s} {ms:10,.1f} ms   Newton–Schulz calls per rank: {per_rank}")
    teardown_distributed()


if __name__ == "__main__":
    main()
