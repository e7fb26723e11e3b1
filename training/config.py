"""A training run's flags (TrainConfig), recipes of them (`--config recipes/x.toml`, which flags override), each flag's
checks on its own, and the Plan they resolve to (with what training/inputs.py reads). It reads no file but recipes."""

import argparse
import math
import re
import typing
from dataclasses import dataclass, field, fields, replace

import tomllib

from model import ARCHITECTURES, PRESETS, GPTConfig, with_arch
from training.errors import UserError
from training.parsing import PARSE_ERRORS, parse_problem
from training.recompute import ACTIVATION_CHECKPOINTING

HF_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def arg(default, help: str, choices: tuple[str, ...] | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    # data
    data_dir: str = arg("data/fineweb_edu10B", "directory of *_train_*.bin / *_val_*.bin shards")
    data_mix: str = arg("", "instead of --data_dir, DIR=WEIGHT pairs: 'data/enwiki=3,data/code=1' (one tokenizer)")
    anneal_mix: str = arg("", "DIR=WEIGHT pairs: the mixture from --anneal_from on (default: from wsd's decay on)")
    anneal_from: int | None = arg(None, "the step --anneal_mix starts at")
    shuffle: bool = arg(True, "shuffle shard and chunk order each epoch (seeded; validation never shuffles)")
    align_bos: bool | None = arg(None, "rows begin at document starts (default: on for --arch modern, off for gpt2)")
    # model
    arch: str | None = arg(None, "gpt2 (OpenAI's) | modern: RoPE, RMSNorm, QK-norm, SwiGLU, untied (default: gpt2, "
                                 "or the --init_from weights')", choices=ARCHITECTURES)
    attention_bias: bool | None = arg(None, "--arch modern: biases on attention's projections (default: on)")
    model: str | None = arg(None, f"size preset: {', '.join(PRESETS)} (default: gpt2; with --init_from: the weights')")
    init_from: str = arg("scratch", f"scratch | {' | '.join(HF_MODELS)} | a Hugging Face model dir | a snapshot_*.pt")
    n_layer: int | None = arg(None, "override the preset's number of layers")
    n_head: int | None = arg(None, "override the preset's number of attention heads")
    n_embd: int | None = arg(None, "override the preset's embedding width")
    block_size: int | None = arg(None, "override the preset's context length (with --init_from: crop it)")
    # batch: total_batch_size tokens per optimizer step = micro_batch_size·seq_len·world_size·grad_accum_steps
    seq_len: int | None = arg(None, "training sequence length T (≤ block_size; default: block_size)")
    short_rows: str = arg("", "LENGTH:UNTIL_STEP pairs, e.g. '64:50,128:100': shorter rows early (empty: whole rows)")
    micro_batch_size: int | str = arg(64, "sequences per rank per micro-step B, or 'auto': the most that fit in memory")
    total_batch_size: int = arg(524288, "tokens per optimizer step (GPT-2 used ~0.5M)")
    # optimization
    max_steps: int = arg(19073, "optimizer steps (19,073 × 524,288 ≈ 10B tokens, one FineWeb-Edu 10B epoch)")
    warmup_steps: int = arg(715, "linear LR warmup steps")
    max_lr: float = arg(6e-4, "peak learning rate")
    min_lr_ratio: float = arg(0.1, "final learning rate as a fraction of max_lr")
    weight_decay: float = arg(0.1, "AdamW weight decay on matrices")
    adam_beta1: float = arg(0.9, "AdamW's first-moment decay (its second is 0.95)")
    lr_schedule: str = arg("cosine", "after the warmup: cosine decay to min_lr_ratio·max_lr | wsd: hold max_lr, then "
                                     "decay over the last --warmdown_frac", choices=("cosine", "wsd"))
    warmdown_frac: float = arg(0.2, "wsd: the fraction of --max_steps over which the LR decays at the end")
    optimizer: str = arg("adamw", "adamw | muon: Muon for the blocks' 2-D weights, AdamW for the rest",
                         choices=("adamw", "muon"))
    embed_lr: float | None = arg(None, "--arch modern: peak LR of the untied input embedding (default: 10 × --max_lr)")
    muon_lr: float = arg(0.01, "muon: peak learning rate of the Muon-updated matrices")
    muon_momentum: float = arg(0.95, "muon: Nesterov momentum")
    muon_momentum_warmup: int = arg(0, "muon: steps over which the momentum rises from 0.85 to --muon_momentum")
    muon_weight_decay: float = arg(0.0, "muon: decoupled weight decay, applied as muon_lr·decay per step")
    muon_adjust_lr: str = arg("original", "muon: per-shape LR scaling: original (Keller Jordan's) | match_rms_adamw "
                                          "(Moonshot's)", choices=("original", "match_rms_adamw"))
    grad_clip: float = arg(1.0, "clip the global gradient norm to this (0 = off)")
    # speed and precision
    dtype: str = arg("auto", "autocast dtype (auto: bf16 where the hardware has it, else fp16 on GPUs, else fp32)",
                     choices=("auto", "bf16", "fp16", "fp32"))
    device: str = arg("auto", "where to train (auto: cuda, else mps, else cpu)", choices=("auto", "cuda", "mps", "cpu"))
    compile: bool = arg(False, "torch.compile the model")
    fp8_head: bool = arg(False, "the output layer's matmuls in FP8 in the training loss (fp8.py; sm89+ GPUs, bf16)")
    parallel: str = arg("ddp", "ddp: every GPU holds the whole model | fsdp: weights, gradients, AdamW state sharded",
                        choices=("ddp", "fsdp"))
    activation_checkpointing: str = arg("none", "recompute activations in backward: none | blocks (the least memory) | "
                                                "selective (LayerNorms, GELU, casts)", choices=ACTIVATION_CHECKPOINTING)
    deterministic: bool = arg(False, "bitwise-repeatable GPU runs (strictly deterministic kernels; slower)")
    seed: int = arg(1337, "random seed (weights init, data shuffling)")
    # evaluation and logging
    val_every: int = arg(250, "validate every N steps (0 = never)")
    val_tokens: int = arg(10_485_760, "tokens per validation (any world size; at most one pass over the val shards)")
    eval_tasks: str = arg("hellaswag", "zero-shot tasks, comma-separated: hellaswag, lambada_openai, piqa, winogrande, "
                                       "arc_easy, arc_challenge, openbookqa, sciq, copa, boolq, or all")
    eval_every: int = arg(250, "the --eval_tasks every N steps (0 = never)")
    eval_limit: int | None = arg(None, "only the first N documents of each task")
    eval_dir: str | None = arg(None, "directory of the tasks' <task>.jsonl files (default: data/evals/, downloaded)")
    sample_every: int = arg(250, "rank 0 prints sampled text every N steps (0 = never)")
    log_dir: str = arg("logs", "metrics.jsonl (and, by default, snapshots) go here")
    wandb_project: str | None = arg(None, "wandb project; logging to wandb is on when this is set")
    wandb_mode: str | None = arg(None, "online|offline|disabled (default: online with a project, else disabled)",
                                 choices=("online", "offline", "disabled"))
    wandb_run_name: str | None = arg(None, "wandb run name")
    # fault tolerance
    snapshot_dir: str | None = arg(None, "snapshot directory (default: --log_dir)")
    snapshot_every: int = arg(500, "snapshot every N steps (0: none on a beat); the last step and a stop always do")
    keep_last: int = arg(2, "keep this many newest snapshots")
    resume: str = arg("auto", "auto (newest valid snapshot in --snapshot_dir) | never | PATH to a snapshot")
    dist_timeout: int = arg(600, "seconds a rank waits for the others in a collective before it exits (longer than any "
                                 "snapshot write or evaluation that only some ranks do)")
    skip_zscore: float = arg(0.0, "also skip an update whose loss or grad norm is this many σ above its mean (0 = off)")
    on_divergence: str = arg("stop", "after --max_skips skipped updates in a row: stop | rollback (to the newest "
                                     "healthy snapshot)", choices=("stop", "rollback"))
    max_skips: int = arg(10, "skipped updates in a row that count as a divergence")
    max_rollbacks: int = arg(3, "with --on_divergence rollback: roll back at most this many times, then stop")
    run_lock: bool = arg(True, "lock --log_dir and --snapshot_dir (--no-run_lock: only where the filesystem has no "
                               "flock; then nothing stops two runs writing into one directory)")

    def mixture(self) -> tuple[tuple[str, ...], tuple[float, ...], tuple[float, ...] | None, int | None]:
        """(sources, weights, anneal_weights, anneal_step) of --data_dir or --data_mix, and --anneal_mix."""
        base = parse_mix(self.data_mix, "data_mix") if self.data_mix else {self.data_dir: 1.0}
        if not self.anneal_mix and self.anneal_from is not None:
            raise UserError(f"--anneal_from {self.anneal_from}: there is no --anneal_mix to start then. Pass "
                            "--anneal_mix DIR=WEIGHT,..., or leave --anneal_from out.")
        if not self.anneal_mix:
            return tuple(base), tuple(base.values()), None, None
        if self.anneal_from is None and self.lr_schedule != "wsd":
            raise UserError(f"--anneal_mix starts where --lr_schedule wsd's decay does, or at --anneal_from STEP, and "
                            f"this run has --lr_schedule {self.lr_schedule}. Pass --lr_schedule wsd or --anneal_from.")
        anneal = parse_mix(self.anneal_mix, "anneal_mix")
        sources = tuple(base) + tuple(source for source in anneal if source not in base)
        anneal_step = self.anneal_from if self.anneal_from is not None else \
            self.max_steps - max(1, round(self.warmdown_frac * self.max_steps))  # (optim.get_lr's warmdown)
        return (sources, tuple(base.get(source, 0.0) for source in sources),
                tuple(anneal.get(source, 0.0) for source in sources), anneal_step)


# The --help sections, named at the first flag of each (the comments in TrainConfig).
FLAG_GROUPS = {"data_dir": "data", "arch": "model", "seq_len": "batch", "max_steps": "optimization",
               "dtype": "speed and precision", "val_every": "evaluation and logging",
               "snapshot_dir": "fault tolerance"}
# The flags that name a file or directory (or a keyword: --init_from scratch, --resume auto).
PATH_FLAGS = ("data_dir", "init_from", "eval_dir", "log_dir", "snapshot_dir", "resume")


# The top of a whole-number flag whose range names none: C's int, the most any library we hand a count to takes
# (timedelta, CUDA's grid, NCCL), and the product of two fits in int64. Above it a run crashed part way.
LARGEST_COUNT = 2**31 - 1


@dataclass(frozen=True)
class Range:
    """The values a number flag takes: finite, low to high (open ends left out), a whole number's ≤ LARGEST_COUNT."""
    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def top(self, value: float) -> float:
        return LARGEST_COUNT if isinstance(value, int) and self.high == math.inf else self.high

    def __contains__(self, value: float) -> bool:
        above_low = value > self.low if self.low_open else value >= self.low
        below_high = value < self.top(value) if self.high_open else value <= self.top(value)
        return (isinstance(value, int) or math.isfinite(value)) and above_low and below_high  # (NaN fails both)

    def describe(self, value: float) -> str:
        """The range, to a user who passed `value`: its top only where it is the flag's own, or what value passed."""
        low = f"above {self.low}" if self.low_open else f"at least {self.low}"
        top = self.top(value)
        shown = self.high != math.inf or (top != math.inf and value > top)
        return low + (f" and {'below' if self.high_open else 'at most'} {top}" if shown else "")


AT_LEAST_0, AT_LEAST_1, ABOVE_0 = Range(0), Range(1), Range(0, low_open=True)
BELOW_1 = Range(0, 1, high_open=True)
SEEDS = Range(0, 2**64, high_open=True)  # numpy's generators take no negative seed, torch's none of 2**64 or more
# The values of each number flag (None, "not set", is not checked); outside them a run crashed or meant another thing.
FLAG_RANGES = {
    "n_layer": AT_LEAST_1, "n_head": AT_LEAST_1, "n_embd": AT_LEAST_1, "block_size": AT_LEAST_1, "seq_len": AT_LEAST_1,
    "micro_batch_size": AT_LEAST_1, "total_batch_size": AT_LEAST_1, "max_steps": AT_LEAST_1,
    "warmup_steps": AT_LEAST_0, "max_lr": ABOVE_0, "min_lr_ratio": Range(0, 1), "weight_decay": AT_LEAST_0,
    "adam_beta1": BELOW_1, "warmdown_frac": Range(0, 1, low_open=True), "embed_lr": ABOVE_0, "muon_lr": ABOVE_0,
    "muon_momentum": BELOW_1, "muon_momentum_warmup": AT_LEAST_0, "muon_weight_decay": AT_LEAST_0,
    "grad_clip": AT_LEAST_0, "seed": SEEDS, "val_every": AT_LEAST_0, "val_tokens": AT_LEAST_1,
    "eval_every": AT_LEAST_0, "eval_limit": AT_LEAST_1, "sample_every": AT_LEAST_0, "snapshot_every": AT_LEAST_0,
    "dist_timeout": AT_LEAST_1, "skip_zscore": AT_LEAST_0, "max_skips": AT_LEAST_1, "max_rollbacks": AT_LEAST_0,
    "keep_last": AT_LEAST_1, "anneal_from": AT_LEAST_0,
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default in --help."""


def add_flags(parser: argparse.ArgumentParser, names: list[str] | None = None, defaults: dict | None = None) -> None:
    """A --flag per TrainConfig field (or the named ones, for bench.py), grouped as in TrainConfig."""
    group = parser
    for f in fields(TrainConfig):
        if f.name in FLAG_GROUPS and names is None:
            group = parser.add_argument_group(FLAG_GROUPS[f.name])
        if names is not None and f.name not in names:
            continue
        kind = set_type(f.type)
        options = {"action": argparse.BooleanOptionalAction} if kind is bool else \
            {"type": int_or_auto if kind == int | str else kind, "choices": f.metadata["choices"]}
        group.add_argument(f"--{f.name}", default=(defaults or {}).get(f.name, f.default), help=f.metadata["help"],
                           **options)


def set_type(field_type: type) -> type:
    """The type of a flag's value when it is given: X for a field typed X | None (None is its default's)."""
    types = [t for t in typing.get_args(field_type) if t is not type(None)]
    return types[0] if len(types) == 1 else field_type


def int_or_auto(text: str) -> int | str:
    if text == "auto" or text.isdigit():
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is neither a number of sequences nor 'auto'")


def parse_args(argv: list[str] | None = None, description: str = __doc__) -> TrainConfig:
    """Flags, on top of the recipe that --config names (if any), on top of TrainConfig's defaults."""
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    parser.add_argument("--config", help="a recipe: a TOML file of flag = value lines (recipes/); flags override it")
    add_flags(parser)
    recipe_path = parser.parse_known_args(argv)[0].config
    recipe = load_recipe(recipe_path) if recipe_path is not None else {}
    parser.set_defaults(**recipe)
    values = vars(parser.parse_args(argv, argparse.Namespace(data_dir=None, data_mix=None)))  # (None: not given)
    values.pop("config")
    # The data: the command line's --data_dir or --data_mix, else the recipe's; never both from one of them.
    data = {flag: values[flag] for flag in ("data_dir", "data_mix") if values[flag] is not None} or \
        {flag: recipe[flag] for flag in ("data_dir", "data_mix") if flag in recipe}
    if len(data) == 2:
        raise UserError(f"--data_mix {data['data_mix']!r} and --data_dir {data['data_dir']} both name the training "
                        f"data. Pass one: add {data['data_dir']}=WEIGHT to --data_mix, or leave --data_mix out.")
    return TrainConfig(**values | {"data_dir": TrainConfig.data_dir, "data_mix": ""} | data)


def load_recipe(path: str) -> dict:
    """The flags in a recipe file, checked against TrainConfig's names, types and choices."""
    check_path_flag("config", path)
    try:
        with open(path, "rb") as f:
            recipe = tomllib.load(f)
    except FileNotFoundError as e:
        raise UserError(f"--config {path}: no such file. Pass a recipe such as "
                        "recipes/gpt2_124m_fineweb_edu.toml.") from e
    except OSError as e:  # a directory, no permission to read it
        raise UserError(f"--config {path} could not be read ({e.strerror}). Pass a recipe file such as "
                        "recipes/gpt2_124m_fineweb_edu.toml.") from e
    except PARSE_ERRORS as e:
        raise UserError(f"--config {path} is {parse_problem(e)}. Each line is `flag = value`, e.g. "
                        "`max_steps = 100` or `data_dir = \"data/shakespeare\"`.") from e
    known = {f.name: f for f in fields(TrainConfig)}
    for key, value in recipe.items():
        if key not in known:
            raise UserError(f"--config {path}: unknown setting {key!r}. A recipe sets the flags of "
                            "`python train_gpt2.py --help`, without the leading dashes.")
        value_type = set_type(known[key].type)
        expected = {float: (float, int), int | str: (int, str)}.get(value_type, value_type)
        choices = known[key].metadata["choices"]
        if not isinstance(value, expected) or isinstance(value, bool) != (expected is bool) or \
                (choices and value not in choices):
            raise UserError(f"--config {path}: {key} = {value!r} is not a valid value for --{key} "
                            f"({'one of ' + ', '.join(choices) if choices else known[key].type}).")
    return recipe


# ----------------------------------------------------------------------------------------------------------------
# the plan

@dataclass(frozen=True)
class Plan:
    model_config: GPTConfig
    align_bos: bool  # --align_bos, or its default for the architecture
    seq_len: int
    short_rows: tuple[tuple[int, int], ...]  # --short_rows: (row length, until which step), the steps increasing
    grad_accum_steps: int
    val_steps: int  # validation micro-batches per rank, of each source (0: no validation)
    snapshot_dir: str
    sources: tuple[str, ...]  # the data directories: --data_dir, or --data_mix's and --anneal_mix's
    weights: tuple[float, ...]  # each source's share of the chunks (normalised), before anneal_step
    anneal_weights: tuple[float, ...] | None  # --anneal_mix's, from anneal_step on
    anneal_step: int | None


def make_plan(cfg: TrainConfig, config: GPTConfig, world_size: int, val_shard_tokens: list[list[int]]) -> Plan:
    """What the flags (each checked on its own first) imply for a model of `config` on world_size ranks, source i's
    val shards holding val_shard_tokens[i] tokens each: a UserError names the first bad combination and the fix."""
    if not isinstance(cfg.micro_batch_size, int):  # (a number's range: check_flag_ranges)
        raise UserError(f"--micro_batch_size {cfg.micro_batch_size!r}: pass a number of sequences (1 or more) or "
                        "'auto'.")
    seq_len = cfg.seq_len or config.block_size
    if seq_len > config.block_size:
        raise UserError(f"--seq_len {seq_len} exceeds the model's --block_size {config.block_size}; lower --seq_len "
                        "or raise --block_size.")
    short_rows = parse_short_rows(cfg.short_rows, seq_len)
    grad_accum_steps = grad_accum_steps_for(cfg, seq_len, world_size)
    val_steps = min(validation_steps(cfg, seq_len, world_size, tokens) for tokens in val_shard_tokens) \
        if cfg.val_every else 0
    if cfg.on_divergence == "rollback" and not cfg.snapshot_every:
        raise UserError("--on_divergence rollback reloads the newest healthy snapshot, and --snapshot_every 0 writes "
                        "none. Pass --snapshot_every N (e.g. 500), or --on_divergence stop.")
    if cfg.embed_lr is not None and config.arch == "gpt2":
        raise UserError(f"--embed_lr {cfg.embed_lr}: gpt2's token embedding is also its output layer (tied), so it "
                        "learns at --max_lr. Leave --embed_lr out, or train --arch modern, whose embedding is its own.")
    if cfg.attention_bias is not None and config.arch == "gpt2":
        raise UserError(f"--{'' if cfg.attention_bias else 'no-'}attention_bias: gpt2 has biases on every layer, "
                        "attention's included, as OpenAI's. Leave the flag out, or train --arch modern.")
    align_bos = cfg.align_bos if cfg.align_bos is not None else config.arch == "modern"
    return Plan(config, align_bos, seq_len, short_rows, grad_accum_steps, val_steps, cfg.snapshot_dir or cfg.log_dir,
                *cfg.mixture())


def parse_mix(text: str, flag: str) -> dict[str, float]:
    """--data_mix 'a=3,b=1' as {"a": 0.75, "b": 0.25}."""
    mix: dict[str, float] = {}
    for pair in text.split(","):
        source, _, weight = pair.rpartition("=")
        if not source or not re.fullmatch(r"(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", weight) or not 0 < float(weight) < math.inf:
            raise UserError(f"--{flag} {text!r}: {pair!r} is not DIR=WEIGHT with a positive number as its weight. "
                            "Pass e.g. 'data/enwiki=3,data/shakespeare=1' (the weights are normalised).")
        if source in mix:
            raise UserError(f"--{flag} {text!r} names {source} twice. Name each directory once, with its weight.")
        mix[source] = float(weight)
    return {source: weight / sum(mix.values()) for source, weight in mix.items()}


def check_flag_ranges(cfg: TrainConfig) -> None:
    """A UserError naming the first number flag outside its FLAG_RANGES, quoting its --help (not None, nor 'auto')."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in FLAG_RANGES and isinstance(value, int | float):
            check_range(f.name, value, FLAG_RANGES[f.name], f.metadata["help"])


def check_range(flag: str, value: float, allowed: Range, help: str | None = None) -> None:
    """A UserError naming --flag (and quoting its --help, if given) unless value is in the allowed range."""
    if value not in allowed:
        finite = "finite " if isinstance(value, float) and not math.isfinite(value) else ""
        raise UserError(f"--{flag} {value}: pass a {finite}number {allowed.describe(value)}" +
                        (f' (--help: "{help}")' if help else "") + ".")


def check_path_flags(cfg: TrainConfig) -> None:
    """A UserError naming the first of PATH_FLAGS that is empty or not UTF-8, or --resume and --init_from both set."""
    for flag in PATH_FLAGS:
        if getattr(cfg, flag) is not None:
            check_path_flag(flag, getattr(cfg, flag))
    if cfg.resume not in ("auto", "never") and cfg.init_from != "scratch":
        raise UserError(f"--resume {cfg.resume} and --init_from {cfg.init_from} both name the weights to start from. "
                        "Pass --resume PATH to continue or branch from a snapshot with its optimizer and data "
                        "position, or --init_from to start a new run from weights alone, not both.")


def check_path_flag(flag: str, path: str) -> None:
    """A UserError unless --flag's path is not empty and is UTF-8 (the run's JSON records hold it)."""
    if not path:
        raise UserError(f"--{flag} is empty (an unset variable in a job script?). Pass a path, or leave the flag out "
                        "for its default.")
    try:
        path.encode()
    except UnicodeEncodeError as e:  # os.fsdecode's stand-ins (U+DC80-U+DCFF) for bytes that do not decode
        byte = ord(path[e.start]) - 0xDC00
        raise UserError(f"--{flag} {path!r}: the name is not valid UTF-8 (byte {byte:#04x}), and a run records its "
                        "paths as UTF-8 text. Rename it to a UTF-8 name (e.g. `convmv -f latin1 -t utf8`), or pass "
                        "another path.") from e


def parse_short_rows(schedule: str, seq_len: int) -> tuple[tuple[int, int], ...]:
    """--short_rows '64:50,128:100' as ((64, 50), (128, 100)), checked against --seq_len."""
    if not schedule:
        return ()
    try:  # (a pair of one number, or of three, does not unpack: a ValueError too)
        pairs = tuple((int(length), int(until)) for length, until in (pair.split(":") for pair in schedule.split(",")))
    except ValueError:
        raise UserError(f"--short_rows {schedule!r}: pass LENGTH:UNTIL_STEP pairs separated by commas, e.g. "
                        "'64:50,128:100' (rows of 64 tokens before step 50, of 128 before step 100, then whole "
                        "rows).") from None
    steps = [until for _, until in pairs]
    if any(length < 1 or seq_len % length or until < 1 for length, until in pairs) or steps != sorted(set(steps)):
        raise UserError(f"--short_rows {schedule!r}: each LENGTH must divide --seq_len {seq_len} (a row is cut into "
                        "shorter ones), and the UNTIL_STEPs must rise, from 1 on: e.g. '64:50,128:100' for --seq_len "
                        "256 or 1024.")
    return pairs


def row_length(step: int, plan: Plan) -> int:
    """The length of the rows the model trains on at `step` (--short_rows), a divisor of --seq_len."""
    return next((length for length, until in plan.short_rows if step < until), plan.seq_len)


def model_shape(cfg: TrainConfig, vocab_size: int, weights: GPTConfig | None = None) -> GPTConfig:
    """A preset with the shape flags applied, for the data's vocab_size; or, with --init_from, that of `weights`."""
    if cfg.model is not None and cfg.model not in PRESETS:
        raise UserError(f"--model {cfg.model!r} is not a known preset; choose one of {', '.join(PRESETS)}.")
    overrides = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "block_size") if getattr(cfg, k)}
    if weights is None:
        config = replace(with_arch(PRESETS[cfg.model or "gpt2"], cfg.arch or "gpt2", cfg.attention_bias), **overrides,
                         vocab_size=vocab_size)
        if config.n_embd % config.n_head:
            raise UserError(f"--n_embd {config.n_embd} must be a multiple of --n_head {config.n_head}.")
        return config
    asked = {k: v for k, v in overrides.items() if k != "block_size"} | ({"arch": cfg.arch} if cfg.arch else {}) | \
        ({"attention_bias": cfg.attention_bias} if cfg.attention_bias is not None else {})
    if cfg.model is not None:  # a preset named on purpose must be the weights' shape
        preset = PRESETS[cfg.model]
        asked = {"n_layer": preset.n_layer, "n_head": preset.n_head, "n_embd": preset.n_embd} | asked
    conflicts = {k: v for k, v in asked.items() if getattr(weights, k) != v}
    if conflicts:
        flags = ", ".join(f"--{k} {v} (the weights have {getattr(weights, k)})" for k, v in conflicts.items())
        raise UserError(f"--init_from {cfg.init_from}: the model's shape comes from those weights, but {flags}. "
                        "Leave out the shape flags (and --model) when starting from pretrained weights.")
    block_size = cfg.block_size or weights.block_size
    if block_size > weights.block_size:
        raise UserError(f"--block_size {block_size} is longer than the {weights.block_size} positions the "
                        f"--init_from {cfg.init_from} weights were trained with; it can only be lowered (the position "
                        "embeddings are cropped).")
    return replace(weights, block_size=block_size)


def grad_accum_steps_for(cfg: TrainConfig, seq_len: int, world_size: int) -> int:
    tokens_per_micro_step = cfg.micro_batch_size * seq_len * world_size
    if cfg.total_batch_size % tokens_per_micro_step:
        raise UserError(
            f"--total_batch_size {cfg.total_batch_size} is not a multiple of --micro_batch_size × --seq_len × ranks "
            f"= {cfg.micro_batch_size} × {seq_len} × {world_size} = {tokens_per_micro_step}. Pick a total batch that "
            "is, e.g. " f"{max(1, cfg.total_batch_size // tokens_per_micro_step) * tokens_per_micro_step}.")
    return cfg.total_batch_size // tokens_per_micro_step


def validation_steps(cfg: TrainConfig, seq_len: int, world_size: int, val_shard_tokens: list[int]) -> int:
    """Micro-batches per rank per validation: --val_tokens worth, at most one pass over val_shard_tokens' shards."""
    tokens_per_micro_step = cfg.micro_batch_size * seq_len * world_size
    available = sum((tokens - 1) // tokens_per_micro_step for tokens in val_shard_tokens)
    return max(1, min(cfg.val_tokens // tokens_per_micro_step, available))
