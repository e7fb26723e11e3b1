"""Export a snapshot of this codebase as a Hugging Face model directory: GPT-2 (GPT2LMHeadModel), or, for an
--arch modern run, Qwen3 (Qwen3ForCausalLM, the standard class with the same decoder).

    python -m tools.export_hf logs/run/model_19072.pt exported/ --tokenizer_dir ../shared/data/gpt2_tokenizer

The directory then loads anywhere transformers does (and what reads transformers' directories: vLLM, llama.cpp's
converter), with the same logits as our model:

    from transformers import AutoModelForCausalLM, GPT2TokenizerFast
    model = AutoModelForCausalLM.from_pretrained("exported/")
    tokenizer = GPT2TokenizerFast.from_pretrained("exported/")   # only if --tokenizer_dir was given

Weights go through transformers' own save_pretrained (model.safetensors), so the layout is whatever the installed
transformers writes and reads, not a hand-made imitation of it.
"""

import argparse
import json
import shutil
from pathlib import Path

from hf import to_hf
from snapshot import read_model

EOT = "<|endoftext|>"


def write_tokenizer(tokenizer_dir: Path, out_dir: Path, model_max_length: int) -> None:
    """Copy OpenAI's GPT-2 tokenizer files under the names transformers looks for."""
    shutil.copyfile(tokenizer_dir / "encoder.json", out_dir / "vocab.json")  # token -> id
    shutil.copyfile(tokenizer_dir / "vocab.bpe", out_dir / "merges.txt")  # BPE merges, in rank order
    tokenizer_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length,
                        "bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "add_prefix_space": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshot", type=Path, help="a snapshot_*.pt written by train_gpt2.py (or just its model)")
    parser.add_argument("out_dir", type=Path, help="directory to write (created if missing)")
    parser.add_argument("--tokenizer_dir", type=Path,
                        help="folder with OpenAI's GPT-2 encoder.json and vocab.bpe, e.g. shared/data/gpt2_tokenizer")
    args = parser.parse_args(argv)

    if args.tokenizer_dir is not None:
        missing = [n for n in ("encoder.json", "vocab.bpe") if not (args.tokenizer_dir / n).is_file()]
        if missing:
            parser.error(f"--tokenizer_dir {args.tokenizer_dir} lacks {' and '.join(missing)}. Point it at a folder "
                         "holding OpenAI's GPT-2 encoder.json and vocab.bpe (shared/data/gpt2_tokenizer has both).")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"{args.out_dir} is a file; pass a directory to write the model into (created if missing).")
    try:
        model = read_model(args.snapshot)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))

    args.out_dir.mkdir(parents=True, exist_ok=True)
    to_hf(model).save_pretrained(args.out_dir)
    print(f"wrote {args.out_dir}: {model.num_params(non_embedding=False):,} parameters, "
          f"config {model.config}")
    if args.tokenizer_dir is not None:
        write_tokenizer(args.tokenizer_dir, args.out_dir, model.config.block_size)
        print(f"wrote the GPT-2 tokenizer (vocab.json, merges.txt, tokenizer_config.json) from {args.tokenizer_dir}")
    else:
        print("the tokenizer was NOT included. To add it, rerun with --tokenizer_dir pointing at a folder holding "
              "OpenAI's encoder.json and vocab.bpe, or, online, run "
              f"AutoTokenizer.from_pretrained('gpt2').save_pretrained('{args.out_dir}').")


if __name__ == "__main__":
    main()
