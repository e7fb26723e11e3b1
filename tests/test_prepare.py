"""data/prepare.py: nanoGPT's Tiny Shakespeare split to the token (no EOT), EOT before every file (llm.c's stream)
in the val-first split and in the --val_fraction split, and clear errors for bad input or a failed download."""

import gzip
import itertools
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from data import prepare
from dataloader import HEADER_BYTES, TOKEN_DTYPE, read_shard_header
from training.errors import UserError


def shard_tokens(path) -> np.ndarray:
    num_tokens = read_shard_header(path)  # also checks the header against the file size
    tokens = np.fromfile(path, dtype=TOKEN_DTYPE, offset=HEADER_BYTES)
    assert tokens.size == num_tokens
    return tokens


def test_shakespeare_split_matches_nanogpt_token_counts(shared_data, gpt2_encoding, tmp_path):
    text_path = shared_data / "tinyshakespeare" / "input.txt"
    prepare.main(["--source", "shakespeare", "--input", str(text_path), "--output_dir", str(tmp_path / "shakespeare")])

    shards = sorted(p.name for p in (tmp_path / "shakespeare").glob("*.bin"))
    assert shards == ["shakespeare_train_000000.bin", "shakespeare_val_000000.bin"]
    train = shard_tokens(tmp_path / "shakespeare" / "shakespeare_train_000000.bin")
    val = shard_tokens(tmp_path / "shakespeare" / "shakespeare_val_000000.bin")
    assert (train.size, val.size) == (301_966, 36_059)  # nanoGPT's data/shakespeare/prepare.py numbers
    text = text_path.read_text(encoding="utf-8")
    cut = int(len(text) * 0.9)
    assert gpt2_encoding.decode(train.tolist()) == text[:cut]
    assert gpt2_encoding.decode(val.tolist()) == text[cut:]


def test_val_fraction_zero_makes_first_shard_val_and_puts_eot_before_every_file(gpt2_encoding, tmp_path):
    texts = ["First file: the quick brown fox jumps over the lazy dog. " * 5, "Second file, ünïcode ✓ and more. " * 7]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "mine"
    prepare.main(["--input", str(tmp_path / "0.txt"), str(tmp_path / "1.txt"), "--output_dir", str(out),
                  "--val_fraction", "0", "--shard_size", "50"])

    eot = gpt2_encoding.eot_token  # llm.c's documents: EOT, then the text, for each
    expected = [eot, *gpt2_encoding.encode_ordinary(texts[0]), eot, *gpt2_encoding.encode_ordinary(texts[1])]
    num_train = -(-(len(expected) - 50) // 50)
    assert sorted(p.name for p in out.glob("*.bin")) == \
        [f"mine_train_{i:06d}.bin" for i in range(num_train)] + ["mine_val_000000.bin"]
    shards = [out / "mine_val_000000.bin", *(out / f"mine_train_{i:06d}.bin" for i in range(num_train))]
    stream = [shard_tokens(p) for p in shards]
    assert [s.size for s in stream[:-1]] == [50] * num_train  # all but the last are full
    assert np.concatenate(stream).tolist() == expected
    assert gpt2_encoding.decode(expected) == "<|endoftext|>" + texts[0] + "<|endoftext|>" + texts[1]


def test_val_fraction_puts_eot_before_each_files_val_part_and_train_part(gpt2_encoding, tmp_path):
    texts = ["Alpha file, line one.\nLine two of alpha. " * 9, "Beta: ünïcode ✓, 日本語. " * 11,
             "Gamma mentions <|endoftext|> as plain text. " * 6]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "mine"
    prepare.main(["--input", *(str(tmp_path / f"{i}.txt") for i in range(3)), "--output_dir", str(out),
                  "--val_fraction", "0.2"])

    cuts = [int(len(text) * 0.8) for text in texts]  # the last 20 % of each file's characters is val
    eot = gpt2_encoding.eot_token
    val = [t for text, cut in zip(texts, cuts) for t in [eot, *gpt2_encoding.encode_ordinary(text[cut:])]]
    train = [t for text, cut in zip(texts, cuts) for t in [eot, *gpt2_encoding.encode_ordinary(text[:cut])]]
    assert sorted(p.name for p in out.glob("*.bin")) == ["mine_train_000000.bin", "mine_val_000000.bin"]
    assert shard_tokens(out / "mine_val_000000.bin").tolist() == val
    assert shard_tokens(out / "mine_train_000000.bin").tolist() == train


def test_shakespeare_takes_one_input_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        prepare.main(["--source", "shakespeare", "--input", str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert "--source shakespeare reads one file" in capsys.readouterr().err


def test_missing_input_file_is_named_in_the_error(tmp_path, capsys):
    missing = tmp_path / "no_such_file.txt"
    with pytest.raises(SystemExit):
        prepare.main(["--input", str(missing), "--output_dir", str(tmp_path / "out")])
    assert f"--input {missing}: no such file" in capsys.readouterr().err


def test_failed_download_tells_user_to_pass_input(gpt2_encoding, tmp_path, monkeypatch):  # (GPT-2's: loaded first)
    def offline(*args, **kwargs):
        raise urllib.error.URLError("Name or service not known")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(UserError, match="pass it with --input path/to/input.txt"):  # (SystemExit: exit status 1)
        prepare.main(["--source", "shakespeare", "--output_dir", str(tmp_path)])
    assert not (tmp_path / "input.txt").exists()  # nothing half-downloaded to be mistaken for the data later


DOCS = ["First article.\nIts second paragraph.", "Zweites Dokument: ünïcode ✓, 日本語.",
        "Third mentions <|endoftext|>.", "Fourth, short.", "Fifth and last."]


def write_jsonl(path: Path, lines: list[str | bytes]) -> Path:
    with (gzip.open if path.suffix == ".gz" else open)(path, "wb") as f:
        f.writelines((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines)
    return path


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.jsonl.gz"])
def test_jsonl_documents_each_preceded_by_eot_and_split_by_documents(gpt2_encoding, tmp_path, name):
    path = write_jsonl(tmp_path / name, [json.dumps({"text": t, "id": i}) for i, t in enumerate(DOCS)] + [""])
    out = tmp_path / "mine"
    prepare.main(["--input", str(path), "--output_dir", str(out), "--val_fraction", "0.4"])

    eot = gpt2_encoding.eot_token  # llm.c's stream: EOT, then the document, for each; the last 40 % of documents val
    stream = [[eot, *gpt2_encoding.encode_ordinary(text)] for text in DOCS]
    assert shard_tokens(out / "mine_train_000000.bin").tolist() == list(itertools.chain(*stream[:3]))
    assert shard_tokens(out / "mine_val_000000.bin").tolist() == list(itertools.chain(*stream[3:]))


def test_val_input_is_val_and_text_files_mix_with_jsonl(gpt2_encoding, tmp_path):
    jsonl = write_jsonl(tmp_path / "train.jsonl.gz", [json.dumps({"text": t}) for t in DOCS[:2]])
    (tmp_path / "c.txt").write_text(DOCS[2], encoding="utf-8")
    val = write_jsonl(tmp_path / "val.jsonl", [json.dumps({"text": t}) for t in DOCS[3:]])
    out = tmp_path / "mine"
    prepare.main(["--input", str(jsonl), str(tmp_path / "c.txt"), "--val_input", str(val), "--output_dir", str(out)])

    eot = gpt2_encoding.eot_token
    expected = [[t for text in texts for t in [eot, *gpt2_encoding.encode_ordinary(text)]]
                for texts in (DOCS[:3], DOCS[3:])]
    assert shard_tokens(out / "mine_train_000000.bin").tolist() == expected[0]
    assert shard_tokens(out / "mine_val_000000.bin").tolist() == expected[1]


@pytest.mark.parametrize(("line", "problem"), [
    ('{"text": "fine"', "line 2 is not valid JSON (column 16: Expecting ',' delimiter)"),
    ('{"title": "no text"}', 'line 2 has no "text" field'),
    ('["a", "list"]', 'line 2 has no "text" field'),
    ('{"text": null}', 'line 2 has a "text" that is NoneType, not a string'),
    # tracebacks before: a UnicodeDecodeError, a RecursionError, Python's limit on the digits of an int
    (b'{"text": "caf\xe9"}', "line 2 is not UTF-8 text (byte 0xe9 at offset 13)"),
    ("[" * 100_000 + "]" * 100_000, "line 2 is nested too deeply to be read"),
    ('{"text": "a", "n": ' + "9" * 5001 + "}", "line 2 is not readable (Exceeds the limit (4300 digits)"),
])
def test_bad_jsonl_line_is_named_in_one_paragraph(gpt2_encoding, tmp_path, line, problem):
    path = write_jsonl(tmp_path / "bad.jsonl.gz", ['{"text": "a good first line"}', line, '{"text": "unread"}'])
    with pytest.raises(UserError) as error:
        prepare.main(["--input", str(path), "--output_dir", str(tmp_path / "out")])
    assert str(error.value).startswith(f"{path}, line 2 ") and problem in str(error.value)
    assert "\n" not in str(error.value) and "fix or delete that line" in str(error.value)
    assert not list((tmp_path / "out").glob("*.bin"))  # nothing written from a file that could not be read


@pytest.mark.parametrize("damage, message", [
    (lambda data: b"not gzip at all", r"could not be read \(BadGzipFile: Not a gzipped file \(b'no'\)\): a truncated "
     r"or corrupt file, or, for a name ending in \.gz, not gzip-compressed\. Copy or download it again\."),
    (lambda data: data[: len(data) // 2], r"could not be read \(EOFError: Compressed file ended before the "
     r"end-of-stream marker was reached\)"),
])
def test_a_jsonl_gz_that_is_not_whole_gzip_is_named_in_one_paragraph(gpt2_encoding, tmp_path, damage, message):
    path = write_jsonl(tmp_path / "docs.jsonl.gz", [json.dumps({"text": t}) for t in DOCS * 200])
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(UserError, match=rf"^{path} {message}"):
        prepare.main(["--input", str(path), "--output_dir", str(tmp_path / "out")])


def test_a_text_file_that_is_not_utf8_is_named_in_one_paragraph(gpt2_encoding, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))
    with pytest.raises(UserError, match=rf"^{tmp_path / 'latin1.txt'} is not UTF-8 text \(byte 0xe9 at offset 3\): "
                                        "a text file is read as UTF-8"):
        prepare.main(["--input", str(tmp_path / "latin1.txt"), "--output_dir", str(tmp_path / "out")])


def test_an_output_dir_that_is_a_file_is_named(gpt2_encoding, tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "out").write_text("a file")
    with pytest.raises(SystemExit) as exit_info:
        prepare.main(["--input", str(tmp_path / "a.txt"), "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert (f"--output_dir {tmp_path / 'out'}: not a directory, and none can be created there (File exists)"
            in capsys.readouterr().err)


def test_no_tokenizer_is_one_paragraph_saying_to_set_tiktoken_cache_dir(tmp_path, monkeypatch):
    import requests
    import tiktoken

    from training import tokenizer

    def offline(name):
        raise requests.exceptions.ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    (tmp_path / "a.txt").write_text("hello")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    tokenizer.gpt2_encoding.cache_clear()
    try:
        with pytest.raises(UserError, match=r"^the GPT-2 tokenizer could not be loaded \(ConnectionError: Failed to "
                                            r"resolve .*\): tiktoken downloads .* set TIKTOKEN_CACHE_DIR to a copy"):
            prepare.main(["--input", str(tmp_path / "a.txt"), "--output_dir", str(tmp_path / "out")])
    finally:
        tokenizer.gpt2_encoding.cache_clear()  # the next caller loads the real one again
    assert not list((tmp_path / "out").glob("*.bin"))


@pytest.mark.slow  # a fresh interpreter importing torch: about 4 s
def test_bad_jsonl_exits_2_with_error_line(gpt2_encoding, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ["not json"])
    result = subprocess.run([sys.executable, "-m", "data.prepare", "--input", str(path), "--output_dir",
                             str(tmp_path / "out")], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert result.returncode == 2  # the error on a line of its own, after the progress bar's
    assert result.stderr.splitlines()[-1].startswith(f"error: {path}, line 1 is not valid JSON")


def test_enwiki_first_documents(shared_data, gpt2_encoding, tmp_path):
    with gzip.open(shared_data / "enwiki" / "enwiki.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = list(itertools.islice(f, 20))
    path = write_jsonl(tmp_path / "enwiki20.jsonl.gz", [line.rstrip("\n") for line in lines])
    out = tmp_path / "enwiki"
    prepare.main(["--input", str(path), "--output_dir", str(out), "--val_fraction", "0.1"])

    texts = [json.loads(line)["text"] for line in lines]
    assert texts[0].startswith("Anarchism")  # the README's first article, in dump order
    encode = [[gpt2_encoding.eot_token, *gpt2_encoding.encode_ordinary(text)] for text in texts]
    assert shard_tokens(out / "enwiki_train_000000.bin").tolist() == list(itertools.chain(*encode[:18]))
    assert shard_tokens(out / "enwiki_val_000000.bin").tolist() == list(itertools.chain(*encode[18:]))


@pytest.mark.slow  # over 3 s on two busy cores: keeps `-m 'not slow'` within a minute
@pytest.mark.parametrize("tool", ["data.prepare", "data.fineweb"])
def test_a_shard_size_no_header_can_count_is_exit_2_naming_the_flag(tool, tmp_path):
    result = subprocess.run([sys.executable, "-m", tool, "--input", str(tmp_path / "a.txt"), "--output_dir",
                             str(tmp_path / "out"), "--shard_size", str(10**30)], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --shard_size: 1000000000000000000000000000000: a shard holds 1 to 2,147,483,647 tokens" in \
        result.stderr and not (tmp_path / "out").exists()
