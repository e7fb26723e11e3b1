"""The tokenizers (GPT-2's, the default; tiktoken's other encodings; bytes; a byte-level BPE in a Hugging Face
tokenizer.json) behind one interface; TokenizerSpec, the record of one that data, snapshots and exports keep
(docs/data.md, "Your own tokenizer"); and text through the model (generate_text)."""

import base64
import functools
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import tiktoken
import torch

from model import GPT
from rundir.snapshot import is_snapshot_directory, load_model_snapshot
from training.errors import UserError
from training.files import reason
from training.hf import EXPORT_RECORD, read_export_record

EOT_TEXT = "<|endoftext|>"
EOT_BYTES = EOT_TEXT.encode()
KINDS = ("tiktoken", "bytes", "hf")
# tiktoken_sha256 of GPT-2's encoding (tests check it against its files): gpt2_spec() is known without them
GPT2_SHA256 = "7affe1cd36b71600cd9b24913aaf649c85add537821d00f06d8f5a7abd186fdc"
BYTES_DEFINITION = "bytes: ids 0-255 are the byte values, 256 is <|endoftext|>"
# The most ids a tokenizer here may have: 64 times Gemma's 262,144. The BPE trainer reserves ~66 bytes an id up front
# (2**31 ids: 141 GB, and Rust aborts), and billions of ids would be an embedding no machine holds.
MAX_VOCAB_SIZE = 2**24


@dataclass(frozen=True)
class TokenizerSpec:
    """What a data directory's manifest and every snapshot record of a tokenizer."""
    kind: str  # "tiktoken" (gpt2 and other tiktoken encodings), "bytes", or "hf" (a tokenizer.json)
    name: str  # "gpt2", "bytes", the tiktoken encoding's name, or the name the user gave (its directory)
    sha256: str  # of its definition: two tokenizers of one name are told apart
    vocab_size: int  # ids 0..vocab_size-1
    eot: int  # <|endoftext|>'s id, the document delimiter
    definition: str | None = None  # "hf": the tokenizer.json text

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, recorded, where: str) -> "TokenizerSpec":
        """The spec `where` (a file, a snapshot) recorded; ValueError naming `where` and the problem if malformed."""
        expected = {"kind": str, "name": str, "sha256": str, "vocab_size": int, "eot": int, "definition": str}
        if not isinstance(recorded, dict) or not set(expected) - {"definition"} <= recorded.keys() <= set(expected):
            raise ValueError(f"{where}: its tokenizer record is not an object with the fields {', '.join(expected)}")
        problems = [f"{key} is {value!r}, not {'an' if expected[key] is int else 'a'} {expected[key].__name__}"
                    for key, value in recorded.items()
                    if type(value) is not expected[key] and not (key == "definition" and value is None)]
        if not problems:
            spec = cls(**recorded)
            if spec.kind not in KINDS:
                problems.append(f"kind {spec.kind!r} is not one of {', '.join(KINDS)}")
            if not re.fullmatch(r"[0-9a-f]{64}", spec.sha256):
                problems.append(f"sha256 {spec.sha256!r} is not 64 hex digits")
            if not 1 <= spec.vocab_size <= MAX_VOCAB_SIZE:
                problems.append(f"vocab_size {spec.vocab_size:,} is not 1 to {MAX_VOCAB_SIZE:,}")
            elif not 0 <= spec.eot < spec.vocab_size:
                problems.append(f"eot {spec.eot} is not an id of a vocabulary of {spec.vocab_size:,}")
            if (spec.kind == "hf") != (spec.definition is not None):
                problems.append("definition (the tokenizer.json text) must be there for kind hf, and only for it")
            elif spec.kind == "hf" and hashlib.sha256(spec.definition.encode()).hexdigest() != spec.sha256:
                problems.append("the definition's sha256 is not the one recorded (the record was altered)")
        if problems:
            raise ValueError(f"{where}: its tokenizer record is malformed: {'; '.join(problems)}")
        return spec

    def describe(self) -> str:
        """e.g. "gpt2 (tiktoken, 50,257 ids, sha256 7affe1cd…)", for messages that name two tokenizers."""
        return f"{self.name} ({self.kind}, {self.vocab_size:,} ids, sha256 {self.sha256[:8]}…)"


class Tokenizer:
    """Text to ids and back with one tokenizer; TiktokenTokenizer, ByteTokenizer and HFTokenizer say how."""

    def __init__(self, spec: TokenizerSpec):
        self.spec, self.eot, self.vocab_size = spec, spec.eot, spec.vocab_size

    def encode(self, text: str, allow_eot: bool = False) -> list[int]:
        """The ids of text. allow_eot: "<|endoftext|>" in text is the EOT id (as evals and prompts need); else it is
        plain text (as data preparation needs: a document that mentions it is not cut in two)."""

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ids; bytes that are not valid UTF-8 (a token sequence cut mid-character) become U+FFFD."""

    def token_byte_lengths(self) -> list[int]:
        """The number of UTF-8 bytes each id stands for (0 for special tokens such as EOT), for bits per byte."""


class TiktokenTokenizer(Tokenizer):
    def __init__(self, encoding: tiktoken.Encoding, sha256: str | None = None):
        eot = encoding._special_tokens.get(EOT_TEXT)
        if eot is None:
            raise UserError(f"--tokenizer {encoding.name}: this tiktoken encoding has no {EOT_TEXT} token, which "
                            "separates documents here. Pick one that has (gpt2, r50k_base, cl100k_base, o200k_base).")
        super().__init__(TokenizerSpec("tiktoken", encoding.name, sha256 or tiktoken_sha256(encoding),
                                       encoding.n_vocab, eot))
        self.encoding = encoding

    def encode(self, text: str, allow_eot: bool = False) -> list[int]:
        if allow_eot:
            return self.encoding.encode(text, allowed_special={EOT_TEXT}, disallowed_special=())
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))  # (errors="replace" is tiktoken's default)

    def token_byte_lengths(self) -> list[int]:
        special = set(self.encoding._special_tokens.values())
        tokens = {rank: token for token, rank in self.encoding._mergeable_ranks.items()}  # (some encodings have gaps)
        return [0 if i in special else len(tokens.get(i, b"")) for i in range(self.vocab_size)]


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are the UTF-8 bytes of the text, 256 is <|endoftext|>: the character-level path, no vocabulary."""

    def __init__(self):
        super().__init__(bytes_spec())

    def encode(self, text: str, allow_eot: bool = False) -> list[int]:
        pieces = text.split(EOT_TEXT) if allow_eot else [text]
        return [token for i, piece in enumerate(pieces) for token in ([self.eot] if i else []) + list(piece.encode())]

    def decode(self, ids: Sequence[int]) -> str:
        # (the delimiter's text is ASCII: a character it cuts in two decodes to U+FFFD on each side of it)
        return b"".join(EOT_BYTES if i == self.eot else bytes([i]) for i in ids).decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> list[int]:
        return [1] * 256 + [0]


class HFTokenizer(Tokenizer):
    """A byte-level BPE in a Hugging Face tokenizer.json, with an <|endoftext|> token. Only that kind: every text
    encodes and each token's bytes are known, where another (a WordLevel, say) fails mid-corpus on a word it lacks."""

    def __init__(self, definition: str, name: str):
        import tokenizers  # here: GPT-2's and bytes' paths (the quickstart) do without it
        self.tokenizer = tokenizers.Tokenizer.from_str(definition)  # (exceptions: data/tokenizer_flag.py names them)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        problem = byte_level_bpe_problem(json.loads(definition), vocab)
        if problem:
            raise ValueError(f"{problem}; this code reads byte-level BPEs only (GPT-2's kind: a BPE model, the "
                             "ByteLevel pre-tokenizer and decoder, every byte a token), as data/train_tokenizer.py "
                             "trains them")
        eot = self.tokenizer.token_to_id(EOT_TEXT)
        if eot is None:
            raise ValueError(f"it has no {EOT_TEXT} token, which separates documents here; add it as a special token "
                             "(data/train_tokenizer.py does)")
        vocab_size = max(vocab.values()) + 1
        if vocab_size > MAX_VOCAB_SIZE:
            raise ValueError(f"its largest id is {vocab_size - 1:,}, and a tokenizer here has at most "
                             f"{MAX_VOCAB_SIZE:,} ids")
        super().__init__(TokenizerSpec("hf", name, hashlib.sha256(definition.encode()).hexdigest(), vocab_size, eot,
                                       definition))

    def encode(self, text: str, allow_eot: bool = False) -> list[int]:
        self.tokenizer.encode_special_tokens = not allow_eot  # else special tokens' text is text (encode_ordinary's)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_byte_lengths(self) -> list[int]:
        # a byte-level token's text spells its bytes, a character each (GPT-2's bytes_to_unicode)
        from tokenizers.pre_tokenizers import ByteLevel
        special = {i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special}
        alphabet = set(ByteLevel.alphabet())
        lengths = [0] * self.vocab_size
        for token, i in self.tokenizer.get_vocab(with_added_tokens=True).items():
            lengths[i] = 0 if i in special or not set(token) <= alphabet else len(token)
        return lengths


def byte_level_bpe_problem(definition: dict, vocab: dict[str, int]) -> str | None:
    """What keeps a tokenizer.json (`definition`, parsed; `vocab`, its tokens' ids) from being a byte-level BPE, in
    words; None if nothing does. Its pre-tokenizer may be a Sequence with a ByteLevel in it (Llama 3's is)."""
    from tokenizers.pre_tokenizers import ByteLevel
    model, pre_tokenizer, decoder = (definition.get(part) or {} for part in ("model", "pre_tokenizer", "decoder"))
    sequence = pre_tokenizer.get("type") == "Sequence"
    pre_tokenizers = pre_tokenizer.get("pretokenizers", []) if sequence else [pre_tokenizer]
    missing = [byte for byte in ByteLevel.alphabet() if byte not in vocab]
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')}, not BPE"
    if "ByteLevel" not in [part.get("type") for part in pre_tokenizers]:
        return f"its pre-tokenizer is {pre_tokenizer.get('type')}, not ByteLevel (or a Sequence holding one)"
    if decoder.get("type") != "ByteLevel":
        return f"its decoder is {decoder.get('type')}, not ByteLevel"
    if missing:
        return f"{len(missing)} of the 256 byte values are not tokens (e.g. {missing[0]!r}), so some text cannot encode"
    return None


def tiktoken_sha256(encoding: tiktoken.Encoding) -> str:
    """sha256 of a tiktoken encoding's pattern, ranks (as a .tiktoken file lists them) and special tokens."""
    digest = hashlib.sha256(encoding._pat_str.encode())
    for token, rank in sorted(encoding._mergeable_ranks.items(), key=lambda item: item[1]):
        digest.update(base64.b64encode(token) + f" {rank}\n".encode())
    digest.update(json.dumps(encoding._special_tokens, sort_keys=True).encode())
    return digest.hexdigest()


def gpt2_spec() -> TokenizerSpec:
    """GPT-2's, the default: what data without a manifest and snapshots without a record were written with."""
    return TokenizerSpec("tiktoken", "gpt2", GPT2_SHA256, 50257, 50256)


def bytes_spec() -> TokenizerSpec:
    return TokenizerSpec("bytes", "bytes", hashlib.sha256(BYTES_DEFINITION.encode()).hexdigest(), 257, 256)


def load_tiktoken(name: str) -> tiktoken.Encoding:
    """A tiktoken encoding, or a UserError saying how to get it where there is no network."""
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # tiktoken downloads the files on first use: anything from DNS to HTTP errors
        what = "the GPT-2 tokenizer" if name == "gpt2" else f"the tiktoken encoding {name!r}"
        raise UserError(f"{what} could not be loaded ({reason(e)}): tiktoken downloads an encoding's "
                        "files on first use into its cache. On a node without network, set TIKTOKEN_CACHE_DIR to a "
                        "copy of that cache (README, \"tiktoken without network\"; ../shared/data/gpt2_tokenizer/"
                        "tiktoken_cache holds GPT-2's), or run once where there is network.") from e


@functools.cache  # one per process: data/tokenize_shards.py's pool workers build their own on first use
def gpt2_encoding() -> tiktoken.Encoding:
    return load_tiktoken("gpt2")


def tiktoken_tokenizer(name: str) -> TiktokenTokenizer:
    if name == "gpt2":  # (tiktoken checks the files' sha256; tests check GPT2_SHA256 against them)
        return TiktokenTokenizer(gpt2_encoding(), GPT2_SHA256)
    return TiktokenTokenizer(load_tiktoken(name))


def tokenizer_from_spec(spec: TokenizerSpec) -> Tokenizer:
    """The tokenizer a manifest or snapshot recorded. A UserError if it cannot be had here, or is not the same."""
    if spec.kind == "bytes":
        tokenizer = ByteTokenizer()
    elif spec.kind == "hf":
        try:
            tokenizer = HFTokenizer(spec.definition, spec.name)
        except ValueError as e:  # (a recorded tokenizer.json of a kind this code does not read)
            raise UserError(f"the tokenizer recorded as {spec.describe()} cannot be used here: {e}. Prepare the data "
                            "again with one it reads (`python -m data.train_tokenizer` trains one).") from e
    else:
        tokenizer = tiktoken_tokenizer(spec.name)
    if tokenizer.spec.sha256 != spec.sha256:
        raise UserError(f"the tokenizer recorded as {spec.describe()} is not the one of that name here, "
                        f"{tokenizer.spec.describe()}: another version of its files. Use the files it was recorded "
                        "with.")
    return tokenizer


def read_tokenizer(source: str | Path) -> TokenizerSpec:
    """The tokenizer the model at `source` was trained with: a snapshot's record of it (tokenizer_of), an export's
    (tools/export_hf.py), GPT-2's for any other Hugging Face model (a hub name, or a directory without that record)."""
    path = Path(source)
    if path.is_file() or is_snapshot_directory(path):
        return tokenizer_of(load_model_snapshot(path), path)
    if not (path / EXPORT_RECORD).is_file():
        return gpt2_spec()
    recorded = read_export_record(path, "Export its snapshot again (python -m tools.export_hf).")["tokenizer"]
    if recorded.get("kind") == "hf":  # its definition is the tokenizer.json beside the record
        recorded = recorded | {"definition": (path / "tokenizer.json").read_text(encoding="utf-8")}
    return TokenizerSpec.from_dict(recorded, str(path / EXPORT_RECORD))


def tokenizer_of(state: dict, path: str | Path) -> TokenizerSpec:
    """A snapshot's record of its run's tokenizer (a file with just a model has none: GPT-2's)."""
    return gpt2_spec() if "tokenizer" not in state else TokenizerSpec.from_dict(state["tokenizer"], str(path))


def load_tokenizer_of(path: str | Path) -> Tokenizer:
    """read_tokenizer's tokenizer; a UserError naming both where it cannot be had here (not in the offline cache)."""
    spec = read_tokenizer(path)
    try:
        return tokenizer_from_spec(spec)
    except UserError as e:
        raise UserError(f"{path} was trained with the tokenizer {spec.describe()}, which reads and writes its text: "
                        f"{e}") from e


def check_tokenizer(source: str, its: TokenizerSpec, data_dir: str | Path, data: TokenizerSpec, fix: str) -> None:
    """A UserError naming both unless `source` was trained with the tokenizer of the data (else ids are other text)."""
    if its.sha256 != data.sha256:
        raise UserError(f"{source} was trained with the tokenizer {its.describe()}, but the data in {data_dir} was "
                        f"written with {data.describe()}: the same token id is other text under each. {fix}")


def generate_text(model: GPT, prompt: str, num_samples: int = 4, max_new_tokens: int = 32,
                  temperature: float = 1.0, top_k: int | None = 50, seed: int = 42,
                  top_p: float | None = None, compile: bool = False, tokenizer: Tokenizer | None = None) -> list[str]:
    """num_samples continuations of prompt, the prompt in front, on the model's device (tokenizer None: GPT-2's). A
    private generator leaves the global RNG (a training run's) alone; an empty prompt starts a document (EOT)."""
    tokenizer = tokenizer or tiktoken_tokenizer("gpt2")
    prompt_tokens = tokenizer.encode(prompt, allow_eot=True) or [tokenizer.eot]
    device = next(model.parameters()).device
    idx = torch.tensor(prompt_tokens, dtype=torch.long, device=device).repeat(num_samples, 1)  # (B, T)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
                         compile=compile)
    return [prompt + tokenizer.decode(row[len(prompt_tokens):].tolist()) for row in out]
