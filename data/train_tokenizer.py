"""Train a byte-level BPE tokenizer on your own text, for data/prepare.py and data/fineweb.py --tokenizer DIR.

    python -m data.train_tokenizer --input ../shared/data/enwiki/enwiki.jsonl.gz --vocab_size 32768 \
        --output tokenizers/enwiki32k
    python -m data.prepare --input ../shared/data/enwiki/enwiki.jsonl.gz --tokenizer tokenizers/enwiki32k \
        --output_dir data/enwiki32k

The tokenizer is GPT-2's kind, trained with Hugging Face `tokenizers` (no hand-written BPE): text is cut into words
by GPT-2's regex and each word's UTF-8 bytes are merged, so that every byte sequence encodes (the 256 byte values are
its first tokens: no unknown token) and decoding gives the text back. <|endoftext|> is its special token, the
document delimiter. --vocab_size counts them all (at least 257: 256 bytes and the delimiter); a small corpus may run
out of merges first, and the vocabulary is then smaller (printed).

Inputs are read as data/prepare.py reads them: a text file is one document, a .jsonl(.gz) file one a line. The last
--held_out of each file (a JSON-lines file's documents; a text file's characters: 1 % by default) is not trained on:
the tokenizer's bytes per token on it, against GPT-2's, says how well it compresses text like yours. Writes
OUTPUT/tokenizer.json (the standard format: transformers' PreTrainedTokenizerFast reads it), atomically.
"""

import argparse
import time
from pathlib import Path

from data.bpe import train_bpe
from data.tokenize_shards import check_input_files, check_output_dir, is_jsonl, read_documents, split_val
from data.tokenizer_flag import load_tokenizer
from training.errors import UserError, run_entry_point
from training.files import atomic_write
from training.tokenizer import EOT_TEXT, MAX_VOCAB_SIZE

MIN_VOCAB = 257  # the 256 byte values and <|endoftext|>


def bpe_vocab_size(text: str) -> int:
    """--vocab_size's argparse type: MIN_VOCAB to MAX_VOCAB_SIZE ids, so that a huge one is an error naming the flag,
    not the trainer's abort as it reserves memory for that many ids."""
    try:
        size = int(text)
    except ValueError:
        size = 0
    if not MIN_VOCAB <= size <= MAX_VOCAB_SIZE:
        raise argparse.ArgumentTypeError(
            f"{text}: a byte-level BPE has {MIN_VOCAB:,} to {MAX_VOCAB_SIZE:,} tokens, the 256 byte values and "
            "<|endoftext|> included (at 257 it has no merges: pass --tokenizer bytes to data/prepare.py for that); "
            "pass e.g. 8192 or 32768.")
    return size


def bytes_per_token(encode, documents: list[str]) -> float:
    """UTF-8 bytes of the documents per token that `encode` gives them."""
    num_bytes = sum(len(document.encode("utf-8")) for document in documents)
    return num_bytes / max(1, sum(len(encode(document)) for document in documents))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, nargs="+", required=True,
                        help="text files (UTF-8), a document each, or .jsonl/.jsonl.gz files, a document a line")
    parser.add_argument("--vocab_size", type=bpe_vocab_size, required=True,
                        help=f"tokens in all, the 256 bytes and <|endoftext|> included ({MIN_VOCAB:,} to "
                             f"{MAX_VOCAB_SIZE:,}); over 65,536 makes 32-bit shards")
    parser.add_argument("--output", type=Path, required=True, help="directory for tokenizer.json (created)")
    parser.add_argument("--held_out", type=float, default=0.01,
                        help="fraction of each file, from its end, kept out of training to measure bytes per token "
                             "(default 0.01)")
    args = parser.parse_args(argv)
    if not 0 <= args.held_out < 1:
        parser.error(f"--held_out {args.held_out}: must be at least 0 and below 1")
    check_input_files(parser, args.input)
    check_output_dir(parser, args.output)

    splits = [split_val(read_documents(path), not is_jsonl(path), args.held_out) for path in args.input]
    held_out = [d for held, _ in splits for d in held if d]
    train = [d for _, documents in splits for d in documents]
    if not any(train):
        raise UserError(f"--input {' '.join(map(str, args.input))}: no text to train on. Pass files with text in them.")
    t0 = time.time()
    tokenizer = train_bpe(train, args.vocab_size)
    seconds = time.time() - t0
    path = args.output / "tokenizer.json"
    definition = tokenizer.to_str(pretty=True)
    atomic_write(path, lambda f: f.write(definition.encode("utf-8")))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    short = "" if vocab_size == args.vocab_size else " (the corpus ran out of merges below --vocab_size)"
    print(f"wrote {path}: {vocab_size:,} tokens{short}, <|endoftext|> = {tokenizer.token_to_id(EOT_TEXT)}; trained "
          f"on {len(train):,} documents in {seconds:.1f} s")
    if not held_out:
        return
    ours = load_tokenizer(str(path))  # as data/prepare.py will read it
    held_out_bytes = sum(len(document.encode("utf-8")) for document in held_out)
    line = f"held out: {held_out_bytes:,} bytes, {bytes_per_token(ours.encode, held_out):.3f} bytes per token"
    try:
        line += f" (GPT-2's: {bytes_per_token(load_tokenizer('gpt2').encode, held_out):.3f})"
    except UserError as e:  # offline without tiktoken's cache: ours alone
        line += f" (GPT-2's not measured: {str(e).split(' (')[0]})"
    print(line)

if __name__ == "__main__":
    run_entry_point(main)
