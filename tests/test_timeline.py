"""rundir/store.py: a run acts only on its own snapshots, those whose .json names it (issue 50, items 1 and 2).

Real runs of the tiny model on one CPU process: another run's snapshot copied into the directory is never pruned,
never resumed, and never written over; a branch from an older snapshot keeps its own directory, and --resume auto
after a crash continues the branch, not the run it branched from.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, make_shards
from helpers_train import main_in_process, read_metrics
from rundir.snapshot import list_snapshots, snapshot_path
from rundir.store import RUN_FILE, read_run
from training.errors import UserError

B, T = 2, 16
JOB = ["--micro_batch_size", str(B), "--seq_len", str(T), "--total_batch_size", str(B * T), "--warmup_steps", "2",
       "--max_lr", "1e-3", "--val_every", "0", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("timeline_data")
    make_shards(directory, "train", [4000], vocab=100, tokenizer="bytes")
    make_shards(directory, "val", [500], seed=1, vocab=100, tokenizer="bytes")
    return directory


def train(data: Path, log_dir: Path, *args: str) -> None:
    main_in_process([*JOB, "--data_dir", str(data), "--log_dir", str(log_dir), *args])


def contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def foreign(data, tmp_path_factory) -> Path:
    """Another run's last snapshot, step 9, of a narrower model (--n_embd 32): what a user may copy in."""
    run = tmp_path_factory.mktemp("foreign_run")
    train(data, run, "--n_embd", "32", "--max_steps", "10", "--snapshot_every", "5", "--keep_last", "1")
    return snapshot_path(run, 9)


@pytest.mark.parametrize("keep_last", [1, 2])
def test_another_runs_snapshot_is_never_pruned_nor_resumed(data, foreign, tmp_path, capsys, keep_last):
    shutil.copy(foreign, tmp_path / foreign.name)
    before = foreign.read_bytes()
    train(data, tmp_path, "--resume", "never", "--snapshot_every", "2", "--keep_last", str(keep_last),
          "--max_steps", "6")
    ours = [snapshot_path(tmp_path, step) for step in (5, 3)[:keep_last]]
    assert list_snapshots(tmp_path) == [tmp_path / foreign.name, *ours]  # (today: the foreign one alone)
    assert (tmp_path / foreign.name).read_bytes() == before
    log = capsys.readouterr().out
    assert log.count(foreign.name) == 1 and "never resumed by --resume auto, never pruned" in log

    train(data, tmp_path, "--snapshot_every", "2", "--keep_last", str(keep_last), "--max_steps", "6")  # auto
    assert f"{ours[0]} is from step 5, the last of --max_steps 6: the run is already finished" in \
        capsys.readouterr().out  # (today: exit 2 on the foreign snapshot's shape)
    assert (tmp_path / foreign.name).read_bytes() == before


def test_a_run_that_would_write_over_another_runs_snapshot_stops_before_its_first_step(data, foreign, tmp_path):
    # Today --resume never deleted an older foreign snapshot_0000000.pt; and a run reaching step 9 would replace the
    # foreign step-9 one. Both stop before training, naming it and a directory of the run's own.
    shutil.copy(foreign, snapshot_path(tmp_path, 0))
    before = contents(tmp_path)
    with pytest.raises(UserError, match=r"holds snapshots this run did not write, at steps it will write "
                                        r"\(snapshot_0000000\.pt\).*--snapshot_dir .*branch_0000000"):
        train(data, tmp_path, "--resume", "never", "--snapshot_every", "2", "--keep_last", "1", "--max_steps", "6")
    assert read_metrics(tmp_path) == [] and contents(tmp_path).items() >= before.items()


@pytest.fixture(scope="module")
def parent(data, tmp_path_factory) -> Path:
    """A run of 10 steps with every snapshot kept (steps 0 to 9)."""
    run = tmp_path_factory.mktemp("parent")
    train(data, run, "--max_steps", "10", "--snapshot_every", "1", "--keep_last", "20")
    return run


def test_a_branch_from_an_older_snapshot_stops_before_writing_over_the_later_ones(data, parent, tmp_path):
    run = shutil.copytree(parent, tmp_path / "run")
    before = contents(run)
    with pytest.raises(UserError) as refused:
        train(data, run, "--resume", str(snapshot_path(run, 3)), "--max_steps", "20", "--snapshot_every", "1",
              "--keep_last", "2")
    # One directory holds one run: a branch from its older snapshot would write over the later ones, or orphan them.
    assert f"holds run {read_run(run).run}'s snapshots (newest: snapshot_0000009.pt)" in str(refused.value)
    assert f"--snapshot_dir {run / 'branch_0000004'}" in str(refused.value)
    after = contents(run)
    assert {name: after[name] for name in before if name.startswith("snapshot_")} == \
        {name: data for name, data in before.items() if name.startswith("snapshot_")}


# The branch, SIGKILLed mid-run: a real process, as a crash leaves it.
BRANCH = [sys.executable, str(ROOT / "train_gpt2.py"), "--model", "tiny", "--device", "cpu", "--eval_every", "0",
          "--sample_every", "0", *JOB, "--max_steps", "20", "--snapshot_every", "1", "--keep_last", "2"]


@pytest.mark.slow  # over 3 s on two busy cores: keeps `-m 'not slow'` within a minute
def test_a_branch_killed_mid_run_resumes_its_own_line_and_never_prunes_its_parent(data, parent, tmp_path):
    run = shutil.copytree(parent, tmp_path / "run")
    branch_dir = run / "branch_0000004"
    before = contents(run)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*BRANCH, "--data_dir", str(data), "--log_dir", str(run), "--snapshot_dir",
                             str(branch_dir), "--resume", str(snapshot_path(run, 3))], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # SIGKILL once its snapshot of step 8 is written
        if line.startswith(f"snapshot written: {snapshot_path(branch_dir, 8)}"):
            proc.send_signal(signal.SIGKILL)
            break
    assert proc.wait(timeout=120) == -signal.SIGKILL
    branch = read_run(branch_dir)
    assert branch.resumed_from == "../snapshot_0000003.pt"  # (relative: the directory may move with its parent)
    assert list_snapshots(branch_dir) == [snapshot_path(branch_dir, 8), snapshot_path(branch_dir, 7)]

    train(data, run, "--snapshot_dir", str(branch_dir), "--max_steps", "20", "--snapshot_every", "1",
          "--keep_last", "2")  # --resume auto: the branch's newest, not the parent's step 9
    # The branch's metrics are its own, beside its parent's metrics.jsonl: never spliced into them.
    assert not any(r.get("step", 0) > 9 for r in read_metrics(run))
    own_metrics = [json.loads(line) for line in (run / f"metrics_{branch.run}.jsonl").read_text().splitlines()]
    resumed = [r for r in own_metrics if r.get("event") == "resume"]
    assert resumed[-1]["snapshot"] == str(snapshot_path(branch_dir, 8)) and resumed[-1]["step"] == 9
    assert json.loads((branch_dir / "snapshot_0000019.json").read_text())["run"] == branch.run
    after = contents(run)  # every snapshot of the parent, 3 among them, as it was
    assert {n: after[n] for n in before if n.startswith("snapshot_")} == \
        {n: b for n, b in before.items() if n.startswith("snapshot_")}


def test_resuming_the_newest_snapshot_by_its_path_continues_the_run_in_place(data, parent, tmp_path):
    run = shutil.copytree(parent, tmp_path / "run")
    recorded = read_run(run)
    train(data, run, "--resume", str(snapshot_path(run, 9)), "--max_steps", "12", "--snapshot_every", "1",
          "--keep_last", "2")
    assert read_run(run) == recorded  # not a branch: the same run goes on, and prunes as it did, but for the
    # snapshot the user named: never deleted
    assert list_snapshots(run) == [snapshot_path(run, 11), snapshot_path(run, 10), snapshot_path(run, 9)]


# A process killed inside its first snapshot's write: run.json already names the new run, so --resume auto starts it
# afresh instead of resuming the higher-step snapshot of another run.
KILLED_IN_FIRST_WRITE = """
import os, signal, sys
import train_gpt2
from rundir import snapshot
snapshot.torch_save = lambda obj, f: os.kill(os.getpid(), signal.SIGKILL)
train_gpt2.main(sys.argv[1:])
"""


@pytest.mark.slow  # two processes
def test_a_crash_in_a_new_runs_first_write_never_resumes_another_runs_snapshot(data, foreign, tmp_path):
    shutil.copy(foreign, tmp_path / foreign.name)
    args = ["--model", "tiny", "--device", "cpu", "--eval_every", "0", "--sample_every", "0", *JOB, "--data_dir",
            str(data), "--log_dir", str(tmp_path), "--snapshot_every", "2", "--max_steps", "6"]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_FIRST_WRITE, *args, "--resume", "never"], env=env,
                            capture_output=True, cwd=ROOT)
    assert killed.returncode == -signal.SIGKILL
    assert (tmp_path / RUN_FILE).exists() and list_snapshots(tmp_path) == [tmp_path / foreign.name]
    train(data, tmp_path, *args[args.index("--snapshot_every"):])  # --resume auto
    assert [r for r in read_metrics(tmp_path) if r.get("event") == "resume"] == []  # a fresh start, at step 0
    assert list_snapshots(tmp_path)[0] == tmp_path / foreign.name
