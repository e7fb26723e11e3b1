"""The loss's forward + backward on one micro-batch of GPT-2 124M's final hidden states (B=64, T=1024, bf16,
compiled) at several chunk sizes, against build-nanogpt's full logits: the measurement behind
training/loss.py's loss_chunk_tokens GPU rule.

    python -m dev.loss_chunks --chunks 2048 4096 8192 16384
"""

import argparse

import torch

from tools.bench.loss import time_loss
from tools.bench.step import make_workload
from training.distributed import setup_distributed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("high")
    dist_env = setup_distributed(args.device)
    work = make_workload(dist_env, model="gpt2", micro_batch_size=64, seq_len=1024, device=args.device)
    full = time_loss(work, torch.bfloat16, True, True)
    print(f"full logits: {full:.1f} ms")
    for chunk in args.chunks:
        ms = time_loss(work, torch.bfloat16, True, False, chunk_tokens=chunk)
        print(f"chunks of {chunk:6d} tokens: {ms:.1f} ms ({full / ms:.2f}x the full logits' speed)")


if __name__ == "__main__":
    main()
