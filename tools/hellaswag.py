"""HellaSwag accuracy of a model, standalone (hellaswag.py has the task and its scoring; training runs it every
--hellaswag_every steps, evaluate.py --hellaswag on a snapshot with its run's settings).

    python -m tools.hellaswag --model gpt2                          # Hugging Face GPT-2 (a hub name or a directory)
    python -m tools.hellaswag --snapshot logs/snapshot_0019072.pt   # a snapshot of this codebase

Expected: GPT-2 124M scores acc_norm 0.2955 (acc 0.2859), gpt2-xl acc_norm 0.4893 (float32).
"""

import argparse

import torch

import hf
from distributed import default_device
from errors import UserError
from hellaswag import accuracies, load_examples
from snapshot import read_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="Hugging Face GPT-2: a hub name (gpt2, gpt2-medium, ...) or a local directory")
    source.add_argument("--snapshot", "--ckpt", help="a snapshot_*.pt written by train_gpt2.py")
    parser.add_argument("--hellaswag_path",
                        help="a local hellaswag_val.jsonl (default: download it to data/hellaswag_cache/)")
    parser.add_argument("--limit", type=int, help="evaluate only the first N examples")
    parser.add_argument("--device", default="auto", help="cuda, mps, cpu, or auto (the best one present)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="autocast dtype; the reference numbers above are float32")
    args = parser.parse_args(argv)

    device = default_device() if args.device == "auto" else args.device
    try:
        examples = load_examples(args.hellaswag_path, args.limit)  # before the model, so a bad path fails fast
    except UserError as e:
        parser.error(str(e))
    try:
        model = hf.from_pretrained(args.model) if args.model else read_model(args.snapshot)
    except (FileNotFoundError, ValueError) as e:  # a bad --snapshot: the message names the file and the fix
        parser.error(str(e))
    model.to(device)
    torch.set_float32_matmul_precision("high")  # TF32 on GPUs that have it, as llm.c and build-nanogpt do
    result = accuracies(model, examples, device, getattr(torch, args.dtype), progress=True)
    print(f"acc_norm {result['acc_norm']:.4f}  acc {result['acc']:.4f}  ({len(examples)} examples)")


if __name__ == "__main__":
    main()
