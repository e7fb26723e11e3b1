"""Issue 60's data and tool cases, each a real process of the real command (forked from one that imported torch once,
tests/forked.py): every input is checked at the door (exit 2, one paragraph naming the file or flag and the fix,
nothing written), a file is there whole or not at all (a full disk, a real tmpfs, is an error naming the path and
leaves no part of a file), and a number that cannot be computed (bits per byte of empty documents) is reported as
such."""

import json
import subprocess
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
from test_tokenizer import word_level

from conftest import save_tiny_model
from data import prepare
from dataloader import HEADER_BYTES, MANIFEST, read_shard_header, read_shard_layout
from forked import Command, run_forked
from helpers_train import TINY_ARGS, TRAIN_SCRIPT, read_metrics, train_env
from tools import export_hf
from training.tokenizer import bytes_spec, gpt2_spec

RUN = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "32", "--max_steps", "1", "--dtype",
       "fp32", "--val_tokens", "64"]
TRACEBACK = "Traceback (most recent call last)"
LONE_SURROGATES = '{"text": "broken \\ud800 text"}\n{"text": "\\udfff alone, a pair \\ud83d\\ude42 joined"}\n'
FULL = "could not be used: the disk is full. Free space there, or pass a path on another disk."
EXPORT_FILES = ["config.json", "export_hf.json", "generation_config.json", "model.safetensors"]


def small_disk(stack: ExitStack, path: Path, size: str) -> bool:
    """A tmpfs of `size` mounted at path until the stack closes; False where this user cannot mount one."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        return False
    stack.callback(subprocess.run, ["umount", str(path)], check=True)
    return True


def left_behind(directory: Path) -> list[str]:
    """Temp files and directories of an atomic write (NAME.PID.tmp, NAME.PID.old) in directory."""
    return sorted(path.name for path in directory.iterdir() if path.suffix in (".tmp", ".old"))


def manifest_dirs(root: Path, text: Path) -> dict[str, Path]:
    """Bytes shards whose manifest is a link to nothing, records 3·10⁹ ids, has no version, has version 2."""
    good = root / "bytes"
    prepare.main(["--input", str(text), "--output_dir", str(good), "--tokenizer", "bytes"])
    manifest = json.loads((good / MANIFEST).read_text())
    dirs = {}
    huge = {"tokenizer": manifest["tokenizer"] | {"vocab_size": 3 * 10**9}}
    for case, change in [("dangling", None), ("vocab", huge), ("unversioned", {"version": None}),
                         ("version 2", {"version": 2})]:
        path = root / "manifest" / case.replace(" ", "_")
        path.mkdir(parents=True)
        for shard in good.glob("*.bin"):
            (path / shard.name).write_bytes(shard.read_bytes())
        if change is None:
            (path / MANIFEST).symlink_to(root / "no_such_manifest.json")
        else:
            edited = {key: value for key, value in (manifest | change).items() if value is not None}
            (path / MANIFEST).write_text(json.dumps(edited))
        dirs[case] = path
    return dirs


@pytest.fixture(scope="module")
def world(tmp_path_factory, gpt2_encoding):
    """What every case reads, made before any runs: texts, tokenizers, shard directories, snapshots, exports, disks."""
    root = tmp_path_factory.mktemp("doors")
    text = root / "text.txt"
    text.write_text("Some plain English text, written again and again to train on. " * 300)
    (root / "surrogates.jsonl").write_text(LONE_SURROGATES * 20)
    (root / "empty.jsonl").write_text('{"text": ""}\n' * 1000)  # documents of no text: only <|endoftext|>
    word_level(root / "words")
    snapshot = save_tiny_model(root / "model.pt")
    bytes_snapshot = root / "bytes_model.pt"
    torch.save(torch.load(snapshot) | {"tokenizer": bytes_spec().to_dict()}, bytes_snapshot)
    export_hf.main([str(bytes_snapshot), str(root / "re_export")])  # an earlier export, with a tokenizer.json
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("a user's own file")
    prepare.main(["--input", str(root / "empty.jsonl"), "--output_dir", str(root / "empty")])
    w = {"root": root, "text": text, "snapshot": snapshot, "bytes_snapshot": bytes_snapshot,
         "manifest": manifest_dirs(root, text)}
    with ExitStack() as stack:
        w["disks"] = all([small_disk(stack, root / "full_prepare", "1m"), small_disk(stack, root / "full_tok", "1m"),
                          small_disk(stack, root / "full_export", "20m")])
        if w["disks"]:
            (root / "full_prepare" / "text.txt").write_text("x" * 600_000)  # 1.2 MB of uint16 shards for 1 MB
            (root / "full_tok" / "filler").write_bytes(b"\0" * (1024**2 - 4096))  # a page left
            export_hf.main([str(snapshot), str(root / "full_export" / "hf")])  # 13 MB of 20: no room for another
        yield w


def cases(w: dict) -> dict[str, Command]:
    root, snapshot, manifest = w["root"], str(w["snapshot"]), w["manifest"]

    def train(data_dir: Path, *args: str) -> Command:
        return Command([str(TRAIN_SCRIPT), *TINY_ARGS, *RUN, "--data_dir", str(data_dir), "--log_dir",
                        str(root / "logs" / data_dir.name), *args])

    commands = {
        "train_tokenizer --vocab_size 2**32": Command(["-m", "data.train_tokenizer", "--input", str(w["text"]),
                                                       "--vocab_size", str(2**32), "--output", str(root / "huge")]),
        "prepare --tokenizer a WordLevel": Command(["-m", "data.prepare", "--input", str(w["text"]), "--output_dir",
                                                    str(root / "words_data"), "--tokenizer", str(root / "words")]),
        "train_tokenizer on lone surrogates": Command(["-m", "data.train_tokenizer", "--input",
                                                       str(root / "surrogates.jsonl"), "--vocab_size", "300",
                                                       "--output", str(root / "surrogate_tok")]),
        "prepare lone surrogates (gpt2)": Command(["-m", "data.prepare", "--input", str(root / "surrogates.jsonl"),
                                                   "--output_dir", str(root / "surrogates_gpt2")]),
        "prepare lone surrogates (bytes)": Command(["-m", "data.prepare", "--input", str(root / "surrogates.jsonl"),
                                                    "--output_dir", str(root / "surrogates_bytes"), "--tokenizer",
                                                    "bytes"]),
        "export over an earlier export": Command(["-m", "tools.export_hf", snapshot, str(root / "re_export")]),
        "export into a user's directory": Command(["-m", "tools.export_hf", snapshot, str(root / "mine")]),
        "evaluate empty documents": Command(["-m", "tools.evaluate", "--snapshot", snapshot, "--data_dir",
                                             str(root / "empty"), "--micro_batch_size", "2", "--seq_len", "16",
                                             "--val_tokens", "64", "--device", "cpu", "--dtype", "fp32"]),
        "train on empty documents": train(root / "empty", "--val_every", "1"),
    } | {f"train with a manifest: {case}": train(path) for case, path in manifest.items()}
    if w["disks"]:
        commands |= {
            "prepare on a full disk": Command(["-m", "data.prepare", "--input", str(root / "full_prepare" / "text.txt"),
                                               "--output_dir", str(root / "full_prepare" / "d"), "--tokenizer",
                                               "bytes"]),
            "train_tokenizer on a full disk": Command(["-m", "data.train_tokenizer", "--input", str(w["text"]),
                                                       "--vocab_size", "400", "--output",
                                                       str(root / "full_tok" / "tok")]),
            "export on a full disk": Command(["-m", "tools.export_hf", str(w["bytes_snapshot"]),
                                              str(root / "full_export" / "hf")]),
            "export on a full disk, a new directory": Command(["-m", "tools.export_hf", snapshot,
                                                               str(root / "full_export" / "new")]),
        }
    return commands


@pytest.fixture(scope="module")
def runs(world) -> dict[str, subprocess.CompletedProcess]:
    preload = ["train_gpt2", "data.prepare", "data.train_tokenizer", "tools.export_hf", "tools.evaluate"]
    before = {path: path.read_bytes() for path in (world["root"] / "full_export" / "hf").glob("*")}
    done = run_forked(cases(world), preload, train_env())
    world["export_before"] = before
    return done


def refused(run: subprocess.CompletedProcess, *words: str) -> str:
    """The one paragraph of a run that exited 2 without a traceback; each of words in it."""
    assert run.returncode == 2 and TRACEBACK not in run.stderr, run.stderr[-3000:]
    paragraph = run.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in paragraph, paragraph
    return paragraph


@pytest.mark.slow  # about 20 processes, a few at a time: half a minute
def test_a_vocab_size_past_what_the_trainer_can_hold_is_refused_naming_the_flag(runs, world):
    refused(runs["train_tokenizer --vocab_size 2**32"], f"argument --vocab_size: {2**32}: a byte-level BPE has 257 "
            "to 16,777,216 tokens")
    assert not (world["root"] / "huge").exists()


@pytest.mark.slow
def test_a_tokenizer_json_that_is_no_byte_level_bpe_is_refused_where_it_is_loaded(runs, world):
    words = world["root"] / "words"
    refused(runs["prepare --tokenizer a WordLevel"], f"--tokenizer {words}: {words / 'tokenizer.json'} is not a "
            "Hugging Face tokenizer.json that can be used here (ValueError: its model is WordLevel, not BPE; this "
            "code reads byte-level BPEs only")
    assert not (world["root"] / "words_data").exists()


@pytest.mark.slow
def test_lone_surrogates_in_json_lines_are_the_replacement_character_as_tiktoken_makes_them(runs, world,
                                                                                            gpt2_encoding):
    for case in ("train_tokenizer on lone surrogates", "prepare lone surrogates (gpt2)",
                 "prepare lone surrogates (bytes)"):
        assert runs[case].returncode == 0, runs[case].stderr[-3000:]
    assert json.loads((world["root"] / "surrogate_tok" / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    documents = [json.loads(line)["text"] for line in LONE_SURROGATES.splitlines()] * 20
    train = documents[:36]  # --val_fraction 0.1 of 40 documents: the last 4 are val
    gpt2 = np.fromfile(world["root"] / "surrogates_gpt2" / "surrogates_gpt2_train_000000.bin", dtype="<u2",
                       offset=HEADER_BYTES).tolist()
    # tiktoken replaces a lone surrogate itself: GPT-2's shards are what they were
    assert gpt2 == [t for document in train for t in [50256, *gpt2_encoding.encode_ordinary(document)]]
    path = world["root"] / "surrogates_bytes" / "surrogates_bytes_train_000000.bin"
    num_tokens, dtype = read_shard_layout(path)
    bytes_tokens = np.fromfile(path, dtype=dtype, offset=HEADER_BYTES)
    first = "broken \ufffd text".encode()
    assert bytes_tokens[: 1 + len(first)].tolist() == [256, *first]
    assert bytes(bytes_tokens[bytes_tokens < 256].tolist()).decode().count("\ufffd") == len(train)  # one a document


@pytest.mark.slow
def test_a_manifest_that_cannot_be_read_or_is_of_another_version_or_size_is_refused_naming_it(runs, world):
    manifest = world["manifest"]
    refused(runs["train with a manifest: dangling"], f"{manifest['dangling'] / MANIFEST}, a symbolic link to "
            f"{world['root'] / 'no_such_manifest.json'}, could not be read (No such file or directory)")
    refused(runs["train with a manifest: vocab"], f"{manifest['vocab'] / MANIFEST}: its tokenizer record is "
            "malformed: vocab_size 3,000,000,000 is not 1 to 16,777,216")
    refused(runs["train with a manifest: unversioned"], f"{manifest['unversioned'] / MANIFEST} has no version, and "
            "this code reads manifests of version 1 only")
    refused(runs["train with a manifest: version 2"], f"{manifest['version 2'] / MANIFEST} has version 2, and this "
            "code reads manifests of version 1 only")


@pytest.mark.slow
def test_an_export_replaces_an_earlier_export_whole_and_refuses_a_users_directory(runs, world):
    assert runs["export over an earlier export"].returncode == 0, runs["export over an earlier export"].stderr
    exported = world["root"] / "re_export"
    assert sorted(path.name for path in exported.iterdir()) == EXPORT_FILES  # the bytes export's tokenizer.json: gone
    assert json.loads((exported / "export_hf.json").read_text()) == {
        "version": 2, "snapshot": str(world["snapshot"]), "tokenizer": gpt2_spec().to_dict(),
        "files": sorted(set(EXPORT_FILES) - {"export_hf.json"})}
    assert left_behind(world["root"]) == []
    mine = world["root"] / "mine"
    refused(runs["export into a user's directory"], f"{mine} holds files (notes.txt) and no export_hf.json, so it is "
            f"no earlier export of this tool. The export replaces {mine} whole, and deletes nothing it did not write")
    assert [path.name for path in mine.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_bits_per_byte_of_empty_documents_are_left_out_with_a_note_and_the_loss_still_comes(runs, world):
    note = "WARNING: val_bpb is left out: the validation's targets hold no text, only <|endoftext|>"
    evaluated, trained = runs["evaluate empty documents"], runs["train on empty documents"]
    assert evaluated.returncode == 0 and note in evaluated.stderr, evaluated.stderr[-3000:]
    assert "val_bpb: None" in evaluated.stdout.splitlines() and "val_loss: " in evaluated.stdout
    assert trained.returncode == 0 and trained.stderr.count(note) == 1, trained.stderr[-3000:]
    validated = [record for record in read_metrics(world["root"] / "logs" / "empty") if "val_loss" in record]
    assert validated and all("val_bpb" not in record and record["val_loss"] > 0 for record in validated)


@pytest.mark.slow
def test_a_full_disk_is_an_error_naming_the_path_and_leaves_every_file_whole_or_absent(runs, world):
    if not world["disks"]:
        pytest.skip("needs a tmpfs mounted (mount -t tmpfs): run as root")
    root = world["root"]
    out = root / "full_prepare" / "d"
    refused(runs["prepare on a full disk"], f"--output_dir {out}: {out / 'd_train_000000.bin'} {FULL}")
    assert left_behind(out) == [] and read_shard_header(out / "d_val_000000.bin") == 60_001  # whole, as is the rest
    assert not (out / "d_train_000000.bin").exists()
    tok = root / "full_tok" / "tok"
    refused(runs["train_tokenizer on a full disk"], f"--output {tok}: {tok / 'tokenizer.json'} {FULL}")
    assert list(tok.iterdir()) == []
    hf = root / "full_export" / "hf"
    refused(runs["export on a full disk"], f"{hf} {FULL}")
    assert {path: path.read_bytes() for path in hf.glob("*")} == world["export_before"]  # the earlier export, whole
    refused(runs["export on a full disk, a new directory"], f"{hf.parent / 'new'} {FULL}")
    assert sorted(path.name for path in hf.parent.iterdir()) == ["hf"]  # no config.json without its weights

