"""data/fineweb.py (and the shard writer in data/tokenize_shards.py) on local parquet and JSON-lines files: shards
that hold llm.c's token stream (EOT before every document), byte-identical output for any number of processes, resuming
after --max_shards or an interruption, and clear errors for bad input."""

import gzip
import json
import os
import random
import sys
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import fineweb
from data.tokenize_shards import ShardWriter, shard_paths
from dataloader import HEADER_BYTES, TOKEN_DTYPE, read_shard_header
from training.errors import UserError

SHARD_SIZE = 1000  # small, so a corpus of a few thousand tokens makes several shards


def make_documents(n: int = 24, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "model", "learns", "from", "tokens,", "Ünïcode", "✓", "résumé", "日本語", "GPT-2", "2024", "\n"]
    documents = [" ".join(rng.choices(words, k=rng.randint(1, 150))) for _ in range(n)]
    documents[3] = "This document mentions <|endoftext|> as plain text, which must not become the EOT token."
    documents[5] = " ".join(rng.choices(words, k=1500))  # longer than a shard: it spans three
    return documents


@pytest.fixture
def documents() -> list[str]:
    return make_documents()


@pytest.fixture
def corpus(tmp_path, documents, gpt2_encoding) -> dict[str, str]:
    """The documents as a parquet file (in several row groups) and as a JSON-lines file, plain and gzipped. (Every
    test of it tokenizes them: gpt2_encoding skips it where the offline tokenizer files are missing.)"""
    pq.write_table(pa.table({"id": list(range(len(documents))), "text": documents}), tmp_path / "docs.parquet",
                   row_group_size=7)
    for name, opener in (("docs.jsonl", open), ("docs.jsonl.gz", gzip.open)):
        with opener(tmp_path / name, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": text, "id": i}) + "\n" for i, text in enumerate(documents))
    return {"parquet": str(tmp_path / "docs.parquet"), "jsonl": str(tmp_path / "docs.jsonl"),
            "jsonl.gz": str(tmp_path / "docs.jsonl.gz")}


def run(input_path, output_dir, *flags) -> None:
    fineweb.main(["--input", str(input_path), "--output_dir", str(output_dir), "--shard_size", str(SHARD_SIZE),
                  "--num_proc", "1", *map(str, flags)])  # a later --num_proc overrides this one


def shards(output_dir) -> list:
    """The shards in stream order: val first, then train."""
    return sorted(output_dir.glob("*_val_*.bin")) + sorted(output_dir.glob("*_train_*.bin"))


def read_stream(output_dir) -> list[np.ndarray]:
    arrays = []
    for path in shards(output_dir):
        num_tokens = read_shard_header(path)
        arrays.append(np.fromfile(path, dtype=TOKEN_DTYPE, offset=HEADER_BYTES))
        assert arrays[-1].size == num_tokens
    return arrays


def split_at_eot(tokens: list[int], eot: int) -> list[list[int]]:
    documents = [[]]
    for token in tokens:
        documents.append([]) if token == eot else documents[-1].append(token)
    return documents


def file_ids(output_dir) -> dict[str, tuple[int, int]]:
    """Each shard's inode and mtime: a rewritten shard (write_shard renames a new file in) changes both."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards(output_dir)}


def llm_c_stream(documents: list[str], encoding) -> list[int]:
    """The token stream llm.c's dev/data/fineweb.py writes for these documents: EOT, then the document, for each."""
    return [token for text in documents for token in [encoding.eot_token, *encoding.encode_ordinary(text)]]


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "jsonl.gz"])
def test_shards_hold_the_documents_each_after_an_eot_as_llm_c_writes_them(kind, corpus, documents, gpt2_encoding,
                                                                          tmp_path):
    out = tmp_path / "out"
    run(corpus[kind], out)

    expected = llm_c_stream(documents, gpt2_encoding)
    total = len(expected)
    num_shards = -(-total // SHARD_SIZE)
    assert num_shards >= 5
    assert [p.name for p in shards(out)] == ["out_val_000000.bin"] + [f"out_train_{i:06d}.bin"
                                                                        for i in range(num_shards - 1)]
    arrays = read_stream(out)
    assert [a.size for a in arrays] == [SHARD_SIZE] * (num_shards - 1) + [total - SHARD_SIZE * (num_shards - 1)]
    stream = np.concatenate(arrays).tolist()
    assert stream == expected
    assert gpt2_encoding.decode(stream) == "".join("<|endoftext|>" + text for text in documents)
    assert json.loads((out / "progress.json").read_text())["complete"]


def test_real_fineweb_rows_round_trip(shared_data, gpt2_encoding, tmp_path):
    rows_path = shared_data / "fineweb_sample" / "fineweb_20docs.jsonl"
    rows = [json.loads(line) for line in rows_path.read_text(encoding="utf-8").splitlines()]
    run(rows_path, tmp_path / "out", "--shard_size", 8192)

    arrays = read_stream(tmp_path / "out")
    assert len(arrays) == 3 and arrays[0].size == arrays[1].size == 8192
    stream = np.concatenate(arrays).tolist()
    assert stream == llm_c_stream([row["text"] for row in rows], gpt2_encoding)
    pieces = split_at_eot(stream, gpt2_encoding.eot_token)
    assert pieces[0] == [] and [gpt2_encoding.decode(piece) for piece in pieces[1:]] == [row["text"] for row in rows]


def test_two_processes_give_byte_identical_shards(corpus, tmp_path):
    run(corpus["parquet"], tmp_path / "one")
    run(corpus["parquet"], tmp_path / "two", "--num_proc", 2)
    one, two = shards(tmp_path / "one"), shards(tmp_path / "two")
    assert len(one) == len(two) >= 5
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two))


def test_rerun_after_max_shards_continues_without_rewriting_finished_shards(corpus, tmp_path, capsys):
    run(corpus["jsonl"], tmp_path / "reference")
    out = tmp_path / "out"
    run(corpus["jsonl"], out, "--max_shards", 3)
    assert len(shards(out)) == 3
    finished = file_ids(out)
    run(corpus["jsonl"], out, "--max_shards", 2)  # fewer than there are
    assert "already has its 3 shard(s)" in capsys.readouterr().out and file_ids(out) == finished

    run(corpus["jsonl"], out)
    assert "resuming at out_train_000002.bin: skipping the first" in capsys.readouterr().out
    assert {name: ids for name, ids in file_ids(out).items() if name in finished} == finished
    assert [a.tolist() for a in read_stream(out)] == [a.tolist() for a in read_stream(tmp_path / "reference")]

    done = file_ids(out)
    run(corpus["jsonl"], out)
    assert "nothing to do" in capsys.readouterr().out
    assert file_ids(out) == done


def test_interrupted_run_leaves_only_whole_shards_and_resumes_to_the_same_shards(corpus, tmp_path, monkeypatch):
    run(corpus["parquet"], tmp_path / "reference")
    out = tmp_path / "out"
    fsync, calls = os.fsync, []

    def interrupt_third_shard(fd):  # write_shard fsyncs each shard's data before renaming it into place
        name = os.readlink(f"/proc/self/fd/{fd}")
        if ".bin." in name and name.endswith(".tmp"):  # a shard's temp file (not progress.json's, nor the directory)
            calls.append(fd)
            if len(calls) == 3:
                raise KeyboardInterrupt  # as if Ctrl-C came while shard 3 was half written
        fsync(fd)

    monkeypatch.setattr(os, "fsync", interrupt_third_shard)
    with pytest.raises(KeyboardInterrupt):
        run(corpus["parquet"], out)
    monkeypatch.undo()
    assert len(list(out.glob("*.bin"))) == 2  # every *.bin is whole: read_shard_header passes on each
    assert all(read_shard_header(p) == SHARD_SIZE for p in out.glob("*.bin"))
    finished = file_ids(out)

    run(corpus["parquet"], out)
    assert {name: ids for name, ids in file_ids(out).items() if name in finished} == finished
    assert [a.tolist() for a in read_stream(out)] == [a.tolist() for a in read_stream(tmp_path / "reference")]


@pytest.mark.parametrize("flags, repo, config, name", [
    ([], "HuggingFaceFW/fineweb-edu", "sample-10BT", "fineweb_edu10B"),
    (["--version", "classic", "--size", "100B"], "HuggingFaceFW/fineweb", "sample-100BT", "fineweb100B")])
def test_hub_source_streams_the_sample_into_its_default_directory(flags, repo, config, name, documents, tmp_path,
                                                                   monkeypatch, gpt2_encoding):
    calls = []

    class FakeStream:  # what load_dataset(..., streaming=True) gives: rows as dicts, in a fixed order
        def select_columns(self, columns):
            return [{column: text for column in columns} for text in documents]

    def load_dataset(path, name, split, streaming):
        calls.append((path, name, split, streaming))
        return FakeStream()

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(fineweb, "DATA_DIR", tmp_path)  # where the default --output_dir goes
    fineweb.main([*flags, "--shard_size", str(SHARD_SIZE), "--max_shards", "2", "--num_proc", "1"])
    assert calls == [(repo, config, "train", True)]
    assert [p.name for p in shards(tmp_path / name)] == [f"{name}_val_000000.bin", f"{name}_train_000000.bin"]


def test_changed_shard_size_is_refused_naming_the_progress_file(corpus, tmp_path):
    run(corpus["jsonl"], tmp_path / "out", "--max_shards", 1)
    with pytest.raises(UserError, match="progress.json"):  # (SystemExit before: exit status 1)
        run(corpus["jsonl"], tmp_path / "out", "--shard_size", 500)


@pytest.mark.parametrize("text, problem", [
    ('{"source": ', "is not valid JSON (column 12: Expecting value)"),
    ("[1]", "is not what this script writes (an object with complete, documents, offset, shard_size, shards, source)"),
    ('{"source": "x"}', "is not what this script writes (an object with complete, documents, offset, shard_size, "
                        "shards, source)"),
    (json.dumps(dict.fromkeys(["source", "shard_size", "shards", "documents", "offset", "complete"], 0)),
     "has no version, and this code reads progress files of version 1 only"),
    (json.dumps(dict.fromkeys(["source", "shard_size", "shards", "documents", "offset", "complete"], 0)
                | {"version": 2}), "has version 2, and this code reads progress files of version 1 only"),
])
def test_a_damaged_progress_file_is_named_with_the_fix(corpus, tmp_path, text, problem):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "progress.json").write_text(text)
    with pytest.raises(UserError) as raised:  # a traceback before: JSONDecodeError, TypeError, KeyError
        run(corpus["jsonl"], tmp_path / "out")
    assert str(raised.value) == (f"{tmp_path / 'out' / 'progress.json'} {problem}. Delete it, and the shards of "
                                 f"{tmp_path / 'out'}, to write them all again.")


def test_a_file_that_is_not_parquet_is_named(gpt2_encoding, tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 and then nothing parquet")
    with pytest.raises(UserError, match=rf"^{tmp_path / 'bad.parquet'} could not be read as a parquet file "
                                        r"\(ArrowInvalid: .*\); it is truncated, corrupt or not parquet"):
        run(tmp_path / "bad.parquet", tmp_path / "out")


def test_a_hub_that_cannot_be_reached_is_one_paragraph(gpt2_encoding, tmp_path, monkeypatch):
    def load_dataset(path, name, split, streaming):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(UserError, match=r"^could not stream HuggingFaceFW/fineweb-edu sample-10BT from the Hugging "
                                        r"Face hub \(ConnectionError: Couldn't reach .*\)\. On a node without "
                                        "network, download its parquet files"):
        fineweb.main(["--output_dir", str(tmp_path / "out"), "--num_proc", "1", "--max_shards", "1"])


def test_missing_input_file_is_named_in_the_error(tmp_path, capsys):
    missing = tmp_path / "missing.parquet"
    with pytest.raises(SystemExit):
        run(missing, tmp_path / "out")
    assert f"--input {missing}: no such file" in capsys.readouterr().err


def test_token_ids_beyond_uint16_name_the_document_and_shard(tmp_path):
    writer = ShardWriter(shard_paths(tmp_path), shard_size=4, desc="test")
    writer.add(np.array([50256, 1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match=r"document 1 .*_train_000000\.bin\) has token ids 3\.\.70000"):
        writer.add(np.array([50256, 70000, 3]))
