"""Tokens/s of generation with the key/value cache (GPT.generate) and without it (a whole-context forward per
token), in one run so that both see the same machine load. The README's figures come from this script.

    python dev/generation_speed.py                     # 124M, random weights, 16-token prompt, 256 new tokens
    python dev/generation_speed.py --threads 8 --device cuda
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `import model` when run as a script

import torch

from distributed import synchronize
from model import GPT, PRESETS, sample_next_token


@torch.no_grad()
def generate_without_cache(model: GPT, idx: torch.Tensor, max_new_tokens: int, top_k: int,
                           generator: torch.Generator) -> torch.Tensor:
    """What GPT.generate did before the cache: every token from a forward over the whole context."""
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.block_size:])
        idx = torch.cat((idx, sample_next_token(logits[:, -1].float(), 1.0, top_k, None, generator)), dim=1)
    return idx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=list(PRESETS))
    parser.add_argument("--prompt_tokens", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: fair on a shared machine)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(PRESETS[args.model]).to(args.device).eval()  # random weights: the speed is the same
    device = torch.device(args.device)
    idx = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens), device=device)
    # sample.py's defaults: temperature 1, top_k 50, one seeded generator per call.
    runs = {"with cache": lambda g: model.generate(idx, args.new_tokens, 1.0, 50, generator=g),
            "without cache": lambda g: generate_without_cache(model, idx, args.new_tokens, 50, g)}
    outputs, speeds = {}, {}
    for name, run in runs.items():
        synchronize(device)
        t0 = time.perf_counter()
        outputs[name] = run(torch.Generator(device=device).manual_seed(42))
        synchronize(device)
        seconds = time.perf_counter() - t0
        speeds[name] = args.new_tokens / seconds
        print(f"{name:14s}: {args.new_tokens} tokens in {seconds:6.1f} s = {speeds[name]:7.2f} tokens/s")
    print(f"speed-up: {speeds['with cache'] / speeds['without cache']:.1f}x | same tokens: "
          f"{torch.equal(outputs['with cache'], outputs['without cache'])}")


if __name__ == "__main__":
    main()
