"""run_logger.py: metrics.jsonl and its wandb mirror. The wandb run holds the same numbers at the same steps (read
back from an offline run's .wandb log with wandb's own reader), a resumed training run continues the same wandb run,
and a wandb failure, at start or mid-run, is reported once while training and metrics.jsonl go on.

wandb never touches the network here: offline mode, no API key, no error reporting.
"""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import train_gpt2
from conftest import make_shards
from helpers_train import TINY_ARGS, TrainRun, read_metrics, run_train
from rundir.snapshot import load_snapshot, snapshot_path
from training.distributed import Distributed
from training.run_logger import INIT_TIMEOUT_S, RunLogger, wandb_key

OFFLINE_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false"}
# 1 rank, one 32-token micro-batch per step: a few seconds per run, most of it starting Python.
JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "32", "--warmup_steps", "1",
       "--val_every", "2", "--val_tokens", "32", "--dtype", "fp32",
       "--wandb_project", "test", "--wandb_mode", "offline"]


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch, tmp_path):
    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def wandb_run_dirs(wandb_dir: Path) -> list[Path]:
    """The offline run directories under wandb_dir/wandb, oldest first (their names start with a timestamp)."""
    return sorted((wandb_dir / "wandb").glob("offline-run-*"))


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of a run's .wandb transaction log, decoded by wandb's own reader (`wandb leet inspect`)."""
    result = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def wandb_history(records: list[dict], key: str) -> dict[int, object]:
    """{step: value} of a wandb key, our step being the x-axis; a step logged twice keeps its later value."""
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    return {row["step"]: row[key] for row in rows if key in row}


def jsonl_history(records: list[dict], key: str) -> dict[int, object]:
    return {r["step"]: r[key] for r in records if key in r}


def wandb_config(records: list[dict]) -> dict:
    """The run's config: set by wandb.init (the run record), then updated by any config records."""
    config = {}
    for r in records:
        if r["type"] == "run":
            config |= r["run"]["config"]["update"]
        elif r["type"] == "config":
            config |= r["config"].get("update", {})
    config.pop("_wandb", None)  # wandb's own bookkeeping
    return config


def assert_wandb_mirrors(records: list[dict], metrics: list[dict]) -> None:
    """Each metrics.jsonl number is in the wandb history under its wandb key, at the same step, exactly."""
    keys = {k for r in metrics for k in r if wandb_key(k)}
    assert {"loss", "val_loss"} <= keys
    for key in keys:
        assert wandb_history(records, wandb_key(key)) == jsonl_history(metrics, key), key


# ----------------------------------------------------------------------------------------------------------------
# RunLogger on its own

@pytest.mark.slow  # over 3 s on two busy cores: keeps `-m 'not slow'` within a minute
def test_offline_wandb_run_holds_every_logged_number_at_its_step(tmp_path):
    logger = RunLogger(tmp_path / "logs", "run")
    config = {"model": "tiny", "max_steps": 5, "max_lr": 6e-4, "wandb_run_name": None}
    logger.start_wandb("test", "offline", "logger0test", "a-name", config)
    assert logger.wandb_run is not None
    logger.log({"event": "resume", "step": 0, "snapshot": "x.pt"})  # not a number: metrics.jsonl only
    for step in range(5):
        if step % 2 == 0:
            logger.log({"step": step, "val_loss": 10.5 - step / 7})
        logger.log({"step": step, "loss": 11.0 - step / 3, "lr": 6e-4 * (step + 1) / 5, "grad_norm": 2.0 + step / 9,
                    "dt_ms": 100.0 + step, "tokens_per_sec": 1e4 / (step + 1), "mfu": 0.3 + step / 100}
                   | ({"skipped": True} if step == 3 else {}))
    logger.log({"step": 4, "hellaswag_acc": 0.25})  # what runs logged before the zero-shot tasks
    logger.log({"step": 4, "hellaswag/acc": 0.3, "hellaswag/acc_norm": 0.35, "eval_score": 0.1})
    logger.log_samples(4, ["Hello, I'm a language model, and", "Hello, I'm a language model, or"])
    logger.finish()

    (run_dir,) = wandb_run_dirs(tmp_path)
    records = wandb_records(run_dir)
    metrics = read_metrics(tmp_path / "logs")
    assert len(metrics) == 11
    assert_wandb_mirrors(records, metrics)
    # (The reader flattens a table into samples/text.path, samples/text.nrows, ...; wandb's own keys start with _.)
    logged = {k.split(".")[0] for r in records if r["type"] == "history" for k in r["history"]["item"]
              if not k.startswith("_")}
    assert logged == {"step", "train/loss", "train/lr", "train/grad_norm", "train/dt_ms", "train/tokens_per_sec",
                      "train/mfu", "train/skipped_step", "val/loss", "eval/hellaswag_acc", "eval/hellaswag/acc",
                      "eval/hellaswag/acc_norm", "eval/score", "samples/text"}
    assert wandb_history(records, "eval/hellaswag_acc") == {4: 0.25}
    assert wandb_history(records, "eval/hellaswag/acc_norm") == {4: 0.35}
    assert wandb_history(records, "train/skipped_step") == {3: True}
    assert wandb_history(records, "train/loss") == {s: 11.0 - s / 3 for s in range(5)}

    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run["run_id"], run["project"], run["display_name"]) == ("logger0test", "test", "a-name")
    assert wandb_config(records) == config
    # The dashboard plots train/, val/ and eval/ against our step, not wandb's count of log calls.
    axes = {r["metric"]["glob_name"]: r["metric"].get("step_metric") for r in records
            if r["type"] == "metric" and "glob_name" in r["metric"]}
    assert axes == {"train/*": "step", "val/*": "step", "eval/*": "step"}

    (table_path,) = wandb_history(records, "samples/text.path").values()
    table = json.loads((run_dir / "files" / table_path).read_text())
    assert table["columns"] == ["step", "sample"]
    assert table["data"] == [[4, "Hello, I'm a language model, and"], [4, "Hello, I'm a language model, or"]]


def test_a_line_left_half_written_by_a_crash_is_not_continued(tmp_path):
    """A crash mid-write (or a full disk whose cut-back failed) leaves a last line without its newline: the next
    record starts on a line of its own, so that every other line still reads as JSON."""
    whole = json.dumps({"event": "timeline", "format": 1, "run": "run"}) + "\n" + json.dumps({"step": 4, "loss": 9.5})
    (tmp_path / "metrics.jsonl").write_text(whole + '\n{"step": 5, "lo')
    logger = RunLogger(tmp_path, "run")
    logger.log({"event": "resume", "step": 5, "snapshot": "x.pt"})
    logger.log({"step": 5, "loss": 9.25})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    resume, step = json.dumps({"event": "resume", "step": 5, "snapshot": "x.pt"}), json.dumps({"step": 5, "loss": 9.25})
    assert lines == [*whole.splitlines(), '{"step": 5, "lo', resume, step]


def test_only_rank_0_logs(tmp_path, monkeypatch):
    monkeypatch.setattr("wandb.init", lambda **kwargs: pytest.fail("a rank other than 0 started wandb"))
    logger = RunLogger(tmp_path / "logs", "run", enabled=False)
    logger.start_wandb("test", "offline", "rank1", None, {})
    logger.log({"step": 0, "loss": 1.0})
    logger.log_samples(0, ["text"])
    logger.finish()
    assert not (tmp_path / "logs").exists()


def test_wandb_init_gives_up_after_a_minute_unless_told_otherwise(tmp_path, monkeypatch):
    """Online without network, wandb.init retries until its timeout (90 s by default in wandb 0.31), then raises;
    we bound it to a minute, and WANDB_INIT_TIMEOUT still wins."""
    import wandb  # (here, not at the top: 3 s of every pytest worker's collection)

    timeouts = []

    def init(settings: wandb.Settings, **kwargs):
        timeouts.append(settings.init_timeout)
        raise wandb.errors.CommError("Run initialization has timed out")

    monkeypatch.setattr(wandb, "init", init)
    RunLogger(tmp_path, "run").start_wandb("test", "online", "timeout0", None, {})
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "600")
    RunLogger(tmp_path, "run").start_wandb("test", "online", "timeout1", None, {})
    assert timeouts == [INIT_TIMEOUT_S, 600.0] and INIT_TIMEOUT_S == 60


class BrokenRun:
    """A wandb run whose log() fails from the n-th call on, as when its service process dies mid-run."""

    def __init__(self, fail_from_call: int):
        self.fail_from_call, self.calls = fail_from_call, 0

    def define_metric(self, *args, **kwargs) -> None:
        pass

    def log(self, data: dict) -> None:
        self.calls += 1
        if self.calls >= self.fail_from_call:
            raise ConnectionResetError("the wandb service went away")

    def finish(self) -> None:
        raise RuntimeError("finish() called on a run that already failed")


def wandb_init_failing(monkeypatch, failure: str) -> None:
    import wandb

    def init(**kwargs):
        if failure == "init":
            raise wandb.errors.CommError("Failed to get resume status: no such host")
        return BrokenRun(fail_from_call=3)
    monkeypatch.setattr(wandb, "init", init)


@pytest.mark.parametrize("failure", ["init", "mid-run"])
def test_a_wandb_failure_is_reported_once_and_training_logs_on(failure, tmp_path, monkeypatch, capsys):
    make_shards(tmp_path / "data", "train", [200], seed=0, vocab=256, tokenizer="bytes")  # (a 257-wide model)
    make_shards(tmp_path / "data", "val", [100], seed=1, vocab=256, tokenizer="bytes")
    wandb_init_failing(monkeypatch, failure)
    cfg = train_gpt2.parse_args([*TINY_ARGS, *JOB, "--max_steps", "4", "--data_dir", str(tmp_path / "data"),
                                 "--log_dir", str(tmp_path / "logs"), "--snapshot_every", "0"])
    train_gpt2.run(cfg, Distributed(0, 0, 1, torch.device("cpu")))

    metrics = read_metrics(tmp_path / "logs")
    assert [r["step"] for r in metrics if "loss" in r] == [0, 1, 2, 3]
    assert [r["step"] for r in metrics if "val_loss" in r] == [0, 2, 3]
    err = capsys.readouterr().err
    assert err.count("WARNING: wandb") == 1  # said once, and wandb left alone after that
    if failure == "init":
        assert "WARNING: wandb could not start (CommError: Failed to get resume status: no such host)" in err
        assert "`wandb login`" in err and "--wandb_mode offline" in err and "--wandb_mode disabled" in err
    else:
        assert "WARNING: wandb stopped working (ConnectionResetError: the wandb service went away)" in err
    assert str(tmp_path / "logs" / "metrics.jsonl") in err


# ----------------------------------------------------------------------------------------------------------------
# train_gpt2.py end to end: an offline run, then its resume

@dataclass
class Runs:
    wandb_dir: Path
    log_dir: Path
    first: TrainRun  # steps 0-2, snapshot at step 2
    resumed: TrainRun  # the same log dir with --max_steps 5: steps 3-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("wandb_runs")
    make_shards(root / "data", "train", [300], seed=0, vocab=256, tokenizer="bytes")  # (a 257-wide model)
    make_shards(root / "data", "val", [100], seed=1, vocab=256, tokenizer="bytes")
    args = [*JOB, "--data_dir", str(root / "data"), "--snapshot_every", "2", "--keep_last", "5"]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_API_KEY", raising=False)
        env = OFFLINE_ENV | {"WANDB_DIR": str(root)}
        first = run_train([*args, "--max_steps", "3"], root / "logs", env=env, timeout=120)
        resumed = run_train([*args, "--max_steps", "5"], root / "logs", env=env, timeout=120)
    return Runs(root, root / "logs", first, resumed)


@pytest.mark.slow
def test_offline_training_run_mirrors_metrics_jsonl_with_its_config(runs):
    first_dir = wandb_run_dirs(runs.wandb_dir)[0]
    records = wandb_records(first_dir)
    assert_wandb_mirrors(records, runs.first.records)
    assert sorted(wandb_history(records, "train/loss")) == [0, 1, 2]
    assert sorted(wandb_history(records, "val/loss")) == [0, 2]
    assert load_snapshot(snapshot_path(runs.log_dir, 2))["config"].items() <= wandb_config(records).items()


@pytest.mark.slow
def test_resumed_training_run_continues_the_same_wandb_run(runs):
    first_dir, resumed_dir = wandb_run_dirs(runs.wandb_dir)
    resume_line = [i for i, r in enumerate(runs.resumed.records) if r.get("event") == "resume"]
    assert len(resume_line) == 1 and runs.resumed.records[resume_line[0]]["step"] == 3
    snapshot = load_snapshot(runs.resumed.records[resume_line[0]]["snapshot"])
    run_ids = [[r["run"]["run_id"] for r in wandb_records(d) if r["type"] == "run"] for d in (first_dir, resumed_dir)]
    assert run_ids == [[snapshot["wandb_id"]], [snapshot["wandb_id"]]]
    assert first_dir.name.endswith(snapshot["wandb_id"]) and resumed_dir.name.endswith(snapshot["wandb_id"])

    records = wandb_records(resumed_dir)
    after_resume = runs.resumed.records[resume_line[0] + 1:]
    assert_wandb_mirrors(records, after_resume)
    assert sorted(wandb_history(records, "train/loss")) == [3, 4]
