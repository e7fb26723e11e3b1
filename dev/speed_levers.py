"""Issue 30's other speed levers, each timed on its own at GPT-2 124M's shapes on one device, in seconds rather than
the minutes a compiled training step per variant would take: the attention backend, AdamW's step (fused or
foreach), Muon's Newton–Schulz over each matrix or batched over the stacked same-shaped ones, and the batch's copy
to the device from pageable or pinned memory.

    python -m dev.speed_levers                                   # on CUDA, 124M's shapes
    python -m dev.speed_levers --device cpu --batch 2 --layers 1  # the command itself, on a CPU
"""

import argparse
import statistics
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from model import GPT, PRESETS
from tools.bench.step import time_ms
from training import optim

NS_ARGS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)  # torch.optim.Muon's coefficients, steps and eps


def median_ms(run: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        run()
    return statistics.median(time_ms(run, device) for _ in range(repeats))


def attention_backends(device: torch.device, batch: int, heads: int, seq_len: int, head_dim: int,
                       repeats: int) -> None:
    """Causal SDPA forward + backward in bf16 under each backend torch offers; one that cannot run says why."""
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    reference = None
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        def step(backend: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))
            return out
        try:
            out = step().float()
            ms = median_ms(step, device, repeats)
        except RuntimeError as e:  # a backend this device or shape cannot run
            print(f"attention {backend.name:20s}: not available ({str(e).splitlines()[0][:100]})")
            continue
        reference = out if reference is None else reference
        print(f"attention {backend.name:20s}: {ms:8.3f} ms forward + backward (B={batch}, T={seq_len}), max |out - "
              f"first backend's| {(out - reference).abs().max().item():.1e}")


def adamw_step(model: GPT, device: torch.device, repeats: int) -> None:
    """torch's AdamW step over the model's parameters: fused (what train_gpt2 uses on CUDA) and foreach."""
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for fused in (True, False):
        optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=fused, foreach=not fused)
        ms = median_ms(optimizer.step, device, repeats)
        print(f"AdamW {'fused' if fused else 'foreach':7s}: {ms:8.3f} ms a step")


def newton_schulz(model: GPT, device: torch.device, repeats: int) -> None:
    """Muon's orthogonalisation of every block matrix's update: one call each (as torch.optim.Muon's loop does)
    against optim.orthogonalise_by_shape (what optim.Muon runs: one call per shape on the stack of its matrices)."""
    updates = [torch.randn_like(p) for name, p in model.named_parameters() if p.dim() == 2 and ".h." in name]

    def one_each() -> list[torch.Tensor]:
        return [optim.orthogonalise_by_shape([u], *NS_ARGS)[0] for u in updates]

    def by_shape() -> list[torch.Tensor]:
        return optim.orthogonalise_by_shape(updates, *NS_ARGS)

    worst = max(((alone.float() - stacked).abs().max() / alone.float().abs().max()).item()
                for alone, stacked in zip(one_each(), by_shape()))
    shapes = {tuple(sorted(u.shape)) for u in updates}
    loop_ms, batched_ms = median_ms(one_each, device, repeats), median_ms(by_shape, device, repeats)
    print(f"Newton–Schulz over {len(updates)} matrices: one call each {loop_ms:8.3f} ms, batched by shape "
          f"({len(shapes)} stacks) {batched_ms:8.3f} ms ({loop_ms / batched_ms:.2f}x), worst relative difference "
          f"{worst:.1e}")


def host_to_device(device: torch.device, batch: int, seq_len: int, repeats: int) -> None:
    """One micro-batch's inputs and targets to the device: from pageable memory, and pinned + non_blocking."""
    if device.type != "cuda":
        print("host to device: not measured (no CUDA device)")
        return
    x, y = (torch.randint(0, 50257, (batch, seq_len)) for _ in range(2))

    def pageable() -> None:
        x.to(device), y.to(device)

    def pinned() -> None:
        x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)

    print(f"host to device, B={batch} x T={seq_len} twice: pageable {median_ms(pageable, device, repeats):.3f} ms, "
          f"pinned + non_blocking {median_ms(pinned, device, repeats):.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=64, help="sequences of the attention and copy timings")
    parser.add_argument("--layers", type=int, default=12, help="124M's 12, or fewer for a quick check")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = PRESETS["gpt2"]
    attention_backends(device, args.batch, config.n_head, config.block_size, config.n_embd // config.n_head,
                       args.repeats)
    model = GPT(replace(config, n_layer=args.layers)).to(device)
    adamw_step(model, device, args.repeats)
    newton_schulz(model, device, args.repeats)
    host_to_device(device, args.batch, config.block_size, args.repeats)


if __name__ == "__main__":
    main()
