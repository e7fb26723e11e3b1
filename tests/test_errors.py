"""Mistakes a user can make with train_gpt2.py, run as a real `python train_gpt2.py` (and once under torchrun): each
ends with exit status 2 and one `error:` paragraph naming the file or flag and the fix, and no traceback. A bug of
ours keeps its traceback.

Every launch pays for a fresh Python importing torch (~5 s on 2 cores), so the `runs` fixture starts all of the
single-process cases at once, a few at a time, and each test reads its own result."""

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config

from conftest import ROOT, make_shards
from dataloader import write_shard
from evaluation import tasks as evals
from forked import Command, run_forked
from helpers_train import TINY_ARGS, TrainRun, main_in_process, read_metrics, run_train, train_command, train_env

pytestmark = pytest.mark.slow  # 25 launches of a fresh Python: about a minute

RUN = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "32", "--max_steps", "1", "--val_every",
       "0", "--snapshot_every", "1", "--dtype", "fp32"]
TRACEBACK = "Traceback (most recent call last)"
# A traceback frame in our code (torchrun's launcher prints its own, from torch's files in .venv, beyond our control).
OUR_FRAME = re.compile(rf'File "{re.escape(str(ROOT))}/(?!\.venv/)')
# Port 9 (discard) on this machine refuses connections: a download through this proxy fails at once, and no
# address beyond this machine is ever contacted (urllib hands the whole request to the proxy, DNS included).
NO_NETWORK = {name: "http://127.0.0.1:9" for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")} | {
    "NO_PROXY": "", "no_proxy": "", "HF_HUB_OFFLINE": "1"}
HELLASWAG_CACHE = evals.DEFAULT_DIR / "hellaswag.jsonl"  # where a run without --eval_dir downloads HellaSwag to
HELLASWAG_CACHED = HELLASWAG_CACHE.exists()

# case: the words its error paragraph must hold (the file or flag, what is wrong, the fix)
EXPECTED = {
    "missing data dir": ["data directory", "nowhere", "does not exist", "python -m data.prepare", "--data_dir"],
    "empty data dir": ["no train shards", "empty", "python -m data.prepare"],
    "truncated shard": ["test_train_000000.bin", "header says 400 tokens", "cut off mid-write", "Delete it"],
    "bad magic": ["test_train_000000.bin", "bad magic number 1234", "Re-create it with data/prepare.py"],
    "indivisible batch": ["--total_batch_size 33", "--micro_batch_size × --seq_len × ranks", "e.g. 32"],
    "resume not a torch file": ["--resume", "garbage.pt", "could not be read as a snapshot", "Pass another snapshot"],
    "resume truncated snapshot": ["--resume", "snapshot_0000000.pt", "could not be read as a snapshot", "truncated",
                                  "Pass another snapshot"],
    "resume missing path": ["--resume", "nope.pt", "no such file", "'auto'", "'never'"],
    "config missing": ["--config", "missing.toml", "no such file", "recipes/"],
    "config unknown key": ["--config", "recipe.toml", "unknown setting 'max_step'", "train_gpt2.py --help"],
    "init_from missing": ["--init_from", "nowhere.pt", "no such file or directory", "snapshot_*.pt"],
    "init_from foreign file": ["--init_from", "foreign.pt", "not a snapshot of this codebase",
                               "it lacks 'model' and 'model_config'", "snapshot_*.pt written by train_gpt2.py"],
    "init_from gpt2 with --n_layer 3": ["--init_from gpt2", "--n_layer 3 (the weights have 12)",
                                        "Leave out the shape flags"],
    "hellaswag offline": ["could not download hellaswag from https://", "--eval_dir", "leave hellaswag out of "
                          "--eval_tasks", "--eval_every 0"],
    "token id outside the vocabulary": ["test_val_000000.bin", "token id 50257 at position 123",
                                        "vocabulary of 50,257", "data/prepare.py"],
    "directory named like a shard": ["test_train_000001.bin", "is a directory", "move it out"],
    "hellaswag line not JSON": ["bad/hellaswag.jsonl, line 2: not valid JSON", "--eval_dir", "--eval_every 0"],
    "unknown eval task": ["--eval_tasks 'hellaswag,pica'", "unknown task pica", "or all"],
    # issue 50's
    "config a directory": ["--config", "could not be read (Is a directory)", "recipes/gpt2_124m_fineweb_edu.toml"],
    "max_steps negative": ["--max_steps -3: pass a number at least 1", "--help: \"optimizer steps"],  # exit 0 before
    "init_from hf without gpt2's weights": ["hf_foreign/model.safetensors does not hold the GPT-2 weights",
                                            "28 of its 28 weights missing", "it does not have: foo.weight"],
    "init_from hf with a pickled payload": ["hf_payload/pytorch_model.bin was refused: its pickle holds the global "
                                            "print", "could run code, so it will not be loaded", "model.safetensors"],
    "hellaswag line nested too deeply": ["nested/hellaswag.jsonl, line 1: nested too deeply to be read", "--eval_dir"],
}


class Payload:
    def __reduce__(self):  # what a hostile file holds: a call, run by any unpickler that allows it
        return print, ("the payload ran",)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Good shards: 400 train tokens, 200 val tokens."""
    directory = tmp_path_factory.mktemp("errors_data")
    make_shards(directory, "train", [400])
    make_shards(directory, "val", [200], seed=1)
    return directory


def damaged_copy(data: Path, to: Path, damage) -> Path:
    """A copy of the data directory with its train shard damaged."""
    damage(copy_of(data, to) / "test_train_000000.bin")
    return to


def copy_of(data: Path, to: Path) -> Path:
    to.mkdir(parents=True)
    for shard in data.iterdir():
        (to / shard.name).write_bytes(shard.read_bytes())
    return to


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def bad_magic(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(np.array([1234], dtype="<i4").tobytes())


def with_a_bug(data: Path, tmp: Path) -> Command:
    """train_gpt2.main through run_entry_point, with resolve_plan replaced by one that raises a KeyError: the kind of
    exception a bug of ours raises."""
    tmp.mkdir(parents=True)
    (tmp / "with_a_bug.py").write_text(textwrap.dedent(f"""
        import train_gpt2
        from training.errors import run_entry_point
        def resolve_plan(*args, **kwargs):
            raise KeyError("a bug of ours")
        train_gpt2.resolve_plan = resolve_plan
        run_entry_point(lambda: train_gpt2.main({[*TINY_ARGS, *RUN, "--data_dir", str(data), "--log_dir",
                                                  str(tmp / "logs")]!r}))
    """))
    return Command([str(tmp / "with_a_bug.py")], cwd=str(tmp))


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> dict[str, TrainRun]:
    """Every case of EXPECTED (HellaSwag's only if its cache is empty), plus "bug", each run to its end, a few at a
    time, each a process forked from one that imported torch once (tests/forked.py)."""
    root = tmp_path_factory.mktemp("errors")
    (root / "empty").mkdir()
    (root / "garbage.pt").write_bytes(b"not a torch file\n" * 100)
    (root / "recipe.toml").write_text("max_step = 5\n")
    torch.save({"x": torch.zeros(1)}, root / "foreign.pt")
    hellaswag = {"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["d", "e", "f", "g"], "label": 0}
    for name in ("bad", "nested"):  # --eval_dir directories, each with a broken hellaswag.jsonl
        (root / name).mkdir()
    (root / "bad" / "hellaswag.jsonl").write_text(json.dumps(hellaswag) + '\n{"ctx_a": \n')
    other_vocabulary = copy_of(data, root / "other_vocabulary")
    write_shard(other_vocabulary / "test_val_000000.bin", np.where(np.arange(200) == 123, 50257, 0))
    (copy_of(data, root / "shard_directory") / "test_train_000001.bin").mkdir()
    (root / "nested" / "hellaswag.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    for name in ("hf_foreign", "hf_payload"):  # GPT-2 directories with other weight files: what transformers warned of
        GPT2Config(vocab_size=50257, n_positions=64, n_embd=64, n_layer=2, n_head=2).save_pretrained(root / name)
    save_file({"foo.weight": torch.zeros(3)}, root / "hf_foreign" / "model.safetensors")
    torch.save({"transformer.wte.weight": torch.zeros(3), "x": Payload()}, root / "hf_payload" / "pytorch_model.bin")
    good = ["--data_dir", str(data), *RUN]
    cases = {
        "missing data dir": (["--data_dir", str(root / "nowhere"), *RUN], None),
        "empty data dir": (["--data_dir", str(root / "empty"), *RUN], None),
        "truncated shard": (["--data_dir", str(damaged_copy(data, root / "truncated", cut_short)), *RUN], None),
        "bad magic": (["--data_dir", str(damaged_copy(data, root / "magic", bad_magic)), *RUN], None),
        "indivisible batch": ([*good, "--total_batch_size", "33"], None),
        "resume not a torch file": ([*good, "--resume", str(root / "garbage.pt")], None),
        "resume truncated snapshot": ([*good, "--resume", str(root / "snapshot_0000000.pt")], None),
        "resume missing path": ([*good, "--resume", str(root / "nope.pt")], None),
        "config missing": ([*good, "--config", str(root / "missing.toml")], None),
        "config unknown key": ([*good, "--config", str(root / "recipe.toml")], None),
        "init_from missing": ([*good, "--init_from", str(root / "nowhere.pt")], None),
        "init_from foreign file": ([*good, "--init_from", str(root / "foreign.pt")], None),
        # The shape check reads the name alone; NO_NETWORK makes sure a download could not succeed anyway.
        "init_from gpt2 with --n_layer 3": ([*good, "--init_from", "gpt2", "--n_layer", "3"], NO_NETWORK),
        "hellaswag offline": ([*good, "--eval_every", "1"], NO_NETWORK),
        "token id outside the vocabulary": (["--data_dir", str(other_vocabulary), *RUN, "--val_every", "1"], None),
        "directory named like a shard": (["--data_dir", str(root / "shard_directory"), *RUN], None),
        "hellaswag line not JSON": ([*good, "--eval_every", "1", "--eval_dir", str(root / "bad")], None),
        "unknown eval task": ([*good, "--eval_every", "1", "--eval_tasks", "hellaswag,pica"], None),
        "config a directory": ([*good, "--config", str(root)], None),
        "max_steps negative": ([*good, "--max_steps", "-3"], None),
        "init_from hf without gpt2's weights": ([*good, "--init_from", str(root / "hf_foreign")], None),
        "init_from hf with a pickled payload": ([*good, "--init_from", str(root / "hf_payload")], None),
        "hellaswag line nested too deeply": ([*good, "--eval_every", "1", "--eval_dir", str(root / "nested")], None),
    }
    if HELLASWAG_CACHED:
        del cases["hellaswag offline"]

    # A real snapshot from a 1-step run, cut in half for "resume truncated snapshot".
    main_in_process([*good, "--log_dir", str(root / "snapshot_run")])
    (whole,) = (root / "snapshot_run").glob("snapshot_*.pt")
    (root / whole.name).write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    commands = {}
    for case, (args, env) in cases.items():
        (root / case).mkdir()
        commands[case] = Command(train_command([*args, "--log_dir", str(root / case)])[1:], env or {},
                                 cwd=str(root / case))
    commands["bug"] = with_a_bug(data, root / "bug")
    return {case: TrainRun(proc, read_metrics(root / case)) for case, proc in
            run_forked(commands, ["train_gpt2"], train_env(), timeout=120).items()}


def error_paragraph(run: TrainRun) -> str:
    """The one `error: ` line of a run's stderr, checking what every user error promises."""
    assert run.proc.returncode == 2, run.output[-4000:]
    assert TRACEBACK not in run.output, run.output[-4000:]
    errors = [line for line in run.proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.proc.stderr[-4000:]
    return errors[0]


@pytest.mark.parametrize("case", list(EXPECTED))
def test_a_bad_input_exits_2_with_one_paragraph_naming_it_and_the_fix(runs, case):
    if case == "hellaswag offline" and HELLASWAG_CACHED:
        pytest.skip(f"{HELLASWAG_CACHE} is cached, so a run without --eval_dir never downloads it")
    run = runs[case]
    error = error_paragraph(run)
    missing = [words for words in EXPECTED[case] if words not in error]
    assert not missing, f"{missing} not in: {error}"
    assert "weights_only=False" not in run.output and "the payload ran" not in run.output


def test_hellaswag_offline_fails_at_start_up_and_leaves_no_cache_file(runs):
    if HELLASWAG_CACHED:
        pytest.skip(f"{HELLASWAG_CACHE} is cached, so a run without --eval_dir never downloads it")
    run = runs["hellaswag offline"]
    assert run.proc.returncode == 2 and run.records == []  # before step 0: nothing logged
    assert not HELLASWAG_CACHE.exists() and not list(HELLASWAG_CACHE.parent.glob("*.tmp"))


def test_a_bug_keeps_its_traceback(runs):
    run = runs["bug"]
    assert run.proc.returncode == 1, run.output[-4000:]
    assert TRACEBACK in run.proc.stderr and "KeyError: 'a bug of ours'" in run.proc.stderr, run.proc.stderr[-4000:]
    assert "error: " not in run.proc.stderr


def test_under_torchrun_a_truncated_shard_stops_every_rank_with_the_message_and_no_traceback_of_ours(data, tmp_path):
    bad = damaged_copy(data, tmp_path / "data", cut_short)
    # 2 ranks × 2 × 16 tokens divide 64; timeout: a rank left waiting for its peer would hang well past it.
    run = run_train(["--data_dir", str(bad), *RUN, "--total_batch_size", "64"], tmp_path / "logs", nproc=2,
                    check=False, timeout=120)
    assert run.proc.returncode != 0, run.output[-4000:]
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert errors and all("test_train_000000.bin" in e and "cut off mid-write" in e for e in errors), run.output[-4000:]
    # torchrun's launcher prints its own ChildFailedError report, with a traceback of torch's files; none of ours.
    assert not OUR_FRAME.search(run.output), run.output[-4000:]
