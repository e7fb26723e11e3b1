"""tokenizer.py, data/train_tokenizer.py and the shards that know their tokenizer (issue 56): every text round-trips
through each kind of tokenizer, GPT-2's shards stay byte-identical, bytes and 32-bit shards are written and read back
exactly, a directory holds one tokenizer's shards, and each bad input is exit 2 naming it."""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from data import prepare, train_tokenizer
from data.tokenizer_flag import load_tokenizer
from dataloader import (
    HEADER_BYTES,
    MANIFEST,
    MANIFEST_VERSION,
    DistributedDataLoader,
    find_shards,
    read_data_tokenizer,
    read_shard_layout,
    write_shard,
)
from helpers_train import run_train
from training import tokenizer
from training.config import TrainConfig
from training.errors import UserError
from training.inputs import model_config
from training.tokenizer import TokenizerSpec, bytes_spec, gpt2_spec, tokenizer_from_spec

# Text a tokenizer must give back exactly: emoji (a ZWJ sequence, a flag), CJK, combining marks, right-to-left,
# control characters, whitespace runs, and the delimiter's text as plain text.
HARD_TEXTS = ["Hello, world! It's 3.14 — naïve café",
              "\U0001F469\u200d\U0001F469\u200d\U0001F467 \U0001F1EB\U0001F1F7 🙂🙂",
              "日本語のテキストと中文", "e\u0301 a\u0308\u0323 Z\u0324\u0354\u0367", "שלום عربي",
              "tab\there\r\nnull\x00 bell\x07", "   many   spaces\n\n\n", "a <|endoftext|> b", ""]


def random_texts(count: int, seed: int = 0) -> list[str]:
    """Strings of random code points from every plane in use (no surrogates: they are not str-able as UTF-8)."""
    rng = np.random.default_rng(seed)
    ranges = [(0x20, 0x7F), (0x80, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x20000), (0x1F300, 0x1FAFF)]
    texts = []
    for _ in range(count):
        low, high = np.array(ranges)[rng.integers(0, len(ranges), size=40)].T
        texts.append("".join(map(chr, rng.integers(low, high))))
    return texts


def shard_tokens(path: Path) -> list[int]:
    num_tokens, dtype = read_shard_layout(path)
    return np.fromfile(path, dtype=dtype, offset=HEADER_BYTES).tolist()


def cli(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ | (env or {}))


@pytest.fixture(scope="module")
def enwiki_slice(shared_data, tmp_path_factory) -> Path:
    """enwiki's first 60 documents (about 1 MB) as JSON lines."""
    import gzip
    path = tmp_path_factory.mktemp("enwiki") / "slice.jsonl"
    with gzip.open(shared_data / "enwiki" / "enwiki.jsonl.gz", "rt") as f:
        path.write_text("".join(line for _, line in zip(range(60), f)))
    return path


@pytest.fixture(scope="module")
def trained(enwiki_slice, tmp_path_factory) -> Path:
    """A byte-level BPE of 1,000 tokens trained on the slice by the real command's main (about 2 s)."""
    output = tmp_path_factory.mktemp("tokenizers") / "enwiki1k"
    train_tokenizer.main(["--input", str(enwiki_slice), "--vocab_size", "1000", "--output", str(output)])
    return output


@pytest.fixture
def tokenizers_to_check(trained, gpt2_encoding) -> list[tokenizer.Tokenizer]:
    return [load_tokenizer(str(trained)), load_tokenizer("bytes"), load_tokenizer("gpt2")]


def test_every_text_round_trips_through_each_tokenizer(tokenizers_to_check):
    for tok in tokenizers_to_check:
        lengths = tok.token_byte_lengths()  # bits per byte count each token's bytes: they add up to the text's
        for text in HARD_TEXTS + random_texts(200):
            ids = tok.encode(text)
            assert tok.decode(ids) == text, (tok.spec.name, text)
            assert all(0 <= i < tok.vocab_size for i in ids)
            assert tok.eot not in ids  # "<|endoftext|>" in a document is plain text
            assert sum(lengths[i] for i in ids) == len(text.encode("utf-8")), tok.spec.name


def test_allow_eot_reads_the_delimiter_and_a_cut_character_decodes_to_the_replacement(tokenizers_to_check):
    for tok in tokenizers_to_check:
        ids = tok.encode("a<|endoftext|>b", allow_eot=True)
        assert ids == tok.encode("a") + [tok.eot] + tok.encode("b")
        assert tok.decode(ids) == "a<|endoftext|>b"
        assert tok.token_byte_lengths()[tok.eot] == 0
        emoji = tok.encode("🙂")  # 4 UTF-8 bytes: in GPT-2's and the small BPE, more than one token
        assert len(emoji) > 1 and tok.decode(emoji[:1]) == "\ufffd"  # no exception


def test_the_trained_tokenizer_has_every_byte_and_compresses_better_than_bytes(trained, enwiki_slice):
    tok = load_tokenizer(str(trained))
    assert (tok.spec.kind, tok.spec.name, tok.vocab_size) == ("hf", "enwiki1k", 1000)
    assert tok.spec.sha256 == hashlib.sha256((trained / "tokenizer.json").read_bytes()).hexdigest()
    single_bytes = [i for i, n in enumerate(tok.token_byte_lengths()) if n == 1]
    assert len(single_bytes) == 256  # the initial alphabet: every byte, seen in the corpus or not
    text = json.loads(enwiki_slice.read_text().splitlines()[-1])["text"]
    assert len(text.encode()) / len(tok.encode(text)) > 2.2  # 1,000 tokens: 2.5 bytes a token on English


def test_gpt2_spec_is_known_without_its_files_and_is_what_its_files_give(gpt2_encoding):
    assert tokenizer.tiktoken_sha256(gpt2_encoding) == tokenizer.GPT2_SHA256
    assert load_tokenizer("gpt2").spec == gpt2_spec() == TokenizerSpec("tiktoken", "gpt2", tokenizer.GPT2_SHA256,
                                                                       50257, 50256)


def test_a_spec_round_trips_through_its_dict_and_a_malformed_one_is_named(trained):
    spec = load_tokenizer(str(trained)).spec
    assert TokenizerSpec.from_dict(json.loads(json.dumps(spec.to_dict())), "x") == spec
    assert tokenizer_from_spec(spec).encode("Hello world") == load_tokenizer(str(trained)).encode("Hello world")
    for change, problem in [({"kind": "sentencepiece"}, "kind 'sentencepiece' is not one of"),
                            ({"vocab_size": "1000"}, "vocab_size is '1000', not an int"),
                            ({"eot": 1000}, "eot 1000 is not an id of a vocabulary of 1,000"),
                            ({"vocab_size": 3 * 10**9}, "vocab_size 3,000,000,000 is not 1 to 16,777,216"),
                            ({"definition": spec.definition + " "}, "the definition's sha256 is not the one recorded")]:
        with pytest.raises(ValueError, match=f"^snapshot.pt: its tokenizer record is malformed: {problem}"):
            TokenizerSpec.from_dict(spec.to_dict() | change, "snapshot.pt")
    with pytest.raises(ValueError, match="^snapshot.pt: its tokenizer record is not an object with the fields kind"):
        TokenizerSpec.from_dict({"kind": "hf"}, "snapshot.pt")


def test_gpt2_shards_are_byte_identical_with_and_without_the_flag(tmp_path, gpt2_encoding):
    texts = ["First document.\n", "Second <|endoftext|> one, with émoji 🙂.\n"]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    inputs = [str(tmp_path / f"{i}.txt") for i in range(2)]
    prepare.main(["--input", *inputs, "--output_dir", str(tmp_path / "default" / "d")])
    prepare.main(["--input", *inputs, "--output_dir", str(tmp_path / "flag" / "d"), "--tokenizer", "gpt2"])
    for name in ("d_val_000000.bin", "d_train_000000.bin"):
        assert (tmp_path / "default" / "d" / name).read_bytes() == (tmp_path / "flag" / "d" / name).read_bytes()
    manifest = json.loads((tmp_path / "flag" / "d" / MANIFEST).read_text())
    assert manifest == {"version": MANIFEST_VERSION, "tokenizer": gpt2_spec().to_dict(),
                        "shards": ["d_train_000000.bin", "d_val_000000.bin"]}
    stream = shard_tokens(tmp_path / "flag" / "d" / "d_train_000000.bin")
    cut = [int(len(text) * 0.9) for text in texts]  # the last 10 % of each text is val
    assert stream == [t for text, c in zip(texts, cut) for t in [50256, *gpt2_encoding.encode_ordinary(text[:c])]]


def test_bytes_shards_hold_the_utf8_bytes_and_the_loader_reads_them_back(tmp_path, shared_data):
    text = (shared_data / "tinyshakespeare" / "input.txt").read_text()[:20_000] + "\nnaïve 🙂\n"
    (tmp_path / "input.txt").write_text(text)
    out = tmp_path / "bytes"
    prepare.main(["--input", str(tmp_path / "input.txt"), "--source", "shakespeare", "--output_dir", str(out),
                  "--tokenizer", "bytes"])
    cut = int(len(text) * 0.9)  # nanoGPT's split, by characters; no EOT (one text)
    assert shard_tokens(out / "bytes_train_000000.bin") == list(text[:cut].encode())
    assert shard_tokens(out / "bytes_val_000000.bin") == list(text[cut:].encode())
    assert read_shard_layout(out / "bytes_val_000000.bin")[1] == np.dtype("<u2")
    loader = DistributedDataLoader(out, "val", 2, 16, vocab_size=257)
    assert loader.tokenizer == read_data_tokenizer(out) == bytes_spec()
    x, y = loader.next_batch()
    assert bytes(x.flatten().tolist()) == text[cut:].encode()[:32] and y[0, 0] == x[0, 1]
    assert model_config(TrainConfig(data_dir=str(out), model="tiny")).vocab_size == 257  # the model's vocabulary
    assert model_config(TrainConfig(data_dir=str(out), model="tiny")).padded_vocab_size == 384


@pytest.mark.slow  # two pool workers start, each building the tokenizer: about 10 s on 2 busy cores
def test_fineweb_with_a_trained_tokenizer_writes_the_same_shards_in_two_processes(trained, enwiki_slice, tmp_path):
    from data import fineweb
    lines = enwiki_slice.read_text().splitlines(keepends=True)[:8]
    (tmp_path / "docs.jsonl").write_text("".join(lines))
    for name, num_proc in (("one", "1"), ("two", "2")):  # two: each pool worker builds the tokenizer from its spec
        fineweb.main(["--input", str(tmp_path / "docs.jsonl"), "--output_dir", str(tmp_path / name), "--shard_size",
                      "10000", "--num_proc", num_proc, "--tokenizer", str(trained)])
    one, two = sorted((tmp_path / "one").glob("*.bin")), sorted((tmp_path / "two").glob("*.bin"))
    assert len(one) == len(two) >= 3 and all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two))
    tok = load_tokenizer(str(trained))
    documents = [json.loads(line)["text"] for line in lines]
    stream = [t for path in [one[-1], *one[:-1]] for t in shard_tokens(path)]  # val_000000 first, then train
    assert stream == [t for document in documents for t in [tok.eot, *tok.encode(document)]]
    assert read_data_tokenizer(tmp_path / "two") == tok.spec


def test_align_bos_rows_start_after_the_datas_own_eot(tmp_path, shared_data):
    documents = [f"Document {i}: " + "x" * (i % 7) for i in range(400)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    prepare.main(["--input", str(tmp_path / "docs.jsonl"), "--output_dir", str(tmp_path / "d"), "--tokenizer",
                  "bytes"])
    loader = DistributedDataLoader(tmp_path / "d", "train", 4, 16, align_bos=True)
    for _ in range(5):
        x, _ = loader.next_batch()
        for row in x.tolist():
            assert bytes(row[:9]) == b"Document " or row[0] == 256  # a document's first byte, never mid-document


def byte_level_bpe(path: Path, size: int = 70_000, eot: bool = True) -> Path:
    """A byte-level BPE's tokenizer.json of `size` ids (each byte its own value's id, then tokens no merge makes) and
    <|endoftext|> as id `size` (unless eot=False): with the default size, more ids than uint16 holds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    vocab = {char: byte for byte, char in bytes_to_unicode().items()} | {f"unused{i}": i for i in range(256, size)}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if eot:
        tok.add_special_tokens(["<|endoftext|>"])
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def word_level(path: Path) -> Path:
    """A valid tokenizer.json that is no byte-level BPE: words, with no unknown token (an unseen word fails)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"some": 0, "text": 1}))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_32_bit_shards_above_65536_ids_are_written_and_read_back_exactly(tmp_path):
    text = "naïve text, 🙂 " * 30
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text("val")
    wide = byte_level_bpe(tmp_path / "wide")
    prepare.main(["--input", str(tmp_path / "a.txt"), "--val_input", str(tmp_path / "b.txt"), "--output_dir",
                  str(tmp_path / "d"), "--tokenizer", str(wide)])
    path = tmp_path / "d" / "d_train_000000.bin"
    header = np.fromfile(path, dtype="<i4", count=3).tolist()
    assert header[:2] == [20240801, 7]  # llm.c's header for uint32 tokens
    assert shard_tokens(path) == [70_000, *text.encode()]  # EOT, then the document's bytes
    assert shard_tokens(tmp_path / "d" / "d_val_000000.bin") == [70_000, *b"val"]
    assert path.stat().st_size == HEADER_BYTES + 4 * header[2]
    loader = DistributedDataLoader(tmp_path / "d", "train", 1, 8, vocab_size=70_001)
    x, _ = loader.next_batch()
    assert x.flatten().tolist() == shard_tokens(path)[:8] and x[0, 0] == 70_000
    assert model_config(TrainConfig(data_dir=str(tmp_path / "d"), model="tiny")).vocab_size == 70_001
    write_shard(tmp_path / "x_val_000000.bin", np.array([0, 2**32 - 1]), vocab_size=2**32)
    assert shard_tokens(tmp_path / "x_val_000000.bin") == [0, 2**32 - 1]


def test_a_directory_holds_one_tokenizers_shards(tmp_path, gpt2_encoding):
    (tmp_path / "a.txt").write_text("some text " * 50)
    prepare.main(["--input", str(tmp_path / "a.txt"), "--output_dir", str(tmp_path / "d")])
    with pytest.raises(UserError, match=rf"^{tmp_path / 'd'} holds shards written with the tokenizer gpt2 \(tiktoken, "
                                        r"50,257 ids, sha256 7affe1cd…\) \(see .*manifest.json\), not with bytes .* "
                                        r"Pass another --output_dir"):
        prepare.main(["--input", str(tmp_path / "a.txt"), "--output_dir", str(tmp_path / "d"), "--tokenizer",
                      "bytes"])
    prepare.main(["--input", str(tmp_path / "a.txt"), "--output_dir", str(tmp_path / "b"), "--tokenizer", "bytes"])
    shutil.copy(tmp_path / "b" / "b_train_000000.bin", tmp_path / "d" / "b_train_000000.bin")  # copied in
    with pytest.raises(UserError, match=rf"^{tmp_path / 'd' / 'b_train_000000.bin'} is not one of the shards that "
                                        r".*manifest.json lists as written with the tokenizer gpt2"):
        find_shards(tmp_path / "d", "train")
    (tmp_path / "b" / MANIFEST).write_text('{"version": 1, "tokenizer": {"kind": "bytes"}, "shards": []}')
    with pytest.raises(UserError, match=r"manifest.json: its tokenizer record is not an object with the fields"):
        DistributedDataLoader(tmp_path / "b", "train", 1, 8)


def test_shards_without_a_manifest_are_gpt2s_and_no_command_writes_beside_them(tmp_path, gpt2_encoding):
    (tmp_path / "a.txt").write_text("some text " * 50)
    old = ["--input", str(tmp_path / "a.txt"), "--output_dir", str(tmp_path / "old")]
    prepare.main(old)
    (tmp_path / "old" / MANIFEST).unlink()  # as llm.c's shards come
    assert read_data_tokenizer(tmp_path / "old") == gpt2_spec()
    for tokenizer_name in ("gpt2", "bytes"):
        with pytest.raises(UserError, match=rf"^{tmp_path / 'old'} holds shards \(old_train_000000.bin, ...\) but no "
                                            r"manifest.json naming their tokenizer"):
            prepare.main([*old, "--tokenizer", tokenizer_name])
    assert not (tmp_path / "old" / MANIFEST).exists()


def test_a_manifest_of_another_version_or_none_or_a_link_to_nothing_is_refused_naming_it(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 50)
    prepare.main(["--input", str(tmp_path / "a.txt"), "--output_dir", str(tmp_path / "d"), "--tokenizer", "bytes"])
    path = tmp_path / "d" / MANIFEST
    manifest = json.loads(path.read_text())
    assert manifest["version"] == MANIFEST_VERSION == 1
    for version, named in [(None, "has no version"), (2, "has version 2"), ("1", "has version '1'")]:
        path.write_text(json.dumps({key: value for key, value in (manifest | {"version": version}).items()
                                    if value is not None}))
        with pytest.raises(UserError, match=rf"^{path} {named}.*, and this code reads manifests of version 1 only"):
            read_data_tokenizer(tmp_path / "d")
    path.unlink()
    path.symlink_to(tmp_path / "gone.json")
    with pytest.raises(UserError, match=rf"^{path}, a symbolic link to {tmp_path / 'gone.json'}, could not be read "
                                        r"\(No such file or directory\)"):
        DistributedDataLoader(tmp_path / "d", "train", 1, 8)  # (taken as no manifest, its bytes would be GPT-2's)


def test_bad_tokenizer_names_are_one_paragraph_naming_them(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text('{"model": ')
    no_eot = byte_level_bpe(tmp_path / "no_eot", 300, eot=False)
    words = word_level(tmp_path / "words")
    with pytest.raises(UserError, match=r"^--tokenizer nosuch: no such file or directory, and not a tokenizer's name. "
                                        r"Pass gpt2 .* or a tiktoken encoding: gpt2, r50k_base"):
        load_tokenizer("nosuch")
    with pytest.raises(UserError, match=rf"^--tokenizer {tmp_path / 'broken'}: {tmp_path / 'broken/tokenizer.json'} "
                                        r"is not a Hugging Face tokenizer.json that can be used here \(Exception: "):
        load_tokenizer(str(tmp_path / "broken"))
    with pytest.raises(UserError, match=rf"^--tokenizer {no_eot}: .* \(ValueError: it has no <\|endoftext\|> token, "
                                        "which separates documents here"):
        load_tokenizer(str(no_eot))
    with pytest.raises(UserError, match=rf"^--tokenizer {words}: .* \(ValueError: its model is WordLevel, not BPE; "
                                        r"this code reads byte-level BPEs only"):
        load_tokenizer(str(words))
    definition = (words / "tokenizer.json").read_text()
    recorded = TokenizerSpec("hf", "words", hashlib.sha256(definition.encode()).hexdigest(), 3, 2, definition)
    with pytest.raises(UserError, match=r"^the tokenizer recorded as words \(hf, 3 ids, .*\) cannot be used here: its "
                                        r"model is WordLevel, not BPE"):  # as a manifest or a snapshot has it
        tokenizer_from_spec(recorded)


@pytest.mark.slow  # each a fresh interpreter importing torch: about 4 s
@pytest.mark.parametrize("case", ["unknown", "malformed", "vocab_size", "not_cached"])
def test_each_bad_input_exits_2_naming_it(case, tmp_path, gpt2_encoding):
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "broken.json").write_text("{not json")
    prepare_args = ["--input", tmp_path / "a.txt", "--output_dir", tmp_path / "out", "--tokenizer"]
    result, expected = {
        "unknown": lambda: (cli("data.prepare", *prepare_args, "nosuch"),
                            "error: --tokenizer nosuch: no such file or directory, and not a tokenizer's name."),
        "malformed": lambda: (cli("data.prepare", *prepare_args, tmp_path / "broken.json"),
                              f"error: --tokenizer {tmp_path / 'broken.json'}: {tmp_path / 'broken.json'} is not a "
                              "Hugging Face tokenizer.json"),
        "vocab_size": lambda: (cli("data.train_tokenizer", "--input", tmp_path / "a.txt", "--vocab_size", "256",
                                   "--output", tmp_path / "tok"),
                               "error: argument --vocab_size: 256: a byte-level BPE has 257 to 16,777,216 tokens"),
        # a proxy that refuses: no download even where there is network
        "not_cached": lambda: (cli("data.prepare", *prepare_args, "cl100k_base",
                                   env={"HTTPS_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}),
                               "error: the tiktoken encoding 'cl100k_base' could not be loaded"),
    }[case]()
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr.splitlines()[-1]
    if case == "not_cached":
        assert "TIKTOKEN_CACHE_DIR" in result.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.bin"))


@pytest.mark.slow  # train a tokenizer, prepare, train_gpt2.py 3 steps: about 20 s
def test_train_tokenizer_prepare_and_train_end_to_end(tmp_path, enwiki_slice):
    tok = tmp_path / "tok"
    assert cli("data.train_tokenizer", "--input", enwiki_slice, "--vocab_size", "700", "--output", tok).returncode == 0
    prepared = cli("data.prepare", "--input", enwiki_slice, "--output_dir", tmp_path / "data", "--tokenizer", tok)
    assert prepared.returncode == 0, prepared.stderr
    run = run_train(["--data_dir", str(tmp_path / "data"), "--micro_batch_size", "4", "--seq_len", "32",
                     "--total_batch_size", "128", "--max_steps", "3", "--dtype", "fp32", "--val_every", "0",
                     "--snapshot_every", "0"], tmp_path / "logs")
    assert "vocab_size=700" in run.output
    assert run.train[0]["loss"] == pytest.approx(math.log(700), abs=0.1)  # uniform over this tokenizer's 700 ids
