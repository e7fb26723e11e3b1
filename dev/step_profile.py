"""Where a compiled training micro-step's time goes, for --arch gpt2 and modern side by side (GPT-2 124M's size,
B=64, T=1024, bf16): each one's forward + backward timed (the median of --repeats, after 3 warm-ups) and their
ratio, then torch.profiler over one micro-step, the kernels that take the most device time. The measurement behind
issue 26's step-time bound (on an H100: 1.156x before the rotation's table, 1.011x with it) and issue 30's loss.

    python -m dev.step_profile                        # one CUDA GPU: both architectures, compiled
    python -m dev.step_profile --device cpu --model small --micro_batch_size 4 --seq_len 256 --no-compile
"""

import argparse
import statistics

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from model import GPT, PRESETS, with_arch
from tools.bench.step import time_ms
from training.distributed import synchronize
from training.precision import autocast


def timed_and_profiled_micro_step(arch: str, args: argparse.Namespace) -> tuple[float, profile]:
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
    milliseconds = statistics.median(time_ms(micro_step, device) for _ in range(args.repeats))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        micro_step()
        synchronize(device)
    return milliseconds, prof


def device_ms(events) -> float:
    """The kernels' time: the sum over device events only (an operator's row repeats its kernels' time)."""
    return sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="gpt2", choices=list(PRESETS))
    parser.add_argument("--micro_batch_size", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--rows", type=int, default=15, help="kernels listed per architecture")
    parser.add_argument("--repeats", type=int, default=20, help="micro-steps timed per architecture")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("high")
    cuda = torch.device(args.device).type == "cuda"
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    shape = f"B={args.micro_batch_size}, T={args.seq_len}, {'compiled' if args.compile else 'eager'}"
    milliseconds = {}
    for arch in ("gpt2", "modern"):
        milliseconds[arch], prof = timed_and_profiled_micro_step(arch, args)
        events = prof.key_averages()
        busy = f", {device_ms(events):,.1f} ms of it in kernels" if cuda else ""
        print(f"== {arch}: {milliseconds[arch]:,.1f} ms a micro-step ({shape}; the median of {args.repeats}){busy}")
        print(events.table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=70))
    print(f"modern's micro-step: {milliseconds['modern'] / milliseconds['gpt2']:.3f}x gpt2's")

if __name__ == "__main__":
    main()
