"""config.py: flags and recipes resolve into one checked plan; --help shows every default, grouped."""

from dataclasses import fields
from pathlib import Path

import pytest

from conftest import ROOT, make_shards
from model import PRESETS
from training.config import FLAG_RANGES, TrainConfig, check_flag_ranges, parse_args, resolve_plan, set_type
from training.errors import UserError

RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


def test_flags_override_the_recipe_which_overrides_the_defaults():
    cfg = parse_args(["--config", str(ROOT / "recipes" / "shakespeare_small.toml"), "--max_steps", "5"])
    assert cfg.model == "small" and cfg.total_batch_size == 4096  # from the recipe
    assert cfg.max_steps == 5  # the flag wins
    assert cfg.weight_decay == TrainConfig.weight_decay  # not in the recipe: the default


def test_the_snapshot_flags_old_names_still_work_on_the_command_line_and_in_recipes(tmp_path, capsys, monkeypatch):
    (tmp_path / "old.toml").write_text('ckpt_every = 7\nckpt_dir = "old"\n')
    cfg = parse_args(["--config", str(tmp_path / "old.toml")])
    assert (cfg.snapshot_every, cfg.snapshot_dir) == (7, "old")
    cfg = parse_args(["--config", str(tmp_path / "old.toml"), "--ckpt_every", "9", "--snapshot_dir", "new"])
    assert (cfg.snapshot_every, cfg.snapshot_dir) == (9, "new")
    monkeypatch.setattr("sys.argv", ["train_gpt2.py"])
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "--snapshot_every SNAPSHOT_EVERY, --ckpt_every SNAPSHOT_EVERY" in capsys.readouterr().out


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
    (["--val_steps", "-1"], "--val_steps -1: pass a number at least 1"),
    (["--max_steps", "-3"], "--max_steps -3: pass a number at least 1"),
    # zero where it means nothing: it was taken as "not set" (the preset's value, --val_tokens), or trained nothing
    (["--n_layer", "0"], "--n_layer 0: pass a number at least 1"),
    (["--seq_len", "0"], "--seq_len 0: pass a number at least 1"),
    (["--val_steps", "0"], "--val_steps 0: pass a number at least 1"),
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


def test_the_old_hellaswag_flags_and_recipe_keys_set_the_eval_ones(tmp_path):
    cfg = parse_args(["--hellaswag_every", "7", "--hellaswag_limit", "30"])
    assert (cfg.eval_every, cfg.eval_limit, cfg.eval_tasks) == (7, 30, "hellaswag")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("hellaswag_every = 0\nhellaswag_limit = 5\neval_tasks = \"piqa,copa\"\n")
    cfg = parse_args(["--config", str(recipe)])
    assert (cfg.eval_every, cfg.eval_limit, cfg.eval_tasks) == (0, 5, "piqa,copa")


def test_an_unknown_eval_task_stops_the_plan_unless_the_evaluations_are_off(tmp_path):
    flags = ["--model", "tiny", "--micro_batch_size", "2", "--total_batch_size", "128", "--val_every", "0",
             "--eval_tasks", "hellaswag,piqa,winogrand"]
    with pytest.raises(UserError, match=r"--eval_tasks 'hellaswag,piqa,winogrand': unknown task winogrand\. Pass"):
        resolve_plan(parse_args(flags), world_size=1)
    assert resolve_plan(parse_args([*flags, "--eval_every", "0"]), world_size=1).seq_len == 64
