"""data/tokenize_shards.write_shards, the one writer behind data.prepare and data.fineweb: GPT-2's shards byte-identical
to those the earlier writers made (their sha256, recorded on 2026-12-02 before the writer was replaced), with any
--num_proc; a run killed by SIGKILL, or interrupted at any write, resumes to the same bytes; and bounded read-ahead."""

import hashlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ROOT
from data import fineweb, prepare, tokenize_shards
from data.tokenizer_flag import load_tokenizer

# case: (command, its flags with {data} for ../shared/data, the number of shards, the sha256 of "name sha256\n" of
# every file written but progress.json, sorted by name), all into a directory named out
CASES = {
    "shakespeare": ("data.prepare", "--source shakespeare --input {data}/tinyshakespeare/input.txt", 2,
                    "3dcc48e4f83bd3f770eb11050102810e33c79d8ba10dfd8a0253759ac464643b"),
    "shakespeare_shards": ("data.prepare", "--source shakespeare --input {data}/tinyshakespeare/input.txt "
                           "--shard_size 100000", 5,
                           "a2326714ede0cbcab467ffed3ecbde305477e9ea360fcf8eaa343cf64213c208"),
    "txt": ("data.prepare", "--input {data}/tinyshakespeare/input.txt --shard_size 100000", 5,
            "9ef83ab39572480df623c901bba1fb2e11f246dafae46e1b58ef94a83e6a9c31"),
    "txt_val0": ("data.prepare", "--input {data}/tinyshakespeare/input.txt {data}/fineweb_sample/fineweb_20docs.jsonl "
                 "--val_fraction 0 --shard_size 100000", 4,
                 "308e28ea32fdd8180ebb1d832a3d28ad295ab72202fc8f32574b085980fe50d2"),
    "mixed_val_input": ("data.prepare", "--input {data}/fineweb_sample/fineweb_20docs.jsonl "
                        "{data}/tinyshakespeare/input.txt --val_input {data}/enwiki/enwiki_val.jsonl.gz "
                        "--shard_size 200000", 5, "0f5f7c5098e4bf55351f16638f8bd09092624f520ed5d228736153ad8722561e"),
    "enwiki": ("data.prepare", "--input {data}/enwiki/enwiki.jsonl.gz --shard_size 3000000", 5,
               "c7dac846d683df1d9df1b3487d62a1c68c8d9c7f5ff9ad295bd4215a72545a9e"),
    "enwiki_val_input": ("data.prepare", "--input {data}/enwiki/enwiki.jsonl.gz --val_input "
                         "{data}/enwiki/enwiki_val.jsonl.gz", 2,
                         "700c246b1dfb102c0a24963ca508f7223a2ed108fd666536aa9c727c358e5124"),
    "fineweb_parquet": ("data.fineweb", "--input {data}/fineweb_sample/dpk_extreme_tokenized_test1.parquet "
                        "{data}/fineweb_sample/dpk_gneissweb_classification_test_01.parquet --shard_size 8192", 3,
                        "8f4df4016b0a6468b4a222e797303f11afe341da665b87c563e42ef195e76fba"),
    "fineweb_jsonl": ("data.fineweb", "--input {data}/fineweb_sample/fineweb_20docs.jsonl --shard_size 8192", 3,
                      "0194303b98a93c7aeab413b33bca8a1fccb09804791ff7dc2f22d12d30d5bb7c"),
    "fineweb_enwiki_val": ("data.fineweb", "--input {data}/enwiki/enwiki_val.jsonl.gz --shard_size 100000", 6,
                           "60b7044773d3b4116ad26866c52b09a916df97f61bc64cbca4ddb3baa2c46769"),
}
# data.prepare reads parquet too: --val_fraction 0 is data.fineweb's stream, so the same bytes
CASES["prepare_parquet"] = ("data.prepare", f"{CASES['fineweb_parquet'][1]} --val_fraction 0",
                            *CASES["fineweb_parquet"][2:])
SLOW = {"enwiki", "enwiki_val_input"}  # 10M tokens each: 5-10 s a run


def digest(out) -> tuple[int, str]:
    files = sorted(p for p in out.iterdir() if p.name != "progress.json")
    lines = "".join(f"{p.name} {hashlib.sha256(p.read_bytes()).hexdigest()}\n" for p in files)
    return sum(p.suffix == ".bin" for p in files), hashlib.sha256(lines.encode()).hexdigest()


def arguments(case: str, data, out, *flags) -> list[str]:
    return [*CASES[case][1].format(data=data).split(), "--output_dir", str(out), *flags]


@pytest.mark.parametrize("num_proc", [1, 2])
@pytest.mark.parametrize("case", [pytest.param(case, marks=[pytest.mark.slow] if case in SLOW else [])
                                  for case in CASES])
def test_gpt2_shards_are_the_earlier_writers_bytes(case, num_proc, shared_data, gpt2_encoding, tmp_path):
    main = {"data.prepare": prepare.main, "data.fineweb": fineweb.main}[CASES[case][0]]
    main(arguments(case, shared_data, tmp_path / "out", "--num_proc", str(num_proc)))
    assert digest(tmp_path / "out") == CASES[case][2:]


@pytest.mark.slow  # three runs of 10M tokens: about 30 s
def test_a_sigkilled_prepare_run_again_ends_with_the_uninterrupted_bytes(shared_data, gpt2_encoding, tmp_path):
    out = tmp_path / "out"
    args = [sys.executable, "-m", "data.prepare", *arguments("enwiki", shared_data, out, "--num_proc", "2")]
    run = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    while not past_the_first_train_shard(out / "progress.json") and run.poll() is None:
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)  # the process and its tokenizer workers, as the OOM killer or a job's end
    assert run.wait() == -signal.SIGKILL
    progress = json.loads((out / "progress.json").read_text())
    assert not progress["complete"] and progress["shards"] >= 1 and progress["documents"] > 291  # in train

    resumed = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True)
    assert f"resuming at out_train_{progress['shards']:06d}.bin" in resumed.stdout
    assert digest(out) == CASES["enwiki"][2:]
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True)
    assert "already has its 5 shard(s)" in again.stdout and digest(out) == CASES["enwiki"][2:]


def past_the_first_train_shard(path: Path) -> bool:
    """Whether progress.json (written by a rename: whole or absent) records a finished shard of the second split,
    train: a shard file appears before the progress that counts it."""
    progress = json.loads(path.read_text()) if path.exists() else {}
    return progress.get("shards", 0) >= 1 and progress.get("documents", 0) > 291


def test_a_run_interrupted_at_any_write_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    """Interrupted at each fsync in turn (of a shard, progress.json, the manifest or the directory), as a kill there
    would stop it: the same command again gives the uninterrupted run's files, across the val/train boundary too."""
    rng = random.Random(0)
    for name, count in (("train.jsonl", 15), ("val.jsonl", 6)):
        (tmp_path / name).write_text("".join(json.dumps({"text": "x" * rng.randint(0, 120)}) + "\n"
                                             for _ in range(count)))
    flags = ["--input", str(tmp_path / "train.jsonl"), "--val_input", str(tmp_path / "val.jsonl"), "--shard_size",
             "250", "--tokenizer", "bytes"]
    calls, interrupt = [], {"at": None}

    def counted_fsync(fd):  # (durability is not under test: no real fsync, which would make this slow)
        calls.append(fd)
        if len(calls) == interrupt["at"]:
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", counted_fsync)
    prepare.main([*flags, "--output_dir", str(tmp_path / "reference" / "out")])
    writes, reference = len(calls), digest(tmp_path / "reference" / "out")
    assert reference[0] == 7 and writes == 46  # 2 shards of val, 5 of train; the manifest and progress.json 8 times,
    # every write 2 fsyncs (the file, then its directory)
    for at in range(1, writes + 1):
        out, calls[:], interrupt["at"] = tmp_path / str(at) / "out", [], at
        with pytest.raises(KeyboardInterrupt):
            prepare.main([*flags, "--output_dir", str(out)])
        interrupt["at"] = None
        prepare.main([*flags, "--output_dir", str(out)])
        assert digest(out) == reference, f"interrupted at write {at}"


def test_the_pool_reads_a_few_batches_ahead_not_the_whole_input(monkeypatch):
    monkeypatch.setattr(tokenize_shards, "BATCH_CHARS", 41 * 100)  # batches of 100 documents
    pulled = []

    def endless() -> Iterator[str]:
        for i in itertools.count():
            pulled.append(i)
            yield "a document of 40 characters, more or less"

    tokens = tokenize_shards.tokenize_documents(endless(), load_tokenizer("bytes"), num_proc=2)
    first = list(itertools.islice(tokens, 10))
    assert [document.size for document in first] == [42] * 10  # EOT and 41 bytes
    assert 200 <= len(pulled) <= 300  # two batches in flight and the next being gathered, of an endless input
