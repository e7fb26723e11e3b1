"""Sample text from a snapshot of this codebase or from a Hugging Face GPT-2 (an export of ours too), with the
tokenizer the model was trained with (tokenizer.read_tokenizer).

    python -m tools.sample --snapshot logs/snapshot_0019072.pt
    python -m tools.sample --model gpt2 --prompt "The meaning of life is" --num_samples 2 --max_new_tokens 64

The same --seed gives the same text on the same device and software versions (the random stream of a
torch.Generator differs between CPU, CUDA and MPS, and GPU kernels may differ between versions).
"""

import argparse
import sys

from rundir.snapshot import read_model
from training import hf
from training.config import AT_LEAST_0, AT_LEAST_1, SEEDS, Range, check_range
from training.distributed import checked_device, default_device
from training.errors import run_entry_point
from training.tokenizer import generate_text, load_tokenizer_of

# The values of the sampling flags: outside them sampling crashed (negative counts, a NaN temperature) or sampled
# nonsense (a negative temperature favours the least likely tokens).
SAMPLING_RANGES = {"num_samples": AT_LEAST_1, "max_new_tokens": AT_LEAST_0, "temperature": AT_LEAST_0,
                   "top_k": AT_LEAST_0, "top_p": Range(0, 1, low_open=True), "seed": SEEDS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--snapshot",
                        help="a snapshot_*.pt written by train_gpt2.py (or a file with just its model)")
    source.add_argument("--model", help="Hugging Face GPT-2: a hub name (gpt2, gpt2-medium, ...) or a local directory "
                                        "(tools.export_hf's: with its tokenizer)")
    parser.add_argument("--prompt", default="Hello, I'm a language model,")
    parser.add_argument("--num_samples", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 means greedy (always the likeliest token)")
    parser.add_argument("--top_k", type=int, default=50, help="sample only among the k likeliest tokens; 0 = all")
    parser.add_argument("--top_p", type=float, default=1.0,
                        help="nucleus sampling: only among the likeliest tokens that together have probability "
                             "top_p (after --top_k); 1 = no limit")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--compile", action="store_true",
                        help="compile the one-token decode step (8 kernels a layer instead of ~20): for GPUs, where "
                             "the step's time is its kernels'; costs a compilation at the first call")
    parser.add_argument("--device", default=default_device(), help="cuda, mps or cpu (default: the best available)")
    args = parser.parse_args(argv)
    for flag, allowed in SAMPLING_RANGES.items():
        check_range(flag, getattr(args, flag), allowed)
    device = checked_device(args.device)

    try:
        model = read_model(args.snapshot) if args.snapshot else hf.from_pretrained(args.model)
        tokenizer = load_tokenizer_of(args.snapshot or args.model)
    except (FileNotFoundError, ValueError) as e:  # the message names the file and what is wrong with it
        parser.error(f"--snapshot: {e} (For Hugging Face weights use --model instead.)" if args.snapshot else
                     f"--model: {e}")
    model.to(device)

    texts = generate_text(model, args.prompt, args.num_samples, args.max_new_tokens, args.temperature,
                          args.top_k or None, args.seed, args.top_p, args.compile, tokenizer)
    for i, text in enumerate(texts):
        print(f"--- sample {i} ---\n{text}")


if __name__ == "__main__":
    run_entry_point(lambda: main(sys.argv[1:]))
