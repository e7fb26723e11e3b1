"""Reading metrics.jsonl, the run's log that run_logger.RunLogger writes: what tools/plot.py draws and the dev/
sweeps read their curves from.

One JSON object per line: training steps ("loss", "lr", ...), validation ("val_loss", "val_bpb"), the zero-shot
tasks ("hellaswag/acc_norm", ..., "eval_score"; older runs: "hellaswag_acc"), and events such as {"event": "resume",
...}, which are skipped, as are null losses (a step whose update was skipped for a NaN). After a crash and resume,
the steps between the last snapshot and the crash are trained and logged a second time; the LATER line for a step
wins, because it belongs to the run that continued. A line that is not such an object (a run killed mid-write leaves
half a line; a step that is not a whole number, a metric that is not a number) is skipped, and said why.
"""

import json
from pathlib import Path

from training.parsing import PARSE_ERRORS, parse_problem

METRICS = ("loss", "val_loss", "val_bpb", "hellaswag/acc_norm", "hellaswag_acc", "eval_score", "lr")


def read_metrics(path: str | Path) -> tuple[dict[str, dict[int, float]], list[str]]:
    """{metric: {step: value}} for each metric in METRICS (a later line for the same step replaces an earlier one),
    and why each line that is not a metrics line or an event was skipped ("line 7: not valid JSON (...)")."""
    series: dict[str, dict[int, float]] = {name: {} for name in METRICS}
    skipped = []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is one broken line, not an unreadable file
        for lineno, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except PARSE_ERRORS as e:
                skipped.append(f"line {lineno}: {parse_problem(e)}")
                continue
            if isinstance(record, dict) and "event" in record:
                continue
            problem = record_problem(record)
            if problem:
                skipped.append(f"line {lineno}: {problem}")
                continue
            for name in METRICS:
                if record.get(name) is not None:  # a skipped step's NaN loss is written as null: nothing to plot
                    series[name][record["step"]] = record[name]
    return series, skipped


def record_problem(record) -> str | None:
    """Why a JSON value is not a metrics line as train_gpt2.py writes it, or None if it is one."""
    if not isinstance(record, dict) or "step" not in record:
        return "not a JSON object with a 'step' (or an 'event')"
    if not isinstance(record["step"], int) or isinstance(record["step"], bool) or record["step"] < 0:
        return f"step {record['step']!r} is not a whole number"
    bad = next((name for name in METRICS if record.get(name) is not None and not is_number(record[name])), None)
    return f"{bad} {record[bad]!r} is not a number" if bad else None


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
