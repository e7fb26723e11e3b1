"""--tokenizer's value (data/prepare.py, data/fineweb.py, data/train_tokenizer.py) as a tokenizer of
training/tokenizer.py; a training run reads its data's tokenizer from the shards' manifest instead."""

from pathlib import Path

import tiktoken

from training.errors import UserError
from training.files import reason
from training.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, tiktoken_tokenizer


def load_tokenizer(name: str) -> Tokenizer:
    """--tokenizer's value: gpt2, bytes, a directory or file holding a tokenizer.json, or a tiktoken encoding's name.
    A UserError naming it and the fix otherwise (unknown, malformed, not in tiktoken's cache offline)."""
    if name == "bytes":
        return ByteTokenizer()
    if name in tiktoken.list_encoding_names():  # before paths: a directory named gpt2 (./gpt2 names it) changes nothing
        return tiktoken_tokenizer(name)
    path = Path(name)
    if path.exists():
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            definition = file.read_text(encoding="utf-8")
            return HFTokenizer(definition, file.resolve().parent.name if file.name == "tokenizer.json" else file.stem)
        except Exception as e:  # tokenizers raises its own (unnamed) error kinds for a malformed file
            raise UserError(f"--tokenizer {name}: {file} is not a Hugging Face tokenizer.json that can be used here "
                            f"({reason(e)}). Pass a directory written by `python -m data.train_tokenizer`, or a "
                            "byte-level BPE's tokenizer.json with an <|endoftext|> token.") from e
    raise UserError(f"--tokenizer {name}: no such file or directory, and not a tokenizer's name. Pass gpt2 (the "
                    "default), bytes (a token per byte), a directory holding a tokenizer.json (`python -m "
                    "data.train_tokenizer` writes one), or a tiktoken encoding: "
                    f"{', '.join(tiktoken.list_encoding_names())}.")
