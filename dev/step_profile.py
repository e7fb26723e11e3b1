"""Where a compiled training micro-step's time goes: torch.profiler over one forward + backward of --arch gpt2 and
modern (GPT-2 124M's size, B=64, T=1024, bf16), the kernels that take the most device time, side by side. The
measurement behind issue 26's step-time bound (modern took 1.21x gpt2's step on an H100) and issue 30's loss.

    python -m dev.step_profile                        # one CUDA GPU: both architectures, compiled
    python -m dev.step_profile --device cpu --model small --micro_batch_size 4 --seq_len 256 --no-compile
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from model import GPT, PRESETS, with_arch
from precision import autocast


def profiled_micro_step(arch: str, args: argparse.Namespace) -> profile:
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = GPT(with_arch(PRESETS[args.model], arch)).to(device)  # as train_gpt2.py builds it
    step = torch.compile(model) if args.compile else model
    idx = torch.randint(0, model.config.vocab_size, (args.micro_batch_size, args.seq_len), device=device)

    def micro_step() -> None:
        with autocast(device, torch.bfloat16):
            _, loss = step(idx, idx)
        loss.backward()

    for _ in range(3):  # compiles, loads the kernels, makes the gradients: the steady state
        micro_step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        micro_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    return prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="gpt2", choices=list(PRESETS))
    parser.add_argument("--micro_batch_size", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--rows", type=int, default=15, help="kernels listed per architecture")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("high")
    sort_by = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
    for arch in ("gpt2", "modern"):
        events = profiled_micro_step(arch, args).key_averages()
        total_ms = sum(getattr(e, sort_by) for e in events) / 1000
        print(f"== {arch}: {total_ms:,.1f} ms of {'device' if args.device == 'cuda' else 'CPU'} time in one "
              f"micro-step (B={args.micro_batch_size}, T={args.seq_len}, "
              f"{'compiled' if args.compile else 'eager'})")
        print(events.table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
