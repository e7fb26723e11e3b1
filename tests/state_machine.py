"""The state machine of issue 55: random histories of real runs with faults, checked after every rule against the
state table of docs/reliability.md ("one directory holds one run") and the invariants every run keeps.

A history is a sequence of rules, each acted out for real on a tiny model (train_gpt2.py processes started through
helpers_train.py): start a run (--snapshot_every 2 or 0); rerun a timeline with its own command, --resume auto,
never, or one of its snapshots; branch from any snapshot into a directory of its own; --init_from a snapshot, into a
new directory or into the directory of the run that wrote it; copy a run's directory (its run.json and a snapshot
with its .json, as cp -r does) and continue it there; SIGKILL or Ctrl-C at a chosen step (tests/train_with_pauses.py
holds the run before it reads that step's batch, so the fault lands there exactly); change (cp over, same size) or
delete a shard under a run; truncate, flip a byte of, or delete a snapshot; copy another run's snapshot in (without
its .json); move a branch's parent away and back; make an old snapshot undeletable (chattr +i) so that pruning fails.

The model of the expected state says which directory holds which timeline and how that timeline started (its
lineage), which files the user copied in or damaged, and where each parent is; with the directory as it is, the
table then says what a request must do: continue after step s, start (at step 0, or after the snapshot a branch
starts from), or refuse (exit 2, naming what it must name). After every launch:
- its exit status is 0 or 2 (or SIGKILL's), 2 comes with an "error:" paragraph, and no output holds a "Traceback";
- it did what the table says: its first step is the one expected (a continuation never starts at step 0), a refusal
  names the file and leaves the directory as it was (but for run.lock);
- every loss in the timeline's metrics.jsonl equals the oracle's exactly (fp32 on one CPU process is deterministic):
  an uninterrupted fresh run's, or --init_from run's, each run once and cached (References); a branch continues its
  parent exactly, so its losses are its parent's;
- nothing outside the run's directory changed; in it, the snapshots the user copied in are as they were; the files
  its command names (--resume PATH, --init_from X) and the shards are unchanged;
- a run that finished leaves its last step's snapshot; one stopped by Ctrl-C, or by a shard that changed under it,
  leaves a snapshot of its last step.

The slow suite runs a few histories (tests/test_state_machine.py); the soak, many, printing each history and ending
with the histories, rules and violations counted:

    python tests/state_machine.py --histories 200
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from conftest import ROOT, make_shards
from helpers_train import TrainRun, read_metrics, start_train, wait_train

MAX_STEPS = 8
SNAPSHOT_EVERY = 2
JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--val_every", "0", "--dtype",
       "fp32", "--n_embd", "32", "--warmup_steps", "1", "--max_lr", "1e-2", "--max_steps", str(MAX_STEPS)]
HISTORY_JOB = [*JOB, "--snapshot_every", str(SNAPSHOT_EVERY), "--keep_last", "2"]
TRAIN_SHARDS = [200, 200, 200]  # about 3 steps of 64 tokens each: a run reads all three
STEP_LINE = re.compile(r"^step\s+(\d+) \| loss", re.MULTILINE)
SNAPSHOT_FILE = re.compile(r"snapshot_(\d{7})\.pt")
LAUNCH_TIMEOUT = 180

# A lineage is how a timeline's weights came to be, and so which oracle its losses follow: ("scratch",) for a fresh
# run, then the step of each branch point (--resume PATH from a snapshot of that step); ("init", parent, step) as
# its first element for a run started with --init_from a snapshot of lineage `parent` at `step`.
Lineage = tuple


def root(lineage: Lineage) -> Lineage:
    """The lineage without its branch points: a branch continues its parent exactly (the same flags and data), so its
    losses and training state are the parent's; an --init_from run's depend on the weights it started from."""
    head = lineage[0]
    return ("scratch",) if head == "scratch" else (("init", root(head[1]), head[2]),)


def describe(lineage: Lineage) -> str:
    head, *steps = lineage
    base = head if head == "scratch" else f"init_from({describe(head[1])}@{head[2]})"
    return "".join([base, *(f">{s}" for s in steps)])


def fingerprint(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is written, replaced or truncated (None: gone)."""
    try:
        s = path.stat()
    except FileNotFoundError:
        return None
    return s.st_ino, s.st_size, s.st_mtime_ns


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def snapshot_files(directory: Path) -> dict[int, Path]:
    """The snapshot files in directory, by the step their name says."""
    if not directory.is_dir():
        return {}
    return {int(m.group(1)): p for p in directory.iterdir() if (m := SNAPSHOT_FILE.fullmatch(p.name))}


def write_data(directory: Path, seed: int = 0) -> Path:
    """Shards of the bytes tokenizer: the model is 257 ids wide, not GPT-2's 50,304 (no rule is about GPT-2)."""
    make_shards(directory, "train", TRAIN_SHARDS, seed=seed, vocab=100, tokenizer="bytes")
    make_shards(directory, "val", [200], seed=seed + 1, vocab=100, tokenizer="bytes")
    return directory


# ----------------------------------------------------------------------------------------------------------------
# the oracle

class References:
    """The losses an uninterrupted run of each lineage logs, by step, and its snapshot at every step
    (--snapshot_every 1): one real run per root lineage (a fresh run, or --init_from a root's snapshot), kept."""

    def __init__(self, directory: Path, code: Path):
        self.directory, self.code = directory, code
        self.data = write_data(directory / "data")
        self.runs: dict[Lineage, tuple[Path, dict[int, float]]] = {}

    def losses(self, lineage: Lineage) -> dict[int, float]:
        return self._run(root(lineage))[1]

    def snapshot(self, lineage: Lineage, step: int) -> Path:
        return self._run(root(lineage))[0] / f"snapshot_{step:07d}.pt"

    def _run(self, lineage: Lineage) -> tuple[Path, dict[int, float]]:
        if lineage not in self.runs:
            head = lineage[0]
            origin = [] if head == "scratch" else ["--init_from", str(self.snapshot(head[1], head[2]))]
            directory = self.directory / hashlib.sha1(repr(lineage).encode()).hexdigest()[:12]
            proc = start_train([*JOB, "--data_dir", str(self.data), "--snapshot_every", "1", "--keep_last", "100",
                                *origin], directory, script=self.code / "train_gpt2.py")
            run = wait_train(proc, directory, timeout=LAUNCH_TIMEOUT)
            self.runs[lineage] = directory, {r["step"]: r["loss"] for r in run.train}
        return self.runs[lineage]


# ----------------------------------------------------------------------------------------------------------------
# the model of the expected state

@dataclass
class Timeline:
    """A timeline the history started, in a directory of its own (its --log_dir and --snapshot_dir)."""
    name: str
    directory: Path
    lineage: Lineage
    origin: list[str]  # the flags naming where it started: [], ["--resume", PATH] or ["--init_from", X]
    first_step: int  # the step a start (or a start again) of it logs first

    @property
    def origin_path(self) -> Path | None:
        return Path(self.origin[1]) if self.origin else None


@dataclass
class Expect:
    """What the table says a request does: "run" (continue or start; its first logged step is `first_step`,
    MAX_STEPS for a finished run) or "refuse" (exit 2 before any step, naming each of `names`)."""
    action: str
    why: str
    first_step: int | None = None
    names: list[str] = field(default_factory=list)


@dataclass
class Launch:
    command: str
    returncode: int
    stdout: str
    stderr: str
    steps: list[int]  # the steps it logged, in order
    fault: str | None  # what was done to it mid-run, if anything was

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


class Violation(AssertionError):
    pass


# A fault mid-run: (kind, n, shard) acts before the n-th step of the launch (before it reads that step's batch); a
# shard fault changes or deletes the train shard of that index.
FAULTS = st.none() | st.tuples(st.sampled_from(["kill", "ctrl_c", "change_shard", "delete_shard"]),
                               st.integers(1, MAX_STEPS), st.integers(0, len(TRAIN_SHARDS) - 1))


class RunHistories(RuleBasedStateMachine):
    """Set up by run_histories: where histories live, the oracle, the code under test, strict or collecting."""
    base: Path
    references: References
    code: Path
    strict = True  # raise at the first violation (the test); else record it and end the history (the soak)
    report: "Report"

    def __init__(self):
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="history_", dir=self.base))
        self.data = self.root / "data"
        shutil.copytree(self.references.data, self.data)
        self.shards = {p: sha256(p) for p in sorted(self.data.iterdir())}
        self.other_data = write_data(self.root / "other_data", seed=7)  # other tokens, shards of the same sizes
        self.timelines: list[Timeline] = []
        self.foreign: set[Path] = set()  # other timelines' snapshots the user copied into a timeline's directory
        self.damaged: dict[Path, tuple] = {}  # snapshots the user damaged: path -> fingerprint after the damage
        self.moved: dict[Path, Path] = {}  # parents the user moved away: where they were -> where they are
        self.immutable: list[Path] = []
        self.over = False  # a violation ended the history (collecting)
        self.report.histories += 1
        self.say(f"--- history {self.report.histories} in {self.root}")

    # --- bookkeeping

    def begin(self, rule: str) -> None:
        self.report.rules += 1
        self.say(rule)

    def say(self, line: str) -> None:
        line = line.replace(f"{self.root}/", "")  # (the history's directory is named once, at its start)
        self.report.lines.append(line)
        print(line, flush=True)

    def violation(self, what: str, launch: Launch | None = None) -> None:
        if self.over:  # (collecting: the first of a history is the one to read; the rest may follow from it)
            return
        text = what + (f"\n  command: {launch.command}\n  exit {launch.returncode}, steps {launch.steps}\n"
                       f"  stderr (end): {launch.stderr[-1500:].strip()}" if launch else "")
        text = text.replace(f"{self.root}/", "")
        self.report.violations.append("\n".join([*self.report.lines[self.history_start:], "VIOLATION: " + text]))
        self.say("VIOLATION: " + text)
        if self.strict:
            raise Violation(text)
        self.over = True

    @property
    def history_start(self) -> int:
        return max(i for i, line in enumerate(self.report.lines) if line.startswith("--- history"))

    def new_timeline_dir(self) -> Path:
        return self.root / f"t{len(self.timelines)}"

    def own(self, t: Timeline) -> dict[int, Path]:
        return {s: p for s, p in snapshot_files(t.directory).items() if p not in self.foreign}

    def healthy(self, t: Timeline) -> dict[int, Path]:
        return {s: p for s, p in self.own(t).items() if p not in self.damaged}

    def usable(self, path: Path) -> bool:
        return path.exists() and path not in self.damaged

    def forget_rewritten(self) -> None:
        """A damaged snapshot that a run replaced or pruned is damaged no more."""
        self.damaged = {p: f for p, f in self.damaged.items() if fingerprint(p) == f}

    def sources(self) -> list[tuple[Path, Lineage, int]]:
        """Every snapshot a branch or --init_from can start from: the healthy ones of each timeline, but the last
        step's (a branch from it has nothing to train)."""
        return [(p, t.lineage, s) for t in self.timelines for s, p in sorted(self.healthy(t).items())
                if s < MAX_STEPS - 1]

    # --- the table

    def expect(self, t: Timeline, request: list[str]) -> Expect:
        """What the table says `request` does in t's directory."""
        if request == ["--resume", "never"]:
            return Expect("refuse", "the directory holds a run, --resume never")
        if request == t.origin:
            return self.expect_auto(t, "the same command", same=True)
        if request in ([], ["--resume", "auto"]):
            return self.expect_auto(t, "--resume auto", same=False)
        if request[0] == "--resume" and self.healthy(t) and \
                Path(request[1]) == self.healthy(t)[max(self.healthy(t))]:
            return self.expect_auto(t, "--resume PATH, the newest own snapshot", same=False)
        return Expect("refuse", f"{' '.join(request)}: another PATH or X than the directory's origin")

    def expect_auto(self, t: Timeline, request: str, same: bool) -> Expect:
        """--resume auto, or the same command again (same): the rows of a directory that holds a timeline."""
        own, healthy = self.own(t), self.healthy(t)
        if healthy:
            expect = Expect("run", f"{request}: continue the newest own snapshot that loads", max(healthy) + 1)
        elif own:
            return Expect("refuse", f"{request}: every own snapshot damaged", names=[p.name for p in own.values()])
        elif t.origin_path is not None and not self.usable(t.origin_path):
            return Expect("refuse", f"{request}: no own snapshot, origin gone", names=[str(t.origin_path)])
        elif t.origin[:1] == ["--init_from"] and not same:  # (--resume auto does not say where the weights are)
            return Expect("refuse", f"{request}: started --init_from X, no snapshot yet", names=[str(t.origin_path)])
        else:
            expect = Expect("run", f"{request}: started, no snapshot yet: start again", t.first_step)
        in_the_way = [p.name for s, p in snapshot_files(t.directory).items() if p in self.foreign
                      and expect.first_step <= s < MAX_STEPS]
        if in_the_way:
            return Expect("refuse", f"{request}: another run's snapshot at a step this run writes",
                          names=in_the_way)
        return expect

    # --- launching, and the invariants

    def launch(self, args: list[str], directory: Path, fault: tuple[str, int] | None) -> Launch:
        script, env = self.code / "train_gpt2.py", None
        if fault:
            script = self.code / "tests" / "train_with_pauses.py"
            env = {"PAUSES": json.dumps([["read_ahead", fault[1]]])}
        proc = start_train([*HISTORY_JOB, "--data_dir", str(self.data), *args], directory, env=env, script=script)
        done = None
        if fault:
            marker = directory / f"paused_read_ahead_{fault[1]}_rank0"
            deadline = time.monotonic() + LAUNCH_TIMEOUT
            while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if marker.exists():
                done = self.act(*fault, proc)
                marker.unlink()
        run: TrainRun = wait_train(proc, directory, timeout=LAUNCH_TIMEOUT, check=False)
        for shard, digest in self.shards.items():  # the user puts a shard back as it was
            if done and sha256(shard) != digest:
                shutil.copyfile(self.references.data / shard.name, shard)
        command = " ".join(["train_gpt2.py", *args, "--data_dir", self.data.name])
        steps = [int(s) for s in STEP_LINE.findall(run.proc.stdout)]
        return Launch(command, run.proc.returncode, run.proc.stdout, run.proc.stderr, steps, done)

    def act(self, kind: str, _: int, shard_index: int, proc: subprocess.Popen) -> str:
        if kind == "kill":
            os.killpg(proc.pid, signal.SIGKILL)
        elif kind == "ctrl_c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            shard = self.data / f"test_train_{shard_index:06d}.bin"
            if kind == "delete_shard":
                shard.unlink()
            else:  # in place, as cp does
                shutil.copyfile(self.other_data / shard.name, shard)
            return f"{kind} {shard.name}"
        return kind

    def run_and_check(self, t: Timeline, args: list[str], expect: Expect, fault) -> Launch:
        """Launch t's directory with args, and check every invariant against `expect`."""
        oracle = self.references.losses(t.lineage)  # (computed before the launch: it may change a shard)
        everything = {p: fingerprint(p) for p in self.root.rglob("*")
                      if p.is_file() and p.name != "run.lock" and self.data not in p.parents}
        named = {Path(a): sha256(Path(a)) for flag, a in zip(args, args[1:])
                 if flag in ("--resume", "--init_from") and Path(a).exists()}
        launch = self.launch(args, t.directory, fault)
        self.report.launches += 1
        self.say(f"  {launch.command}{f' [{launch.fault}]' if launch.fault else ''}: exit {launch.returncode}, "
                 f"steps {launch.steps[0] if launch.steps else '-'}..{launch.steps[-1] if launch.steps else '-'} "
                 f"({expect.why}: {expect.action} {expect.first_step if expect.action != 'refuse' else ''})")
        self.check_losses(t, oracle, launch)  # (first: of a run gone wrong, the losses say the most)
        self.check_launch(t, expect, launch, everything)
        for path, digest in named.items():
            if sha256(path) != digest:
                what = "deleted" if not path.exists() else "changed"
                self.violation(f"{path}, named on the command line, was {what}", launch)
        for shard, digest in self.shards.items():
            if launch.fault is None and sha256(shard) != digest:
                self.violation(f"the shard {shard} changed", launch)
        self.forget_rewritten()
        return launch

    def check_launch(self, t: Timeline, expect: Expect, launch: Launch, before: dict[Path, tuple]) -> None:
        if "Traceback" in launch.output:
            self.violation("a traceback", launch)
        killed = launch.fault == "kill"
        if launch.returncode not in (0, 2) and not (killed and launch.returncode == -signal.SIGKILL):
            self.violation(f"exit status {launch.returncode}", launch)
        if launch.returncode == 2 and not re.search(r"^error: ", launch.stderr, re.MULTILINE):
            self.violation("exit 2 without an 'error:' paragraph", launch)
        for path, was in before.items():  # nothing outside the run's directory, nor what the user copied in
            if (t.directory not in path.parents or path in self.foreign) and fingerprint(path) != was:
                self.violation(f"{path} was {'deleted' if not path.exists() else 'changed'} by a run that did not "
                               "write it", launch)
        if expect.action == "refuse":
            if launch.returncode != 2 or launch.steps:
                self.violation(f"expected a refusal ({expect.why}), got a run", launch)
            missing = [name for name in expect.names if name not in launch.output]
            if missing:
                self.violation(f"the refusal ({expect.why}) does not name {', '.join(missing)}", launch)
            changed = [p.name for p, was in before.items() if t.directory in p.parents and fingerprint(p) != was]
            new = [p.name for p in t.directory.iterdir() if p not in before and p.name != "run.lock"] \
                if t.directory.is_dir() else []
            if changed or new:
                self.violation(f"the refused run changed its directory: {', '.join(changed + new)}", launch)
            return
        if launch.steps and launch.steps[0] != expect.first_step:
            random = " (from random weights)" if launch.steps[0] == 0 else ""
            self.violation(f"expected step {expect.first_step} first ({expect.why}), the run logged "
                           f"{launch.steps[0]}{random}", launch)
        if launch.fault is None:
            if launch.returncode != 0 or launch.steps != list(range(expect.first_step, MAX_STEPS)):
                self.violation(f"expected steps {expect.first_step}..{MAX_STEPS - 1} and exit 0 ({expect.why})",
                               launch)
            if not self.usable(t.directory / f"snapshot_{MAX_STEPS - 1:07d}.pt"):
                self.violation("the finished run left no snapshot of its last step", launch)
        elif launch.fault != "kill":
            if launch.fault == "ctrl_c" and launch.returncode != 0:
                self.violation("Ctrl-C: expected a snapshot and exit 0", launch)
            if launch.fault.startswith(("change_shard", "delete_shard")):
                shard = launch.fault.split()[1]
                if launch.returncode != 2 or shard not in launch.stderr:
                    self.violation(f"{shard} changed under the run: expected exit 2 naming it", launch)
            last = t.directory / f"snapshot_{launch.steps[-1]:07d}.pt" if launch.steps else None
            if last and launch.returncode in (0, 2) and not self.usable(last):
                self.violation(f"stopped ({launch.fault}) without a snapshot of its last step {launch.steps[-1]}",
                               launch)

    def check_losses(self, t: Timeline, oracle: dict[int, float], launch: Launch) -> None:
        try:
            records = read_metrics(t.directory)
        except json.JSONDecodeError as e:
            return self.violation(f"{t.directory}/metrics.jsonl does not parse: {e}", launch)
        wrong = [(r["step"], r["loss"], oracle.get(r["step"])) for r in records
                 if "loss" in r and r["loss"] != oracle.get(r["step"])]
        if wrong:
            self.violation(f"{t.name} ({describe(t.lineage)}) logged losses an uninterrupted run does not: "
                           + ", ".join(f"step {s}: {got} (oracle {want})" for s, got, want in wrong[:4]), launch)

    # --- the rules: runs

    @initialize(fault=FAULTS, every=st.sampled_from([SNAPSHOT_EVERY, 0]))
    def first_start(self, fault, every):
        self.start(fault, every)

    @precondition(lambda self: not self.over)
    @rule(fault=FAULTS, every=st.sampled_from([SNAPSHOT_EVERY, 0]))
    def start(self, fault, every):
        """A fresh run in a new directory; with --snapshot_every 0, only its last step and a stop write one."""
        t = Timeline(f"t{len(self.timelines)}", self.new_timeline_dir(), ("scratch",), [], 0)
        self.begin(f"start {t.name} --snapshot_every {every}")
        self.timelines.append(t)
        self.run_and_check(t, ["--log_dir", str(t.directory), "--snapshot_every", str(every)],
                           Expect("run", "nothing: start", 0), fault)

    @precondition(lambda self: not self.over and self.timelines)
    @rule(data=st.data())
    def rerun(self, data):
        """A timeline's directory again: its own command, --resume auto or never, or one of its snapshots. (Its
        choices are drawn here, not as arguments: hypothesis orders rules by their number of arguments, and draws
        the first ones more often in the small histories it tries first.)"""
        t = data.draw(st.sampled_from(self.timelines), label="timeline")
        request = data.draw(st.sampled_from(["same", "auto", "never", "newest", "older"]), label="request")
        fault = data.draw(FAULTS, label="fault")
        own = sorted(self.own(t).items())
        args = {"same": t.origin, "auto": ["--resume", "auto"], "never": ["--resume", "never"],
                "newest": ["--resume", str(own[-1][1])] if own else t.origin,
                "older": ["--resume", str(own[0][1])] if len(own) > 1 else ["--resume", "auto"]}[request]
        self.begin(f"rerun {t.name} ({describe(t.lineage)}) {request}")
        self.run_and_check(t, [*args, "--log_dir", str(t.directory)], self.expect(t, args), fault)

    @precondition(lambda self: not self.over and self.sources())
    @rule(data=st.data(), fault=FAULTS)
    def branch(self, data, fault):
        """--resume PATH into a directory of its own."""
        path, lineage, step = data.draw(st.sampled_from(self.sources()), label="from")
        t = Timeline(f"t{len(self.timelines)}", self.new_timeline_dir(), (*lineage, step), ["--resume", str(path)],
                     step + 1)
        self.begin(f"branch {t.name} from {path.parent.name}/{path.name}")
        self.timelines.append(t)
        self.run_and_check(t, [*t.origin, "--log_dir", str(t.directory)], Expect("run", "nothing: branch", step + 1),
                           fault)

    @precondition(lambda self: not self.over and self.sources())
    @rule(data=st.data(), fault=FAULTS)
    def init_from(self, data, fault):
        """--init_from a snapshot into a new directory."""
        path, lineage, step = data.draw(st.sampled_from(self.sources()), label="from")
        t = Timeline(f"t{len(self.timelines)}", self.new_timeline_dir(), (("init", lineage, step),),
                     ["--init_from", str(path)], 0)
        self.begin(f"init_from {t.name} from {path.parent.name}/{path.name}")
        self.timelines.append(t)
        self.run_and_check(t, [*t.origin, "--log_dir", str(t.directory)], Expect("run", "nothing: init_from", 0),
                           fault)

    @precondition(lambda self: not self.over and self.sources())
    @rule(data=st.data())
    def init_from_in_place(self, data):
        """--init_from one of a timeline's snapshots with --log_dir its own directory (issue 55, item 1)."""
        path, _, _ = data.draw(st.sampled_from(self.sources()), label="from")
        t = next(t for t in self.timelines if t.directory == path.parent)
        self.begin(f"init_from_in_place {t.name} from {path.name}")
        args = ["--init_from", str(path)]
        self.run_and_check(t, [*args, "--log_dir", str(t.directory)], self.expect(t, args), None)

    # --- the rules: what happens to the files between runs

    @precondition(lambda self: not self.over and self.damageable())
    @rule(data=st.data())
    def damage(self, data):
        """Truncate, flip a byte of, or delete one of a timeline's snapshots. (Hypothesis orders rules by their number
        of arguments, then name, and its first history repeats the first rule it can: this one, with no run.)"""
        path = data.draw(st.sampled_from(self.damageable()), label="snapshot")
        how = data.draw(st.sampled_from(["truncate", "flip", "delete"]), label="how")
        self.begin(f"damage {path.parent.name}/{path.name}: {how}")
        if how == "delete":
            path.unlink()
            return
        with open(path, "r+b") as f:
            if how == "truncate":
                f.truncate(path.stat().st_size // 2)
            else:
                f.seek(path.stat().st_size // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
        self.damaged[path] = fingerprint(path)

    def damageable(self) -> list[Path]:
        """The snapshots the user may damage: the timelines' own, not damaged yet (a byte flipped twice is whole)."""
        return sorted(p for t in self.timelines for p in self.healthy(t).values())

    @precondition(lambda self: not self.over and self.sources())
    @rule(data=st.data(), fault=FAULTS)
    def adopt(self, data, fault):
        """Copy a run's directory to a new one (its run.json, and a snapshot with its .json, as cp -r does) and
        continue it there with --resume auto: the same run, in two places."""
        path, lineage, step = data.draw(st.sampled_from(self.sources()), label="snapshot")
        source = next(t for t in self.timelines if t.directory == path.parent)
        t = Timeline(f"t{len(self.timelines)}", self.new_timeline_dir(), lineage, source.origin, source.first_step)
        self.begin(f"adopt {t.name}: {path.parent.name} copied with {path.name}")
        t.directory.mkdir()
        for name in ("run.json", path.name, path.name.replace(".pt", ".json")):
            shutil.copyfile(path.parent / name, t.directory / name)
        self.timelines.append(t)
        self.run_and_check(t, ["--log_dir", str(t.directory)],
                           Expect("run", "a copied run: continue its snapshot", step + 1), fault)

    @precondition(lambda self: not self.over and len(self.timelines) > 1 and self.sources())
    @rule(data=st.data())
    def copy_foreign(self, data):
        """Copy another timeline's snapshot into a timeline's directory (under its own name, where that is free)."""
        path, lineage, _ = data.draw(st.sampled_from(self.sources()), label="snapshot")
        # (Under a name free of the snapshot and of its .json: a .json of the directory's run says the file is its.)
        targets = [t for t in self.timelines if t.directory != path.parent and not (t.directory / path.name).exists()
                   and not (t.directory / path.name.replace(".pt", ".json")).exists()]
        if not targets:
            return
        t = data.draw(st.sampled_from(targets), label="into")
        self.begin(f"copy_foreign {path.parent.name}/{path.name} into {t.name}")
        shutil.copyfile(path, t.directory / path.name)
        self.foreign.add(t.directory / path.name)

    def movable_parents(self) -> list[Timeline]:
        """The timelines whose parent (--resume PATH, --init_from X) is in place."""
        return [t for t in self.timelines if t.origin and t.origin_path.exists()]

    @precondition(lambda self: not self.over and self.movable_parents())
    @rule(data=st.data())
    def move_parent_away(self, data):
        """Move the snapshot a branch (or an --init_from run) started from out of its directory."""
        t = data.draw(st.sampled_from(self.movable_parents()), label="timeline")
        away = self.root / "moved" / f"{len(self.moved)}_{t.origin_path.name}"
        away.parent.mkdir(exist_ok=True)
        self.begin(f"move_parent_away of {t.name}: {t.origin_path.parent.name}/{t.origin_path.name}")
        self.moved[t.origin_path] = t.origin_path.rename(away)
        if t.origin_path in self.damaged:
            self.damaged[away] = self.damaged.pop(t.origin_path)

    @precondition(lambda self: not self.over and any(not p.exists() for p in self.moved))
    @rule(data=st.data())
    def move_parent_back(self, data):
        where = data.draw(st.sampled_from(sorted(p for p in self.moved if not p.exists())), label="parent")
        self.begin(f"move_parent_back {where.parent.name}/{where.name}")
        moved = self.moved.pop(where)
        moved.rename(where)
        if moved in self.damaged:
            self.damaged[where] = self.damaged.pop(moved)

    def prunable(self) -> list[Timeline]:
        """The timelines whose next run writes a snapshot and then prunes an older one."""
        return [t for t in self.timelines if len(self.healthy(t)) > 1 and max(self.healthy(t)) < MAX_STEPS - 1 and
                self.expect(t, []).action == "run"]

    @precondition(lambda self: not self.over and self.prunable())
    @rule(data=st.data())
    def prune_failure(self, data):
        """Make a timeline's oldest snapshot undeletable (chattr +i), then continue it: pruning fails, training
        goes on."""
        t = data.draw(st.sampled_from(self.prunable()), label="timeline")
        oldest = self.healthy(t)[min(self.healthy(t))]
        self.begin(f"prune_failure {t.name}: chattr +i {oldest.name}")
        subprocess.run(["chattr", "+i", str(oldest)], check=True)
        self.immutable.append(oldest)
        try:
            launch = self.run_and_check(t, ["--log_dir", str(t.directory)], self.expect(t, []), None)
            wrote = any(self.own(t).get(s) for s in launch.steps)
            if launch.returncode == 0 and wrote and oldest.name not in launch.stderr:
                self.violation(f"pruning could not delete {oldest.name} (immutable): no warning names it", launch)
        finally:
            subprocess.run(["chattr", "-i", str(oldest)], check=True)
            self.immutable.remove(oldest)

    @precondition(lambda self: self.over)
    @rule()
    def history_over(self):
        """(Collecting: after a violation, the rest of the history does nothing.)"""

    def teardown(self):
        for path in self.immutable:
            subprocess.run(["chattr", "-i", str(path)], check=False)
        shutil.rmtree(self.root, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# running histories

@dataclass
class Report:
    histories: int = 0
    rules: int = 0
    launches: int = 0
    violations: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"histories: {self.histories}, rules: {self.rules}, launches: {self.launches}, "
                f"violations: {len(self.violations)}")


def run_histories(base: Path, histories: int, steps: int, seed: int, strict: bool, code: Path = ROOT) -> Report:
    """`histories` random histories of up to `steps` rules each, drawn from `seed`, of the runs of `code`'s
    train_gpt2.py, in `base`. strict: stop at the first violation (AssertionError); else count them."""
    report, references = Report(), References(base / "references", code)
    machine = type("Histories", (RunHistories,), {"base": base, "references": references, "code": code,
                                                 "strict": strict, "report": report})
    machine._hypothesis_internal_use_seed = seed  # (what hypothesis.seed does to a test)
    try:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=histories, stateful_step_count=steps, deadline=None, database=None,
            phases=[Phase.generate], suppress_health_check=list(HealthCheck), print_blob=False))
    finally:
        shutil.rmtree(references.directory, ignore_errors=True)  # (a snapshot a step)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description="The soak: random histories of real runs with faults, checked "
                                                 "against the state table (tests/state_machine.py).")
    parser.add_argument("--histories", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10, help="rules per history, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout whose train_gpt2.py runs")
    parser.add_argument("--dir", type=Path, default=None, help="where runs go (default: a temp directory)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="state_machine_", dir=args.dir))
    started = time.monotonic()
    try:
        report = run_histories(base, args.histories, args.steps, args.seed, strict=False, code=args.code.resolve())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n{report.summary()} ({time.monotonic() - started:.0f} s)")
    for violation in report.violations:
        print(f"\n{violation}")


if __name__ == "__main__":
    main()
