"""Where torch.compile's extra peak memory goes: one training micro-step of GPT-2 124M, eager against compiled, the
allocator's peak above the model's state and the bytes autograd saves for backward (by shape), on one CUDA GPU;
compiled with each --loss_schedules (dev/loss_schedules.py: where the loss's chunk loop runs) asked for.

    python -m dev.compiled_memory --micro_batch_size 16
    python -m dev.compiled_memory --micro_batch_size 128 --loss_schedules inline grad_w_op compiled_chunks
"""

import argparse
from collections import Counter

import torch

from dev.loss_schedules import SCHEDULES, loss_schedule
from model import GPT, PRESETS


def micro_step(model: torch.nn.Module, idx: torch.Tensor) -> tuple[int, Counter]:
    """Peak bytes above what was allocated before, and the saved tensors' bytes by (shape, dtype)."""
    saved: Counter = Counter()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))] += tensor.numel() * tensor.element_size()
        return tensor

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cuda", torch.bfloat16):
            _, loss = model(idx, idx)
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro_batch_size", type=int, default=16)
    parser.add_argument("--loss_schedules", nargs="+", choices=SCHEDULES, default=["inline"],
                        help="the compiled step's, one line each")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("high")
    idx = torch.randint(0, 50257, (args.micro_batch_size, 1024), device="cuda")
    for schedule in [None, *args.loss_schedules]:  # None: eager
        torch.manual_seed(0)
        model = GPT(PRESETS["gpt2"]).cuda()
        for p in model.parameters():  # the steady state of gradient accumulation: gradients exist already
            p.grad = torch.zeros_like(p)
        step = torch.compile(model) if schedule else model
        with loss_schedule(schedule or "inline"):
            micro_step(step, idx)  # compiles, and loads the kernels
            peak, saved = micro_step(step, idx)
        name = "eager" if schedule is None else "compiled" if schedule == "inline" else f"compiled, loss {schedule}"
        print(f"{name:8s}: peak {peak / 2**30:.2f} GiB above the state, saved for "
              f"backward {sum(saved.values()) / 2**30:.2f} GiB; largest: "
              + ", ".join(f"{shape} {dtype} {n / 2**20:,.0f} MiB" for (shape, dtype), n in saved.most_common(8)))
        del model, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
