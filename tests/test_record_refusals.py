"""The refusals of the run directory's records (run.json, a snapshot's .json) and of a snapshot's state, word for
word: a user reads them to learn which file is wrong and why (the mutation survivors of dev/notes/mutation_testing.md
changed only these words)."""

import errno
import json
import os

import pytest

from conftest import failing
from rundir import snapshot
from rundir.snapshot import check_state, snapshot_path
from rundir.store import RUN_FIELDS, read_record, survey


def test_a_record_that_is_not_json_names_the_file_and_the_parser_error(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("{")
    with pytest.raises(ValueError) as refused:
        read_record(path, RUN_FIELDS)
    assert str(refused.value) == (f"{path} could not be read (JSONDecodeError: Expecting property name enclosed in "
                                  "double quotes: line 1 column 2 (char 1)).")


def test_a_record_with_other_fields_names_the_fields_it_should_have(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"format": 1, "run": "abc"}))
    with pytest.raises(ValueError) as refused:
        read_record(path, RUN_FIELDS)
    assert str(refused.value) == f"{path} is not a record as train_gpt2.py writes it (run, init_from, resumed_from)."


def test_a_snapshot_of_another_format_is_refused_saying_what_to_do(tmp_path):
    with pytest.raises(ValueError) as refused:
        check_state(tmp_path / "snapshot_0000001.pt", {"format": 7}, ["format"])
    assert str(refused.value) == (f"{tmp_path / 'snapshot_0000001.pt'} is a snapshot of format 7, written by another "
                                  "version of train_gpt2.py; this one reads format 1. Read it with the version that "
                                  "wrote it, or start a new run (--resume never).")


def test_a_snapshot_whose_values_have_other_types_lists_each_and_what_a_snapshot_holds(tmp_path):
    with pytest.raises(ValueError) as refused:
        check_state(tmp_path / "s.pt", {"format": 1, "step": "3", "healthy": 1}, ["format"])
    assert str(refused.value) == (
        f"{tmp_path / 's.pt'} is not a snapshot this code wrote: step is a str, healthy is a int, where a snapshot's "
        "format is a int, model is a dict, model_config is a dict, optimizer is a dict, scaler is a dict, step is a "
        "int, loader is a dict, rng is a list, config is a dict, wandb_id is a str, healthy is a bool, tokenizer is a "
        "dict.")


def test_a_snapshot_that_cannot_be_read_is_named_by_its_path(tmp_path, monkeypatch):
    path = snapshot_path(tmp_path, 3)
    path.write_bytes(b"")
    monkeypatch.setattr(snapshot, "load_snapshot", failing(errno.EIO))  # (a failing disk: an OSError naming no file)
    [entry] = survey(tmp_path)
    assert entry.problem == f"{path} (OSError: [Errno {errno.EIO}] {os.strerror(errno.EIO)})"
