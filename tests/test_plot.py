import json
import math

import pytest

from tools.plot import main, run_label
from training.metrics_log import read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def training_line(step: int, loss: float) -> dict:
    lr = 6e-4 * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / 200))
    return {"step": step, "loss": loss, "lr": lr, "grad_norm": 1.0, "dt_ms": 100.0, "tokens_per_sec": 5e6, "mfu": 0.4}


def write_crashed_and_resumed_run(path) -> None:
    """200 steps; the run crashed after step 129, resumed from the snapshot at step 100 and logged 100..129 again.
    The first attempt's losses are 1.0 higher, so the test can tell which line won."""
    lines = []
    for attempt, steps, offset in ((0, range(0, 130), 1.0), (1, range(100, 200), 0.0)):
        if attempt == 1:
            lines.append({"event": "resume", "step": 100, "snapshot": "logs/run/snapshot_000100.pt"})
        for step in steps:
            lines.append(training_line(step, 3.0 + 8.0 * math.exp(-step / 30) + offset))
            if step % 25 == 0:
                lines.append({"step": step, "val_loss": 3.1 + 8.0 * math.exp(-step / 30), "val_bpb": 1.1 + step / 1e3})
            if step % 50 == 0:
                lines.append({"step": step, "hellaswag_acc": 0.25 + 0.0002 * step})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_later_line_for_a_step_wins_after_a_resume(tmp_path):
    path = tmp_path / "run_a" / "metrics.jsonl"
    write_crashed_and_resumed_run(path)
    series, skipped = read_metrics(path)
    assert not skipped
    assert sorted(series["loss"]) == list(range(200))  # each step once, although 100..129 were logged twice
    assert series["loss"][110] == pytest.approx(3.0 + 8.0 * math.exp(-110 / 30))  # the resumed run's value
    assert series["loss"][99] == pytest.approx(4.0 + 8.0 * math.exp(-99 / 30))  # before the snapshot: one line
    assert sorted(series["val_loss"]) == sorted(series["val_bpb"]) == [0, 25, 50, 75, 100, 125, 150, 175]
    assert series["hellaswag_acc"][150] == pytest.approx(0.28)


def test_writes_a_png_with_one_line_per_run(tmp_path, capsys):
    write_crashed_and_resumed_run(tmp_path / "run_a" / "metrics.jsonl")
    write_crashed_and_resumed_run(tmp_path / "run_b.jsonl")
    out = tmp_path / "runs.png"
    main([str(tmp_path / "run_a" / "metrics.jsonl"), str(tmp_path / "run_b.jsonl"), "--out", str(out)])
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000
    printed = capsys.readouterr().out
    assert "run_a: 200 train steps, min val loss 3.1234" in printed  # val loss at step 175
    assert "run_b: 200 train steps" in printed


def test_label_is_the_folder_for_metrics_jsonl_and_the_stem_otherwise(tmp_path):
    assert run_label(tmp_path / "d12_run" / "metrics.jsonl") == "d12_run"
    assert run_label(tmp_path / "baseline.jsonl") == "baseline"


def test_broken_lines_are_skipped_and_counted_once_and_the_rest_is_plotted(tmp_path, capsys):
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    broken = [b'{"step": "2", "loss": 9.0}', b'{"step": [3], "loss": 9.0}', b'{"step": 4, "loss": "9.0"}',
              b'{"step": 5, "loss": [9.0]}', b'{"step": true, "loss": 9.0}', b'{"step": 6, "lr": 1e-3, "loss": 9.0',
              b'{"step": 7, "loss": 9.0, "note": "caf\xe9"}', b"[" * 100_000 + b"]" * 100_000,
              b'{"step": 8, "loss": ' + b"9" * 5001 + b"}"]
    good = [json.dumps(training_line(step, 11.0 - step)).encode() for step in (0, 1, 9)]
    # A crash mid-write leaves half of the last line, without its newline.
    path.write_bytes(b"\n".join(good[:2] + broken[:-3] + [good[2]] + broken[-3:] + [b'{"step": 10, "lo']))
    series, skipped = read_metrics(path)
    assert series["loss"] == {0: 11.0, 1: 10.0, 9: 2.0}
    assert skipped == ["line 3: step '2' is not a whole number", "line 4: step [3] is not a whole number",
                       "line 5: loss '9.0' is not a number", "line 6: loss [9.0] is not a number",
                       "line 7: step True is not a whole number",
                       "line 8: not valid JSON (column 36: Expecting ',' delimiter)",
                       "line 10: not UTF-8 text (byte 0xe9 at offset 37)", "line 11: nested too deeply to be read",
                       "line 12: not readable (Exceeds the limit (4300 digits) for integer string conversion: value "
                       "has 5001 digits)", "line 13: not valid JSON (column 14: Unterminated string starting at)"]
    main([str(path), "--out", str(tmp_path / "plot.png")])
    assert (tmp_path / "plot.png").read_bytes().startswith(PNG_MAGIC)
    captured = capsys.readouterr()
    assert "run: 3 train steps" in captured.out
    assert captured.err == (f"{path}: skipped 10 broken line(s), the first line 3: step '2' is not a whole number "
                            "(a run killed mid-write leaves half a line)\n")


@pytest.mark.parametrize("text", ['{"step": 0, "loss": 11.0\n', '{"event": "init", "step": 0}\n', ""])
def test_a_file_with_no_metrics_left_exits_2_naming_it(tmp_path, capsys, text):
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), "--out", str(tmp_path / "x.png")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {path} holds no metrics to plot" in err and "Pass the metrics.jsonl" in err
    assert ("1 broken line(s), the first line 1: not valid JSON" in err) == text.startswith('{"step"')
    assert not (tmp_path / "x.png").exists()


def test_an_out_path_in_a_missing_directory_exits_2(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    write_crashed_and_resumed_run(path)
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), "--out", str(tmp_path / "nowhere" / "x.png")])
    assert exit_info.value.code == 2
    assert f"--out {tmp_path / 'nowhere' / 'x.png'}: no directory" in capsys.readouterr().err


def test_a_skipped_steps_null_loss_is_left_out(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [training_line(0, 5.0), training_line(1, 4.0) | {"loss": None, "skipped": True}, training_line(2, 3.0)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert read_metrics(path) == ({"loss": {0: 5.0, 2: 3.0}, "lr": {0: lines[0]["lr"], 1: lines[1]["lr"],
                                                                2: lines[2]["lr"]}} | dict.fromkeys(
        ["val_loss", "val_bpb", "hellaswag/acc_norm", "hellaswag_acc", "eval_score"], {}), [])
    main([str(path), "--out", str(tmp_path / "plot.png")])
    assert (tmp_path / "plot.png").read_bytes().startswith(PNG_MAGIC)


def test_zero_shot_keys_and_the_completion_style_hellaswag_of_older_runs_are_both_read(tmp_path, capsys):
    new = tmp_path / "new" / "metrics.jsonl"
    new.parent.mkdir()
    new.write_text("".join(json.dumps(line) + "\n" for line in [
        training_line(0, 11.0), {"step": 0, "hellaswag/acc": 0.24, "hellaswag/acc_norm": 0.26, "piqa/acc": 0.5,
                                 "eval_score": 0.01},
        training_line(1, 10.0), {"step": 1, "hellaswag/acc": 0.25, "hellaswag/acc_norm": 0.31, "piqa/acc": 0.6,
                                 "eval_score": 0.12}]))
    old = tmp_path / "old" / "metrics.jsonl"
    write_crashed_and_resumed_run(old)
    series = read_metrics(new)[0]
    assert series["hellaswag/acc_norm"] == {0: 0.26, 1: 0.31} and series["eval_score"] == {0: 0.01, 1: 0.12}
    assert not series["hellaswag_acc"] and not read_metrics(old)[0]["hellaswag/acc_norm"]
    main([str(new), str(old), "--out", str(tmp_path / "both.png")])
    printed = capsys.readouterr().out
    assert "new: 2 train steps, max HellaSwag acc_norm 0.3100, max eval_score 0.1200" in printed
    assert "max HellaSwag (completion style) 0.2800" in printed  # the old run: hellaswag_acc at step 150
