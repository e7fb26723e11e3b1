"""config.py: flags and recipes resolve into one checked plan; --help shows every default, grouped."""

import ast
import os
from dataclasses import fields
from pathlib import Path

import pytest

from conftest import ROOT, make_shards
from model import PRESETS
from training.config import (
    FLAG_RANGES,
    PATH_FLAGS,
    TrainConfig,
    check_flag_ranges,
    check_path_flags,
    parse_args,
    set_type,
)
from training.errors import UserError
from training.inputs import resolve_plan

RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


def test_flags_override_the_recipe_which_overrides_the_defaults():
    cfg = parse_args(["--config", str(ROOT / "recipes" / "shakespeare_small.toml"), "--max_steps", "5"])
    assert cfg.model == "small" and cfg.total_batch_size == 4096  # from the recipe
    assert cfg.max_steps == 5  # the flag wins
    assert cfg.weight_decay == TrainConfig.weight_decay  # not in the recipe: the default


@pytest.mark.parametrize("old", ["ckpt_dir", "ckpt_every", "hellaswag_every", "hellaswag_limit", "hellaswag_path",
                                 "val_steps"])
def test_a_flag_has_one_name_and_the_old_names_are_refused(tmp_path, capsys, old):
    with pytest.raises(SystemExit) as exit_info:  # argparse: "unrecognized arguments", exit status 2
        parse_args([f"--{old}", "1"])
    assert exit_info.value.code == 2 and f"--{old}" in capsys.readouterr().err
    (tmp_path / "old.toml").write_text(f"{old} = 1\n")
    with pytest.raises(UserError, match=f"unknown setting '{old}'"):
        parse_args(["--config", str(tmp_path / "old.toml")])


def test_config_reads_no_file_but_a_recipe():
    """config.py imports nothing of the data loader, the evaluations, Hugging Face or the snapshots: the checks that
    read them are training/inputs.py's."""
    tree = ast.parse((ROOT / "training" / "config.py").read_text())
    imported = {node.module if isinstance(node, ast.ImportFrom) else alias.name for node in ast.walk(tree)
                if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names}
    assert imported == {"argparse", "math", "re", "typing", "dataclasses", "tomllib", "model",
                        "training.recompute", "training.errors", "training.parsing"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(recipe):
    cfg = parse_args(["--config", str(recipe)])
    assert cfg.data_dir  # and load_recipe checked every key's name, type and choices


def test_the_gpt2_recipe_spells_out_the_defaults():
    recipe = parse_args(["--config", str(ROOT / "recipes" / "gpt2_124m_fineweb_edu.toml")])
    defaults = parse_args([])
    assert [f.name for f in fields(TrainConfig) if getattr(recipe, f.name) != getattr(defaults, f.name)] == ["model",
                                                                                                         "seq_len"]
    assert (recipe.model, recipe.seq_len) == ("gpt2", PRESETS["gpt2"].block_size)  # the defaults' implied values


@pytest.mark.parametrize("text, message", [
    ("max_step = 5\n", "unknown setting 'max_step'"),
    ("max_steps = \"5\"\n", "max_steps = '5' is not a valid value for --max_steps"),
    ("dtype = \"fp8\"\n", "one of auto, bf16, fp16, fp32"),
    ("compile = 1\n", "compile = 1 is not a valid value"),
    ("wandb_mode = \"onlin\"\n", r"wandb_mode = 'onlin' is not a valid value for --wandb_mode \(one of online, "
     r"offline, disabled\)"),
    ("max_steps = \n", r"is not valid TOML \(Invalid value \(at line 1, column 13\)\)"),
    (b'data_dir = "caf\xe9"\n', r"is not UTF-8 text \(byte 0xe9 at offset 15\)"),
    ("x = " + "[" * 100_000 + "]" * 100_000 + "\n", "is nested too deeply to be read"),  # tomllib's RecursionError
    ("max_steps = " + "9" * 5001 + "\n", r"is not readable \(Exceeds the limit \(4300 digits\) for integer string "
     r"conversion: value has 5001 digits\)\. Each line is `flag = value`"),
])
def test_a_bad_recipe_is_a_clear_error_naming_the_file(tmp_path, text, message):
    path = tmp_path / "recipe.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError, match=message) as error:
        parse_args(["--config", str(path)])
    assert str(path) in str(error.value)


def test_a_config_that_is_a_directory_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match=rf"--config {tmp_path} could not be read \(Is a directory\)\. Pass a recipe "
                                        "file such as recipes/gpt2_124m_fineweb_edu.toml"):
        parse_args(["--config", str(tmp_path)])


def test_every_number_flag_has_a_range_and_every_default_is_in_it():
    numbers = {f.name for f in fields(TrainConfig) if set_type(f.type) in (int, float, int | str)}
    assert numbers == set(FLAG_RANGES)
    check_flag_ranges(TrainConfig())


@pytest.mark.parametrize("flags, message", [
    # issue 50's: tracebacks, or a run that did nothing and exited 0 ("None is from step -1 ... already finished")
    (["--total_batch_size", "0"], r'--total_batch_size 0: pass a number at least 1 \(--help: "tokens per optimizer '
     r'step \(GPT-2 used ~0\.5M\)"\)\.$'),
    (["--n_head", "-2"], "--n_head -2: pass a number at least 1"),
    (["--n_embd", "-64"], "--n_embd -64: pass a number at least 1"),
    (["--block_size", "-16"], "--block_size -16: pass a number at least 1"),
    (["--val_tokens", "-1"], "--val_tokens -1: pass a number at least 1"),
    (["--max_steps", "-3"], "--max_steps -3: pass a number at least 1"),
    # zero where it means nothing: it was taken as "not set" (the preset's value, --val_tokens), or trained nothing
    (["--n_layer", "0"], "--n_layer 0: pass a number at least 1"),
    (["--seq_len", "0"], "--seq_len 0: pass a number at least 1"),
    (["--val_tokens", "0"], "--val_tokens 0: pass a number at least 1"),
    (["--max_lr", "0"], r"--max_lr 0\.0: pass a number above 0"),
    # what went on meaning something else: validating at every step, clipping nothing, a negative learning rate
    (["--val_every", "-1"], "--val_every -1: pass a number at least 0"),
    (["--grad_clip", "nan"], "--grad_clip nan: pass a finite number at least 0"),
    (["--min_lr_ratio", "-0.5"], r"--min_lr_ratio -0\.5: pass a number at least 0 and at most 1"),
    (["--max_lr", "inf"], "--max_lr inf: pass a finite number above 0"),
    (["--seed", "-1"], "--seed -1: pass a number at least 0 and below 18446744073709551616"),
    (["--dist_timeout", "0"], "--dist_timeout 0: pass a number at least 1"),
    (["--muon_momentum", "1.5"], r"--muon_momentum 1\.5: pass a number at least 0 and below 1"),
    (["--warmdown_frac", "0"], r"--warmdown_frac 0\.0: pass a number above 0 and at most 1"),
    (["--micro_batch_size", "0"], "--micro_batch_size 0: pass a number at least 1"),
])
def test_a_number_flag_outside_its_range_names_it_and_quotes_its_help(tmp_path, flags, message):
    base = ["--model", "tiny", "--micro_batch_size", "2", "--total_batch_size", "128", "--data_dir", str(tmp_path)]
    with pytest.raises(UserError, match=message):
        resolve_plan(parse_args([*base, *flags]), world_size=1)


def test_a_recipes_number_outside_its_range_is_refused_too(tmp_path):
    (tmp_path / "recipe.toml").write_text("max_lr = nan\n")  # valid TOML: the type check lets it through
    with pytest.raises(UserError, match=r'--max_lr nan: pass a finite number above 0 \(--help: "peak learning rate"'):
        resolve_plan(parse_args(["--config", str(tmp_path / "recipe.toml"), "--model", "tiny"]), world_size=1)


def test_help_groups_the_flags_and_shows_their_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one line per flag
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    headings = [line.rstrip(":") for line in text.splitlines() if line and not line.startswith(" ")
                and line.endswith(":")]
    assert headings[-7:] == ["data", "model", "batch", "optimization", "speed and precision",
                             "evaluation and logging", "fault tolerance"]
    assert "(default: 524288)" in text and "(default: data/fineweb_edu10B)" in text


def test_the_plan_resolves_shape_lengths_and_steps(tmp_path):
    make_shards(tmp_path, "val", [10 * 2 * 32 + 1])
    cfg = parse_args(["--model", "tiny", "--seq_len", "32", "--micro_batch_size", "2", "--total_batch_size", "256",
                      "--data_dir", str(tmp_path), "--val_tokens", "100000", "--log_dir", str(tmp_path / "logs")])
    plan = resolve_plan(cfg, world_size=2)
    assert plan.model_config == PRESETS["tiny"] and plan.seq_len == 32
    assert plan.grad_accum_steps == 2  # 256 tokens = 2 × 32 × 2 ranks × 2
    assert plan.val_steps == 5  # all that one pass over the val shard holds: 640 tokens / (2 × 32 × 2 ranks)
    assert Path(plan.snapshot_dir) == tmp_path / "logs"


@pytest.mark.parametrize("flag", PATH_FLAGS)
def test_an_empty_path_is_refused_naming_its_flag(flag):
    """An unset variable in a job script (--log_dir "$LOG_DIR") would train into the current directory."""
    with pytest.raises(UserError, match=rf"^--{flag} is empty \(an unset variable in a job script\?\)\. Pass a path"):
        check_path_flags(parse_args([f"--{flag}", ""]))


@pytest.mark.parametrize("flag", PATH_FLAGS)
def test_a_path_whose_name_is_not_utf8_is_refused_naming_its_flag_and_byte(flag):
    name = os.fsdecode(b"logs_caf\xe9")  # a Latin-1 name: the bytes as the command line hands them over
    with pytest.raises(UserError, match=rf"^--{flag} 'logs_caf\\udce9': the name is not valid UTF-8 \(byte 0xe9\)"):
        check_path_flags(parse_args([f"--{flag}", name]))
    check_path_flags(parse_args([f"--{flag}", "logs_café"]))  # UTF-8 beyond ASCII is fine


def test_an_empty_config_is_refused_rather_than_read_as_no_recipe():
    with pytest.raises(UserError, match="^--config is empty"):
        parse_args(["--config", ""])


def test_an_unknown_eval_task_stops_the_plan_unless_the_evaluations_are_off(tmp_path):
    flags = ["--model", "tiny", "--micro_batch_size", "2", "--total_batch_size", "128", "--val_every", "0",
             "--eval_tasks", "hellaswag,piqa,winogrand"]
    with pytest.raises(UserError, match=r"--eval_tasks 'hellaswag,piqa,winogrand': unknown task winogrand\. Pass"):
        resolve_plan(parse_args(flags), world_size=1)
    assert resolve_plan(parse_args([*flags, "--eval_every", "0"]), world_size=1).seq_len == 64
