"""Issue 55's clean errors, each case a real process (train_gpt2.py or a tool): a path the file system refuses (a name
longer than it allows, a symbolic link loop, a file where a directory should be), a failing disk (EIO, injected for
real in the child: EIO_SITECUSTOMIZE), a number flag too large for the libraries it reaches, and a pickle that would
run code. Each ends with exit status 2 and one `error:` paragraph naming the flag or the path, and no traceback.

Also the class at its one place each: every number flag of TrainConfig bounded (config.check_flag_ranges), an
OSError on a path the user gave named by its flag (errors.path_error), and every pickle-format file read by
snapshot.read_torch_file (no other torch.load or unpickler outside tests/)."""

import ast
import errno
import os
import re
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config

from conftest import ROOT, make_shards
from forked import Command, run_forked
from helpers_train import TINY_ARGS, TRAIN_SCRIPT, run_train, train_env
from rundir.snapshot import REQUIRED_KEYS
from training.config import LARGEST_COUNT, TrainConfig, check_flag_ranges, parse_args, set_type
from training.distributed import checked_device
from training.errors import UserError, path_error

RUN = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "32", "--max_steps", "1", "--val_every",
       "0", "--dtype", "fp32"]
TRACEBACK = "Traceback (most recent call last)"
NAME_MAX = os.pathconf("/tmp", "PC_NAME_MAX")  # 255 on ext4, xfs, tmpfs, btrfs

# Run first by the case's process (forked.Command's prelude): reads of the file $EIO_PATH fail as a failing disk's do,
# with EIO from read() (opening it succeeds, and the error names no file, as the kernel's).
EIO_PRELUDE = '''
import builtins
import errno
import io
import os

FAILING = os.path.realpath(os.environ["EIO_PATH"])
real_open = io.open


class FailingReads(io.BufferedReader):
    def read(self, *args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    read1 = readinto = readinto1 = readline = readlines = peek = read


def open_failing(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, bytes, os.PathLike)) and "r" in mode and os.path.realpath(file) == FAILING:
        return FailingReads(real_open(file, "rb", buffering=0))
    return real_open(file, mode, *args, **kwargs)


builtins.open = io.open = open_failing
'''


class SystemCall:
    """What a hostile pickle holds: a call of os.system, which any unpickler that allows it runs."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Shards, a real snapshot, and the paths each case needs: a symlink loop, a regular file, a name one byte longer
    than the file system allows, a recipe, hostile pickles, the EIO prelude."""
    root = tmp_path_factory.mktemp("clean_errors")
    make_shards(root / "data", "train", [400])
    make_shards(root / "data", "val", [200], seed=1)
    run_train(["--data_dir", str(root / "data"), *RUN], root / "run")
    (snapshot,) = (root / "run").glob("snapshot_*.pt")
    (root / "loop").mkdir()
    (root / "loop" / "a").symlink_to(root / "loop" / "b")
    (root / "loop" / "b").symlink_to(root / "loop" / "a")
    (root / "a_file").write_text("a regular file\n")
    (root / "recipe.toml").write_text(f"keep_last = {10**30}\n")
    (root / "eio.py").write_text(EIO_PRELUDE)
    marker = root / "the payload ran"
    torch.save({key: SystemCall(marker) if key == "model" else {} for key in REQUIRED_KEYS}, root / "hostile.pt")
    GPT2Config(vocab_size=50257, n_positions=64, n_embd=64, n_layer=2, n_head=2).save_pretrained(root / "hf_hostile")
    torch.save({"transformer.wte.weight": torch.zeros(3), "x": SystemCall(marker)},
               root / "hf_hostile" / "pytorch_model.bin")
    return {"root": root, "data": root / "data", "snapshot": snapshot, "loop": root / "loop" / "a",
            "file": root / "a_file", "long": root / ("x" * (NAME_MAX + 1)), "recipe": root / "recipe.toml",
            "eio": root / "eio.py", "marker": marker, "hostile": root / "hostile.pt", "hf_hostile": root / "hf_hostile"}


def cases(w: dict[str, Path]) -> dict[str, tuple[list[str], dict[str, str] | None, list[str]]]:
    """case: (the command after `python`, environment added, the words its error paragraph must hold)."""
    root, long, loop, snapshot = w["root"], str(w["long"]), str(w["loop"]), str(w["snapshot"])
    too_long = "longer than the file system allows"
    eio = {"EIO_PATH": snapshot}
    io_error = "the device reported an I/O error"

    def train(case: str, *args: str) -> list[str]:
        return [str(TRAIN_SCRIPT), *TINY_ARGS, "--data_dir", str(w["data"]), *RUN, "--log_dir",
                str(root / "logs" / re.sub(r"\W", "_", case)), *args]

    table = {
        # a name longer than the file system allows
        "--log_dir too long": (["--log_dir", long], None, [f"--log_dir {long} could not be used", too_long]),
        "--snapshot_dir too long": (["--snapshot_dir", f"{long}/x"], None, [f"--snapshot_dir {long}/x could not be "
                                                                             "used", too_long]),
        "--data_dir too long": (["--data_dir", long], None, [f"--data_dir {long}", too_long]),
        "--resume too long": (["--resume", f"{long}.pt"], None, [f"--resume {long}.pt", too_long]),
        "--init_from too long": (["--init_from", long], None, [f"--init_from {long}", too_long]),
        "--config too long": (["--config", f"{long}.toml"], None, [f"--config {long}.toml", "File name too long"]),
        # a symbolic link loop
        "--log_dir a loop": (["--log_dir", loop], None, [f"--log_dir {loop} cannot be written",
                                                         "Too many levels of symbolic links"]),
        "--snapshot_dir a loop": (["--snapshot_dir", loop], None, [f"--snapshot_dir {loop} cannot be written"]),
        "--data_dir a loop": (["--data_dir", loop], None, [loop]),
        "--resume a loop": (["--resume", loop], None, [f"--resume {loop}"]),
        "--init_from a loop": (["--init_from", loop], None, [f"--init_from {loop}"]),
        # a failing disk under a snapshot
        "--resume EIO": (["--resume", snapshot], eio, [f"--resume {snapshot} could not be used", io_error]),
        "--init_from EIO": (["--init_from", snapshot], eio, [f"--init_from {snapshot} could not be used", io_error]),
        # numbers past what the libraries take (--warmup_steps 10**400: "int too large to convert to float")
        "--warmup_steps 10**400": (["--warmup_steps", str(10**400)], None, ["--warmup_steps 1000", "at most 2147483647",
                                                                          '(--help: "linear LR warmup steps")']),
        "--max_steps 10**30": (["--max_steps", str(10**30)], None, [f"--max_steps {10**30}: pass a number at least 1 "
                                                                    "and at most 2147483647"]),
        "--keep_last 10**30": (["--keep_last", str(10**30)], None, [f"--keep_last {10**30}", "at most 2147483647"]),
        "--max_lr 1e400": (["--max_lr", "1e400"], None, ["--max_lr inf: pass a finite number above 0"]),
        "a recipe's keep_last 10**30": (["--config", str(w["recipe"])], None, [f"--keep_last {10**30}",
                                                                               "at most 2147483647"]),
        # pickles that would run code: our snapshot's reader, and Hugging Face's pytorch_model.bin through it
        "--init_from a hostile snapshot": (["--init_from", str(w["hostile"])], None, [
            f"{w['hostile']} was refused: its pickle holds the global posix.system"]),
        "--init_from a hostile pytorch_model.bin": (["--init_from", str(w["hf_hostile"])], None, [
            f"{w['hf_hostile'] / 'pytorch_model.bin'} was refused: its pickle holds the global posix.system"]),
    }
    table = {case: (train(case, *args), env, words) for case, (args, env, words) in table.items()}
    return table | {
        "export_hf into a path under a regular file": (
            ["-m", "tools.export_hf", snapshot, f"{w['file']}/out"], None,
            [f"{w['file']}/out could not be used: a part of it that should be a directory is a file"]),
        "export_hf into a name too long": (["-m", "tools.export_hf", snapshot, long], None, [long, too_long]),
        "export_hf into a loop": (["-m", "tools.export_hf", snapshot, loop], None, [loop, "in a loop"]),
        "export_hf EIO": (["-m", "tools.export_hf", snapshot, str(root / "exported")], eio, [
            f"{snapshot} could not be used", io_error]),
        "sample --snapshot too long": (["-m", "tools.sample", "--snapshot", f"{long}.pt"], None,
                                       [f"--snapshot {long}.pt", too_long]),
        "sample --model too long": (["-m", "tools.sample", "--model", long], None, [f"--model {long}", too_long]),
        "sample EIO": (["-m", "tools.sample", "--snapshot", snapshot], eio, [f"--snapshot {snapshot} could not be "
                                                                             "used", io_error]),
        "sample --max_new_tokens 10**30": (["-m", "tools.sample", "--snapshot", snapshot, "--max_new_tokens",
                                            str(10**30)], None, [f"--max_new_tokens {10**30}", "at most 2147483647"]),
        "evaluate --snapshot too long": (["-m", "tools.evaluate", "--snapshot", f"{long}.pt"], None,
                                         [f"--snapshot {long}.pt", too_long]),
        "evaluate EIO": (["-m", "tools.evaluate", "--snapshot", snapshot], eio, [f"--snapshot {snapshot} could not be "
                                                                                 "used", io_error]),
    }


CASES = list(cases({name: Path(name) for name in ("root", "data", "snapshot", "loop", "file", "long", "recipe",
                                                   "eio", "marker", "hostile", "hf_hostile")}))


@pytest.fixture(scope="module")
def runs(world) -> dict[str, subprocess.CompletedProcess]:
    """Every case run to its end, a few at a time, each a process forked from one that imported torch once."""
    commands = {case: Command(command, env or {}, prelude=str(world["eio"]) if env else None)
                for case, (command, env, _) in cases(world).items()}
    return run_forked(commands, ["train_gpt2", "tools.export_hf", "tools.sample", "tools.evaluate"], train_env())


@pytest.mark.slow  # 31 processes: half a minute
@pytest.mark.parametrize("case", CASES)
def test_a_path_or_number_the_system_refuses_exits_2_with_one_paragraph_naming_it(world, runs, case):
    proc = runs[case]
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and TRACEBACK not in output, output[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-4000:]
    missing = [words for words in cases(world)[case][2] if words not in errors[0]]
    assert not missing, f"{missing} not in: {errors[0]}"
    assert not world["marker"].exists()  # no pickle ran its call


@pytest.mark.slow  # (the runs above)
def test_our_snapshot_and_a_hugging_face_bin_are_refused_with_the_same_words(world, runs):
    def refusal(case: str, path: Path) -> str:
        error = next(line for line in runs[case].stderr.splitlines() if line.startswith("error: "))
        return error.split(f"{path} ", 1)[1].split(". ")[0]

    ours = refusal("--init_from a hostile snapshot", world["hostile"])
    theirs = refusal("--init_from a hostile pytorch_model.bin", world["hf_hostile"] / "pytorch_model.bin")
    assert ours == theirs == ("was refused: its pickle holds the global posix.system, which is not plain data, and "
                              "unpickling it could run code, so it will not be loaded")


# ----------------------------------------------------------------------------------------------------------------
# the class, at its one place each

NUMBER_FLAGS = [f.name for f in fields(TrainConfig) if set_type(f.type) in (int, float, int | str)]


@pytest.mark.parametrize("flag", NUMBER_FLAGS)
def test_every_number_flag_refuses_a_value_past_what_the_libraries_take(flag):
    kind = set_type(next(f.type for f in fields(TrainConfig) if f.name == flag))
    too_large = "1e400" if kind is float else str(2**64)  # (inf; past every whole-number flag's top, --seed's too)
    with pytest.raises(UserError, match=rf"^--{flag} (inf|{too_large}): pass a (finite )?number "):
        check_flag_ranges(parse_args([f"--{flag}", too_large]))
    if kind is not float and flag != "seed":  # the largest count is taken, one more is not
        check_flag_ranges(parse_args([f"--{flag}", str(LARGEST_COUNT)]))
        with pytest.raises(UserError, match=rf"and at most {LARGEST_COUNT}"):
            check_flag_ranges(parse_args([f"--{flag}", str(LARGEST_COUNT + 1)]))


@pytest.mark.parametrize("code, argv, expected", [
    (errno.ENAMETOOLONG, ["--data_dir", "/d", "--log_dir", "/"], "--data_dir /d: /d/manifest.json could not be used: "
                                                                 "a name in it is longer than the file system allows"),
    (errno.ELOOP, ["--log_dir=/d/manifest.json"], "--log_dir /d/manifest.json could not be used: its symbolic links"),
    (errno.ENOTDIR, ["snapshot.pt", "/d"], "/d: /d/manifest.json could not be used: a part of it that should be a "
                                           "directory is a file"),
    (errno.EIO, ["--resume", "/elsewhere"], "/d/manifest.json could not be used: the device reported an I/O error"),
])
def test_an_os_error_on_a_path_names_the_argument_it_lies_under(code, argv, expected):
    error = path_error(OSError(code, os.strerror(code), "/d/manifest.json"), argv)
    assert str(error).startswith(expected) and str(error).endswith(".") and "\n" not in str(error)


def test_an_os_error_that_may_be_a_bug_of_ours_keeps_its_traceback():
    assert path_error(OSError(errno.ENOENT, os.strerror(errno.ENOENT), "/d"), ["--data_dir", "/d"]) is None
    assert path_error(OSError(errno.EIO, os.strerror(errno.EIO)), []) is None  # no path to name
    assert path_error(RuntimeError("a bug of ours"), []) is None


def test_pathlibs_symlink_loop_error_is_named_as_the_loop_it_is(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    try:
        (tmp_path / "a").resolve()  # RuntimeError before Python 3.13, OSError(ELOOP) from 3.13 on
    except (RuntimeError, OSError) as e:
        error = path_error(e, ["--resume", str(tmp_path / "a")])
    assert str(error).startswith(f"--resume {tmp_path / 'a'} could not be used: its symbolic links point at each other")


def test_every_pickle_format_file_is_read_through_snapshots_reader_alone():
    """No torch.load or unpickler in the code (tests/ aside) but read_torch_file (every torch file, ours and a Hugging
    Face pytorch_model.bin), and safe_load_shards.py's of a directory snapshot's .metadata and shard values."""
    found = {}
    # The project's files, as git lists them (not what it ignores: .venv, mutmut's copies in mutants/, ...)
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    for name in listed:
        if not name.startswith("tests/") and (calls := unpickling_calls(ast.parse((ROOT / name).read_text()))):
            found[name] = calls
    assert found == {"training/safe_load.py": {"read_torch_file"},
                     "training/safe_load_shards.py": {"read_shard_metadata", "PlainDataLoadPlanner.load_bytes"}}


def unpickling_calls(node: ast.AST, where: str = "<module>") -> set[str]:
    """Where (function, or Class.method) a module calls what unpickles: torch.load, pickle.load(s), an Unpickler."""
    found = set()
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.ClassDef):
            found |= unpickling_calls(child, child.name if where == "<module>" else f"{where}.{child.name}")
            continue
        if isinstance(child, ast.Call):
            called = ast.unparse(child.func)
            if called in ("torch.load", "pickle.load", "pickle.loads") or called.endswith("Unpickler"):
                found.add(where)
        found |= unpickling_calls(child, where)
    return found


# ----------------------------------------------------------------------------------------------------------------
# every input checked at the door (training/inputs.py), before a process group, file, lock or download

NOT_UTF8 = os.fsdecode(b"caf\xe9")  # a Latin-1 name, as the command line hands its bytes to Python
NO_CUDA = "no GPU that PyTorch can use (torch.cuda.is_available() is False"
NO_MPS = "no Apple GPU that PyTorch can use"
TORCHRUN = {"TORCHELASTIC_RUN_ID": "none"}  # what torchrun sets beside the ranks


def door_cases(root: Path) -> dict[str, tuple[list[str], dict[str, str], list[str]]]:
    """case: (the command after `python`, environment added, the words its error paragraph must hold)."""
    def train(case: str, *args: str) -> list[str]:
        return [str(TRAIN_SCRIPT), *TINY_ARGS, "--data_dir", str(root / "data"), *RUN, "--log_dir",
                str(root / "logs" / re.sub(r"\W", "_", case)), *args]

    not_torchrun = "set, but not by torchrun (TORCHELASTIC_RUN_ID is not set)"
    not_numbers = "torchrun's ranks are not three whole numbers"
    table = {
        "RANK and WORLD_SIZE without torchrun": ([], {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"},
                                                 ["RANK='0' LOCAL_RANK='0' WORLD_SIZE='2'", not_torchrun,
                                                  "unset RANK LOCAL_RANK WORLD_SIZE"]),
        "WORLD_SIZE alone": ([], {"WORLD_SIZE": "2"} | TORCHRUN, [not_numbers, "WORLD_SIZE='2'"]),
        "RANK not a number": ([], {"RANK": "one", "LOCAL_RANK": "0", "WORLD_SIZE": "2"} | TORCHRUN,
                              [not_numbers, "RANK='one'"]),
        "RANK not below WORLD_SIZE": ([], {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2"} | TORCHRUN,
                                      ["RANK='2' LOCAL_RANK='0' WORLD_SIZE='2': a rank must be below WORLD_SIZE"]),
        "--device cuda": (["--device", "cuda"], {}, ["--device cuda: this machine has", NO_CUDA, "--device cpu"]),
        "--device mps": (["--device", "mps"], {}, ["--device mps: this machine has", NO_MPS, "--device cpu"]),
        "--log_dir not UTF-8": (["--log_dir", str(root / NOT_UTF8)], {}, [
            f"--log_dir '{root}/caf\\udce9': the name is not valid UTF-8 (byte 0xe9)", "Rename it"]),
        "--snapshot_dir not UTF-8": (["--snapshot_dir", str(root / NOT_UTF8)], {}, ["--snapshot_dir", "(byte 0xe9)"]),
        "--data_dir not UTF-8": (["--data_dir", str(root / NOT_UTF8)], {}, ["--data_dir", "(byte 0xe9)"]),
        "--log_dir empty": (["--log_dir", ""], {}, ["--log_dir is empty (an unset variable in a job script?)"]),
        "--snapshot_dir empty": (["--snapshot_dir", ""], {}, ["--snapshot_dir is empty"]),
        "--data_dir empty": (["--data_dir", ""], {}, ["--data_dir is empty"]),
        "--resume PATH with --init_from": (["--resume", str(root / "none.pt"), "--init_from", "gpt2"], {},
                                           [f"--resume {root / 'none.pt'} and --init_from gpt2 both name the weights"]),
    }
    table = {case: (train(case, *args), env, words) for case, (args, env, words) in table.items()}
    return table | {
        "sample --device cuda": (["-m", "tools.sample", "--snapshot", str(root / "none.pt"), "--device", "cuda"], {},
                                 ["--device cuda", NO_CUDA]),
        "evaluate --device cuda": (["-m", "tools.evaluate", "--snapshot", str(root / "none.pt"), "--device", "cuda"],
                                   {}, ["--device cuda", NO_CUDA]),
        "evaluate --device mps": (["-m", "tools.evaluate", "--snapshot", str(root / "none.pt"), "--device", "mps"],
                                  {}, ["--device mps", NO_MPS]),
    }


DOOR_CASES = list(door_cases(Path("root")))


@pytest.fixture(scope="module")
def door(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """Each case run from an empty working directory of its own, a process forked from one that imported torch."""
    root = tmp_path_factory.mktemp("door")
    make_shards(root / "data", "train", [400])
    make_shards(root / "data", "val", [200], seed=1)
    commands = {}
    for i, (case, (command, env, _)) in enumerate(door_cases(root).items()):
        (root / f"cwd{i}").mkdir()
        commands[case] = Command(command, env, cwd=str(root / f"cwd{i}"))
    return root, run_forked(commands, ["train_gpt2", "tools.sample", "tools.evaluate"], train_env())


@pytest.mark.parametrize("case", DOOR_CASES)
def test_a_bad_flag_or_environment_exits_2_at_the_door_before_anything_is_written(door, case):
    root, runs = door
    if "cuda" in case and torch.cuda.is_available() or "mps" in case and torch.backends.mps.is_available():
        pytest.skip("this machine has the device")
    proc = runs[case]
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and TRACEBACK not in output, output[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and proc.stdout == "", output[-4000:]  # one paragraph, and nothing printed before it
    missing = [words for words in door_cases(root)[case][2] if words not in errors[0]]
    assert not missing, f"{missing} not in: {errors[0]}"
    cwd = root / f"cwd{DOOR_CASES.index(case)}"  # (an empty --log_dir would be it)
    assert not list(cwd.iterdir()) and not (root / "logs").exists() and not (root / NOT_UTF8).exists()


@pytest.mark.parametrize("device, local_rank, words", [
    ("cuda", 1, "--device cuda: this process needs GPU cuda:1 (LOCAL_RANK 1: a GPU a process), but this machine has 1. "
                "Start one process a GPU, 1 a node at most (torchrun --nproc_per_node=1)"),
    ("cuda:2", 0, "--device cuda:2: this process needs GPU cuda:2, but this machine has 1"),
])
def test_a_gpu_this_machine_does_not_have_is_named_with_how_many_it_has(monkeypatch, device, local_rank, words):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=re.escape(words)):
        checked_device(device, local_rank)
    assert checked_device("cuda", 0) == torch.device("cuda", 0)


@pytest.mark.slow  # torchrun with 2 ranks
def test_a_number_flag_too_large_under_torchrun_is_refused_by_every_rank_before_the_process_group(tmp_path):
    """--dist_timeout is the process group's timeout: 24 digits ended in an OverflowError traceback at
    init_process_group on 2 ranks (one process has no group, so it was a clean error there)."""
    make_shards(tmp_path / "data", "train", [400])
    make_shards(tmp_path / "data", "val", [200], seed=1)
    run = run_train([*TINY_ARGS, "--data_dir", str(tmp_path / "data"), *RUN, "--dist_timeout", "9" * 24],
                    tmp_path / "logs", nproc=2, check=False, timeout=120)
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    refusal = f"--dist_timeout {'9' * 24}: pass a number at least 1 and at most 2147483647"
    assert run.proc.returncode != 0 and len(errors) == 2 and all(refusal in error for error in errors), \
        run.output[-4000:]
    assert "OverflowError" not in run.output and not (tmp_path / "logs" / "run.lock").exists()
