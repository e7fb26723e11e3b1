"""Export a snapshot of this codebase as a Hugging Face GPT-2 model directory.

    python export_hf.py logs/run/model_19072.pt exported/ --tokenizer_dir ../shared/data/gpt2_tokenizer

The directory then loads anywhere transformers does, with the same logits as our model:

    from transformers import GPT2LMHeadModel, GPT2TokenizerFast
    model = GPT2LMHeadModel.from_pretrained("exported/")
    tokenizer = GPT2TokenizerFast.from_pretrained("exported/")   # only if --tokenizer_dir was given

Weights go through transformers' own save_pretrained (model.safetensors), so the layout is whatever the installed
transformers writes and reads, not a hand-made imitation of it.
"""

import argparse
import json
import shutil
from pathlib import Path

from transformers import GPT2Config, GPT2LMHeadModel

from model import GPT

EOT = "<|endoftext|>"


def to_hf(model: GPT) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel holding our weights."""
    cfg = model.config
    hf_config = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_ctx=cfg.block_size,
        n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
        activation_function="gelu_new",  # the tanh approximation of GELU, as in our MLP
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default
        # Our model has no dropout; zero here means fine-tuning in transformers continues the same way.
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=50256, eos_token_id=50256,
    )
    hf_model = GPT2LMHeadModel(hf_config)
    hf_model.load_state_dict(model.hf_state_dict())  # strict: a name or shape mismatch fails here, not later
    return hf_model.eval()


def write_tokenizer(tokenizer_dir: Path, out_dir: Path, model_max_length: int) -> None:
    """Copy OpenAI's GPT-2 tokenizer files under the names transformers looks for."""
    shutil.copyfile(tokenizer_dir / "encoder.json", out_dir / "vocab.json")  # token -> id
    shutil.copyfile(tokenizer_dir / "vocab.bpe", out_dir / "merges.txt")  # BPE merges, in rank order
    tokenizer_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length,
                        "bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "add_prefix_space": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt", type=Path, help="a snapshot_*.pt written by train_gpt2.py (or just its model)")
    parser.add_argument("out_dir", type=Path, help="directory to write (created if missing)")
    parser.add_argument("--tokenizer_dir", type=Path,
                        help="folder with OpenAI's GPT-2 encoder.json and vocab.bpe, e.g. shared/data/gpt2_tokenizer")
    args = parser.parse_args(argv)

    if args.tokenizer_dir is not None:
        missing = [n for n in ("encoder.json", "vocab.bpe") if not (args.tokenizer_dir / n).is_file()]
        if missing:
            parser.error(f"--tokenizer_dir {args.tokenizer_dir} lacks {' and '.join(missing)}. Point it at a folder "
                         "holding OpenAI's GPT-2 encoder.json and vocab.bpe (shared/data/gpt2_tokenizer has both).")
    try:
        model = GPT.from_snapshot(args.ckpt)
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
