"""metrics.jsonl and wandb, from rank 0 (docs/training.md). A full disk or a failing wandb costs lines, with one
warning, never the training."""

import errno
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from rundir.lock import RunLock
from rundir.snapshot import FORMAT

# metrics.jsonl key -> wandb key, so the dashboard groups train/, val/ and eval/ panels. The zero-shot tasks'
# "<task>/<metric>" keys and eval_score go to eval/ too (wandb_key); hellaswag_acc is what runs logged before them.
WANDB_KEYS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "dt_ms": "train/dt_ms",
    "tokens_per_sec": "train/tokens_per_sec", "mfu": "train/mfu", "skipped": "train/skipped_step",
    "rollbacks": "train/rollbacks", "val_loss": "val/loss", "val_bpb": "val/bpb",
    "hellaswag_acc": "eval/hellaswag_acc", "eval_score": "eval/score",
}


def wandb_key(key: str) -> str | None:
    prefix = "" if key.startswith("val/") else "eval/"  # (a mixture's val/<source>/loss and /bpb go as they are)
    return WANDB_KEYS.get(key) or (prefix + key if "/" in key else None)
# wandb.init retries an unreachable server for init_timeout (90 s in wandb 0.31); a minute tells as well.
# WANDB_INIT_TIMEOUT overrides it (keep it under --dist_timeout: the other ranks wait for rank 0 meanwhile).
INIT_TIMEOUT_S = 60.0
# wandb.finish() would block until every byte is uploaded; past this, what is left stays on disk for `wandb sync`.
FINISH_TIMEOUT_S = 300.0


def metrics_path(log_dir: Path, run: str) -> Path:
    """metrics.jsonl, unless its first {"event": "timeline"} record is another run's or format's (a branch sharing its
    parent's --log_dir, another version's file): then metrics_<run>.jsonl, so that no two runs' steps are spliced."""
    default = log_dir / "metrics.jsonl"
    if not default.is_file():
        return default
    with open(default, "rb") as f:
        line = next((line for line in f if b'"timeline"' in line), b"{}")
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    ours = isinstance(record, dict) and record.get("format") == FORMAT and record.get("run") == run
    return default if ours else log_dir / f"metrics_{run}.jsonl"


def free_space(directory: Path) -> str:
    try:
        return f"{shutil.disk_usage(directory).free / 2**20:,.0f} MiB free"
    except OSError as e:  # the directory is gone, or its filesystem
        return f"its free space unknown: {e.strerror}"


class RunLogger:
    def __init__(self, log_dir: str | Path, run: str, enabled: bool = True, run_lock: RunLock | None = None):
        """run: the run's id (rundir.store); run_lock: its locked directories (--log_dir checked before each line)."""
        self.enabled, self.run_lock = enabled, run_lock or RunLock()
        self.wandb_run = None
        self.metrics_path = metrics_path(Path(log_dir), run)
        self.metrics_failed = False  # warned once about a failed write
        self.logging_raised: bool | None = None  # logging.raiseExceptions before wandb started
        if enabled:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)

    def start_wandb(self, project: str | None, mode: str, run_id: str, run_name: str | None, config: dict) -> None:
        """Start (or, with the same run_id, resume) the wandb run. Failures are reported, never fatal."""
        if not self.enabled or mode == "disabled":
            return
        # wandb's own logs (debug.log) go through `logging`, which on a full disk prints a traceback for every record
        # it cannot write, thousands a run: drop them (its failures still reach us as exceptions).
        self.logging_raised, logging.raiseExceptions = logging.raiseExceptions, False
        try:
            import wandb
            settings = wandb.Settings(init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_S)),
                                      finish_timeout=FINISH_TIMEOUT_S)
            self.wandb_run = wandb.init(project=project, name=run_name, id=run_id, resume="allow", mode=mode,
                                        config=config, dir=os.environ.get("WANDB_DIR", str(self.metrics_path.parent)),
                                        settings=settings)
            # Plot everything against our optimizer step, not wandb's count of log calls: the steps a resumed run
            # logs again then land where they belong.
            self.wandb_run.define_metric("step")
            for prefix in ("train", "val", "eval"):
                self.wandb_run.define_metric(f"{prefix}/*", step_metric="step")
        except Exception as e:  # wandb raises many kinds of errors: no login, no network, bad project name
            self.wandb_run = None
            print(f"WARNING: wandb could not start ({type(e).__name__}: {e}). Training goes on; its numbers go to "
                  f"{self.metrics_path} only. To fix: log in with `wandb login` (or set WANDB_API_KEY); without "
                  "network, use --wandb_mode offline and upload later with `wandb sync`; or turn wandb off with "
                  "--wandb_mode disabled.", file=sys.stderr)

    def log(self, record: dict) -> None:
        """Append one event to metrics.jsonl and mirror its numbers to wandb."""
        if not self.enabled:
            return
        self._append_line((json.dumps(record) + "\n").encode())
        if self.wandb_run is not None and "step" in record:
            data = {wandb_key(k): v for k, v in record.items() if wandb_key(k)}
            if data:
                self._wandb_call(lambda: self.wandb_run.log({"step": record["step"], **data}))

    def _append_line(self, line: bytes) -> None:
        """Append a whole line or nothing (a write cut short by a full disk is cut back off), on a line of its own
        after one a crash left unfinished. A failure is warned of once; every later line is tried again."""
        self.run_lock.check_in_place(self.metrics_path.parent)
        try:
            with open(self.metrics_path, "a+b", buffering=0) as f:
                start = f.tell()
                if start and os.pread(f.fileno(), 1, start - 1) != b"\n":
                    line = b"\n" + line
                try:
                    if f.write(line) != len(line):
                        raise OSError(errno.ENOSPC, "No space left on device (a short write)")
                except OSError:
                    f.truncate(start)
                    raise
        except OSError as e:
            if not self.metrics_failed:
                print(f"WARNING: could not write {self.metrics_path} ({type(e).__name__}: {e}; "
                      f"{free_space(self.metrics_path.parent)}). Training goes on; its numbers are on stdout (and "
                      "wandb, if on), and later lines are written once there is room. This warning is not repeated.",
                      file=sys.stderr)
                self.metrics_failed = True

    def log_samples(self, step: int, texts: list[str]) -> None:
        """Sampled text as a wandb table (stdout already has it)."""
        if self.wandb_run is None:
            return
        import wandb
        table = wandb.Table(columns=["step", "sample"], data=[[step, t] for t in texts])
        self._wandb_call(lambda: self.wandb_run.log({"step": step, "samples/text": table}))

    def _wandb_call(self, call) -> None:
        try:
            call()
        except Exception as e:
            print(f"WARNING: wandb stopped working ({type(e).__name__}: {e}). Training goes on; its numbers go to "
                  f"{self.metrics_path} only, wandb is off for the rest of this run.", file=sys.stderr)
            self.wandb_run = None

    def finish(self) -> None:
        if self.wandb_run is not None:
            self._wandb_call(self.wandb_run.finish)
        if self.logging_raised is not None:
            logging.raiseExceptions = self.logging_raised
