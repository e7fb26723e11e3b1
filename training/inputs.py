"""Every input of a training run checked at the door, before any side effect (process group, file, lock, download):
each flag on its own (training/config.py), torchrun's environment, then the flags against the files they name."""

from dataclasses import replace
from pathlib import Path

from dataloader import check_shard_fills_a_step, find_shards, read_data_tokenizer, read_shard_header
from evaluation.tasks import parse_task_names
from model import PRESETS, GPTConfig
from rundir.snapshot import is_snapshot_directory, read_model_config
from training.config import HF_MODELS, Plan, TrainConfig, check_flag_ranges, check_path_flags, make_plan, model_shape
from training.distributed import this_process
from training.errors import UserError
from training.hf import local_config
from training.tokenizer import check_tokenizer, read_tokenizer


def check_inputs(cfg: TrainConfig) -> None:
    """train_gpt2.py's door: a UserError naming the first bad input and the fix (--micro_batch_size auto as 1)."""
    check_path_flags(cfg)
    world_size = this_process(cfg.device).world_size
    train_shards = [path for source in cfg.mixture()[0] for path in find_shards(source, "train")]
    cfg = replace(cfg, micro_batch_size=1) if cfg.micro_batch_size == "auto" else cfg
    plan = resolve_plan(cfg, world_size)
    for path in train_shards:
        check_shard_fills_a_step(path, read_shard_header(path), world_size * plan.grad_accum_steps,
                                 cfg.micro_batch_size, plan.seq_len)


def resolve_plan(cfg: TrainConfig, world_size: int) -> Plan:
    """The plan of the flags on world_size ranks, every flag checked: on its own first, then against the files."""
    check_flag_ranges(cfg)
    config = model_config(cfg)
    if cfg.eval_every:
        parse_task_names(cfg.eval_tasks, "--eval_tasks")
    return make_plan(cfg, config, world_size, [val_shard_tokens(source) for source in cfg.mixture()[0]]
                     if cfg.val_every else [])


def val_shard_tokens(data_dir: str) -> list[int]:
    """The number of tokens in each of data_dir's val shards (a UserError if it has none)."""
    return [read_shard_header(path) for path in find_shards(data_dir, "val")]


def model_config(cfg: TrainConfig) -> GPTConfig:
    """The model's shape for the data's tokenizer (every source's one), or the --init_from weights', if theirs too."""
    sources = cfg.mixture()[0]
    data_tokenizer = read_data_tokenizer(sources[0])
    for source in sources[1:]:
        if (its := read_data_tokenizer(source)).sha256 != data_tokenizer.sha256:
            raise UserError(f"--data_mix: {sources[0]} holds shards of the tokenizer {data_tokenizer.describe()}, "
                            f"{source} of {its.describe()}; a model reads one tokenizer's ids. Write {source}'s text "
                            f"again with data/prepare.py --tokenizer (the one of {sources[0]}), or leave it out.")
    if cfg.init_from == "scratch":
        return model_shape(cfg, data_tokenizer.vocab_size)
    weights = init_weights_config(cfg.init_from)
    try:
        weights_tokenizer = read_tokenizer(cfg.init_from)
    except ValueError as e:  # the reader's message names the file and what is wrong with its record
        raise UserError(f"--init_from: {e}") from e
    check_tokenizer(f"--init_from {cfg.init_from}", weights_tokenizer, ", ".join(sources),
                    data_tokenizer, "Start from weights trained with this data's tokenizer, train them on data written "
                    "with theirs (data/prepare.py --tokenizer), or train from scratch (--init_from scratch).")
    return model_shape(cfg, data_tokenizer.vocab_size, weights)


def init_weights_config(init_from: str) -> GPTConfig:
    """The shape of the weights --init_from names, read without loading them (nor downloading OpenAI's)."""
    if init_from in HF_MODELS:
        return PRESETS[init_from]  # OpenAI's GPT-2 sizes are our presets of the same names
    path = Path(init_from)
    if path.is_file() or is_snapshot_directory(path):  # a snapshot of ours (a file, or an fsdp run's directory)
        try:
            return read_model_config(path)
        except ValueError as e:  # the reader's message names the file and what is wrong with it
            raise UserError(f"--init_from: {e} (Or a Hugging Face model directory, or gpt2 / gpt2-medium / ...)") from e
        except TypeError as e:  # (an OSError, EIO say, is the disk's, not the file's: errors.path_error says so)
            raise UserError(f"--init_from {init_from} is not a snapshot of this codebase ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}). Pass a snapshot_*.pt written by "
                            "train_gpt2.py, a Hugging Face model directory, or gpt2 / gpt2-medium / ...") from e
    if path.is_dir():  # a Hugging Face model directory: its config.json, checked against its weight file
        return local_config(path)
    raise UserError(f"--init_from {init_from}: no such file or directory, and not one of scratch, "
                    f"{', '.join(HF_MODELS)}. Pass a Hugging Face model directory or a snapshot_*.pt.")
