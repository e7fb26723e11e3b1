"""Mistakes a user can make with train_gpt2.py end in one paragraph that names the file or flag and the fix, exit
status 2 and no traceback, on one process and under torchrun; a bug keeps its traceback."""

import re
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

import train_gpt2
from conftest import make_shards
from data import hellaswag
from helpers_train import main_in_process, run_train
from runtime import run_entry_point
from snapshot import snapshot_path

RUN = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "32", "--max_steps", "2", "--val_every",
       "0", "--ckpt_every", "1", "--dtype", "fp32"]
OUR_FILES = re.compile(r'File ".*/(train_gpt2|runtime|config|dataloader|snapshot|training|model|memory)\.py"')


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Good shards, and a finished run's snapshot to damage."""
    root = tmp_path_factory.mktemp("errors")
    make_shards(root / "data", "train", [400])
    make_shards(root / "data", "val", [200], seed=1)
    run_train(["--data_dir", str(root / "data"), *RUN], root / "run")
    return root


def error_of(argv: list[str], capsys) -> str:
    """Run train_gpt2.py's entry point in this process; it must exit 2 printing one `error:` paragraph."""
    with pytest.raises(SystemExit) as exit_status:
        run_entry_point(lambda: main_in_process(argv))
    assert exit_status.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err  # one paragraph
    return err


def damaged_copy(data, tmp_path, damage) -> str:
    """The data directory with its train shard damaged."""
    bad = tmp_path / "data"
    bad.mkdir()
    for shard in (data / "data").iterdir():
        (bad / shard.name).write_bytes(shard.read_bytes())
    damage(bad / "test_train_000000.bin")
    return str(bad)


def cut_short(path):
    path.write_bytes(path.read_bytes()[:-10])


def bad_magic(path):
    with open(path, "r+b") as f:
        f.write(np.array([1234], dtype="<i4").tobytes())


@pytest.mark.parametrize("case, expected", [
    ("missing data dir", r"data directory .*nowhere does not exist; prepare data first, e\.g\. `python data/prepare"),
    ("empty data dir", r"no train shards .* in .*empty; prepare data first"),
    ("truncated shard", r"test_train_000000\.bin: header says 400 tokens .* it was cut off mid-write .* Delete it"),
    ("bad magic", r"test_train_000000\.bin: bad magic number 1234 .* Re-create it with data/prepare\.py"),
    ("indivisible batch", r"--total_batch_size 33 is not a multiple .* e\.g\. 32"),
])
def test_bad_data_or_batch_is_one_paragraph_naming_the_file_or_flag(data, tmp_path, capsys, case, expected):
    (tmp_path / "empty").mkdir()
    data_dir = {"missing data dir": lambda: str(tmp_path / "nowhere"),
                "empty data dir": lambda: str(tmp_path / "empty"),
                "truncated shard": lambda: damaged_copy(data, tmp_path, cut_short),
                "bad magic": lambda: damaged_copy(data, tmp_path, bad_magic)}.get(case, lambda: str(data / "data"))()
    flags = ["--total_batch_size", "33"] if case == "indivisible batch" else []
    err = error_of([*RUN, "--data_dir", data_dir, "--log_dir", str(tmp_path / "logs"), *flags], capsys)
    assert re.search(expected, err), err


@pytest.mark.parametrize("case, expected", [
    ("missing", r"--resume .*nope\.pt: no such file\. Pass the path of a snapshot_\* file"),
    ("not a torch file", r"--resume: .*garbage\.pt could not be read as a snapshot .* Pass another snapshot"),
    ("truncated", r"--resume: .*snapshot_0000001\.pt could not be read as a snapshot .*truncated"),
])
def test_a_bad_snapshot_for_resume_is_one_paragraph(data, tmp_path, capsys, case, expected):
    path = {"missing": tmp_path / "nope.pt", "not a torch file": tmp_path / "garbage.pt",
            "truncated": tmp_path / "snapshot_0000001.pt"}[case]
    if case == "not a torch file":
        path.write_bytes(b"not a torch file\n" * 100)
    elif case == "truncated":
        whole = snapshot_path(data / "run", 1).read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
    err = error_of([*RUN, "--data_dir", str(data / "data"), "--log_dir", str(tmp_path / "logs"), "--resume",
                    str(path)], capsys)
    assert re.search(expected, err), err


@pytest.mark.parametrize("case, expected", [
    ("missing recipe", r"--config .*missing\.toml: no such file"),
    ("unknown key", r"--config .*recipe\.toml: unknown setting 'max_step'"),
    ("missing init_from", r"--init_from .*nowhere: no such file or directory"),
    ("foreign init_from", r"--init_from .*foreign\.pt is not a snapshot of this codebase"),
    ("conflicting shape", r"--init_from gpt2: .*--n_layer 2 \(the weights have 12\).* Leave out the shape flags"),
])
def test_a_bad_recipe_or_init_from_is_one_paragraph(data, tmp_path, capsys, case, expected):
    (tmp_path / "recipe.toml").write_text("max_step = 5\n")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    flags = {"missing recipe": ["--config", str(tmp_path / "missing.toml")],
             "unknown key": ["--config", str(tmp_path / "recipe.toml")],
             "missing init_from": ["--init_from", str(tmp_path / "nowhere")],
             "foreign init_from": ["--init_from", str(tmp_path / "foreign.pt")],
             "conflicting shape": ["--init_from", "gpt2"]}[case]  # the tests' --model tiny has 2 layers, 64 wide
    err = error_of([*RUN, "--data_dir", str(data / "data"), "--log_dir", str(tmp_path / "logs"), *flags], capsys)
    assert re.search(expected, err), err


def test_hellaswag_without_network_says_so_at_start_up(data, tmp_path, capsys, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("Temporary failure in name resolution")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setattr(hellaswag, "CACHE_DIR", tmp_path / "cache")
    err = error_of([*RUN, "--data_dir", str(data / "data"), "--log_dir", str(tmp_path / "logs"), "--hellaswag_every",
                    "1"], capsys)
    assert "no network" in err and "--hellaswag_path" in err and "--hellaswag_every 0" in err
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()  # at start-up, before any step


def test_a_user_error_prints_no_traceback_and_a_bug_keeps_its_own(data, tmp_path, monkeypatch):
    bad = damaged_copy(data, tmp_path, bad_magic)
    run = run_train(["--data_dir", bad, *RUN], tmp_path / "user", check=False)
    assert run.proc.returncode == 2 and "error: " in run.proc.stderr and "bad magic number" in run.proc.stderr
    assert "Traceback" not in run.output

    def bug(*args, **kwargs):
        raise KeyError("a bug of ours")
    monkeypatch.setattr(train_gpt2, "resolve_plan", bug)
    with pytest.raises(KeyError):  # not turned into a user error: its traceback is what a bug report needs
        run_entry_point(lambda: main_in_process(["--data_dir", str(data / "data"), *RUN]))


@pytest.mark.slow
def test_under_torchrun_every_rank_stops_with_the_message_and_no_traceback_of_ours(data, tmp_path):
    bad = damaged_copy(data, tmp_path, cut_short)
    run = run_train(["--data_dir", bad, *RUN, "--total_batch_size", "64"], tmp_path / "logs", nproc=2, check=False,
                    timeout=120)
    assert run.proc.returncode != 0
    assert run.output.count("error: ") == 2 and "it was cut off mid-write" in run.output  # each rank that hit it
    # torchrun's launcher prints its own report (with a traceback of the launcher); none of our frames appear.
    assert not OUR_FILES.search(run.output), run.output[-3000:]
