"""The runs of dev/arch_compare.py: its recipes (the flags of each, and the LRs it sweeps), where each run's metrics
and last snapshot go, running them, and reading their val curves. Not a command: dev/arch_compare.py is."""

import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dev.curves import steps_to_reach
from training.config import parse_short_rows
from training.metrics_log import read_metrics

ROOT = Path(os.environ.get("SWEEP_ROOT", "logs/arch_sweep"))
STEPS = 245  # × 8,192 tokens = 2,007,040
SEQ_LEN = 256
# fp32 unless SWEEP_DTYPE says otherwise: the tables' runs are fp32, and `auto` would pick bf16 on a GPU or on a CPU
# with AVX512-BF16 or AMX. Runs in another dtype go to a SWEEP_ROOT of their own.
DTYPE = os.environ.get("SWEEP_DTYPE", "fp32")
COMMON = ["--dtype", DTYPE, "--data_dir", "data/enwiki", "--seq_len", str(SEQ_LEN), "--micro_batch_size", "32",
          "--total_batch_size", "8192", "--warmup_steps", "25", "--val_every", "20", "--val_tokens", "65536",
          "--eval_every", "0", "--sample_every", "0", "--resume", "never",
          "--snapshot_every", "1000000"]  # (only the last step's)
SHAPES = {"4x256": ["--model", "small"],  # 4 layers, 4 heads, width 256
          "6x384": ["--model", "small", "--n_layer", "6", "--n_head", "6", "--n_embd", "384"],
          # 4x256 with rows of 1,024 tokens, the 124M recipe's (8 rows a step, the same 8,192 tokens); flags given
          # twice take the last value, so these replace COMMON's rows of 256.
          "4x256_T1024": ["--model", "small", "--block_size", "1024", "--seq_len", "1024", "--micro_batch_size", "8"]}
# The LR each recipe sweeps (--max_lr for AdamW, --muon_lr for Muon), and its fixed flags. Muon's AdamW part
# (embeddings, output layer, norms) stays at --max_lr 2e-3 in both Muon recipes.
MUON_LRS = [0.0025, 0.005, 0.01, 0.02, 0.04]  # (modern's best was at the low end of 0.01-0.04, so the sweep went down)
MUON_WSD = ["--optimizer", "muon", "--lr_schedule", "wsd", "--warmdown_frac", "0.3"]
# modern before 2026-11-27, without attention's biases: the model the ablations below changed one part of.
MODERN_BEFORE = ["--arch", "modern", "--no-attention_bias"]
RECIPES = {
    "gpt2_adamw_cosine": ("--max_lr", [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3], ["--arch", "gpt2", "--optimizer", "adamw"]),
    "gpt2_muon_wsd": ("--muon_lr", MUON_LRS, ["--arch", "gpt2", *MUON_WSD, "--max_lr", "2e-3"]),
    "modern_muon_wsd": ("--muon_lr", MUON_LRS, ["--arch", "modern", *MUON_WSD, "--max_lr", "2e-3"]),  # embedding 2e-2
    "modern_noattnbias_muon_wsd": ("--muon_lr", MUON_LRS, [*MODERN_BEFORE, *MUON_WSD, "--max_lr", "2e-3"]),
    # The ablation: that modern with its input embedding at --max_lr, as every other AdamW parameter, not 10× it.
    "modern_embed1x_muon_wsd": ("--muon_lr", MUON_LRS, [*MODERN_BEFORE, *MUON_WSD, "--max_lr", "2e-3", "--embed_lr",
                                                        "2e-3"]),
    # The tuning of Muon's AdamW part for that modern (the output layer and norms at --max_lr, the input embedding at
    # 10× it), at its best Muon LR; 2e-3 is modern_noattnbias_muon_wsd's run at that LR.
    "modern_adamlr_muon_wsd": ("--max_lr", [4e-3, 8e-3], [*MODERN_BEFORE, *MUON_WSD, "--muon_lr", "0.005"]),
}
# The ablations (dev/modern_ablations.py), each at its base's best LR: one part as GPT-2 has it, on the modern they
# were measured on (without attention's biases); one part that modded-nanogpt has and Qwen3 has not, on modern.
GPT2_PARTS = ["layernorm", "no_qk_norm", "gelu_mlp", "biases", "learned_positions"]
RECIPES |= {f"modern_{part}_muon_wsd": ("--muon_lr", [0.005], [*RECIPES["modern_noattnbias_muon_wsd"][2], "--part",
                                                               part])
            for part in GPT2_PARTS}
RECIPES |= {f"modern_{part}_muon_wsd": ("--muon_lr", [0.005], [*RECIPES["modern_muon_wsd"][2], "--part", part])
            for part in ["softcap", "relu2_mlp", "qk_gain", "value_embeds", "softcap+value_embeds",
                         "softcap+value_embeds+split_muon", "head_lr", "embed_std1", "rope_base1k", "embed_norm",
                         "gated_attn", "x0_mix", "unet", "partial_rope", "zero_head", "proj_init",
                         "slow_head"]}
# Modern with two heads of 128 (modded-nanogpt's head size) instead of four of 64: the same weights.
RECIPES["modern_heads2_muon_wsd"] = ("--muon_lr", [0.005], [*RECIPES["modern_muon_wsd"][2], "--n_head", "2"])
# The embedding at std 1 with nanochat's ratio of learning rates (its embedding at 50× its output layer's), and no
# weight decay (at that LR AdamW's 0.1 would shrink it 2 % a step).
RECIPES["modern_embed_std1_lr100x_muon_wsd"] = ("--muon_lr", [0.005], [*RECIPES["modern_embed_std1_muon_wsd"][2],
                                                                       "--embed_lr", "0.2", "--weight_decay", "0"])
# GPT-2's tied embeddings put back on modern as it is: the one matrix at modern's embedding LR (10× --max_lr), and at
# GPT-2's (--max_lr, as GPT-2 + Muon's tied matrix learns).
RECIPES |= {f"modern_tied_embeddings{suffix}_muon_wsd": ("--muon_lr", [0.005], [*RECIPES["modern_muon_wsd"][2], *extra,
                                                                                 "--part", "tied_embeddings"])
            for suffix, extra in [("", []), ("_embed1x", ["--embed_lr", "2e-3"])]}
# Changes of the shared recipe, for both Muon recipes: train_gpt2.py's flags (the two schedules are written for STEPS
# steps; a shorter run has them at the same fractions of its steps), and Muon orthogonalising q, k and v apart, a patch.
RECIPE_FLAGS = {"adam_betas": ["--adam_beta1", "0.8"], "momentum_warmup": ["--muon_momentum_warmup", "100"],
                "short_rows": ["--short_rows", "64:50,128:100"], "split": ["--part", "split_muon"],
                # the same fractions of rows of 1,024 as short_rows' are of 256: a quarter, then a half
                "short_rows1024": ["--short_rows", "256:50,512:100"]}
RECIPES |= {f"{arch}_{change}_muon_wsd": ("--muon_lr", [lr], [*RECIPES[f"{arch}_muon_wsd"][2], *flags])
            for arch, lr in [("gpt2", 0.01), ("modern", 0.005)] for change, flags in RECIPE_FLAGS.items()}
# What favours modern most, together: value embeddings (the part that gained most) and the short rows (the one change
# of the shared recipe that helps modern more than GPT-2 + Muon).
RECIPES["modern_value_embeds_short_rows_muon_wsd"] = (
    "--muon_lr", [0.005], [*RECIPES["modern_value_embeds_muon_wsd"][2], *RECIPE_FLAGS["short_rows"]])
# The shared recipe changed, for both Muon recipes: a shorter warmup than COMMON's 25 steps; no weight decay (AdamW's
# 0.1 shrinks modern's embedding, at 10× --max_lr, by 2e-3 a step, to 0.61 of its size over a run without gradient);
# the LR decaying over the last half of the run instead of 30 %.
VARIANTS = {"warmup5": ["--warmup_steps", "5"], "wd0": ["--weight_decay", "0"],
            "warmdown50": ["--warmdown_frac", "0.5"]}
RECIPES |= {f"{recipe}_{variant}": (RECIPES[recipe][0], RECIPES[recipe][1], [*RECIPES[recipe][2], *extra])
            for recipe in ("gpt2_muon_wsd", "modern_muon_wsd") for variant, extra in VARIANTS.items()}
# Every change to the shared recipe that gained on its own, together, for both Muon recipes (`combined`), and the same
# but for split Muon, with train_gpt2.py's flags only (`combined_flags`).
PRODUCT_FLAGS = [*VARIANTS["warmup5"], *(flag for change in ("adam_betas", "momentum_warmup", "short_rows")
                                         for flag in RECIPE_FLAGS[change])]
RECIPES |= {f"{arch}_{name}_muon_wsd": ("--muon_lr", [lr], [*RECIPES[f"{arch}_muon_wsd"][2], *PRODUCT_FLAGS, *extra])
            for arch, lr in [("gpt2", 0.01), ("modern", 0.005)]
            for name, extra in [("combined", RECIPE_FLAGS["split"]), ("combined_flags", [])]}
SEEDS = [1337, 42]

# The fair comparison (`fair`): the two Muon recipes on rows of 1,024 with --align_bos on for both. The runs above left
# it at each architecture's default, on for modern and off for GPT-2, so the arms trained on differently packed rows.
# GPT-2 + Muon's two LRs are swept again with it (seed 1337): --muon_lr, then its AdamW part's --max_lr at the best of
# those (modern's were swept before: its Muon LR at rows of 1,024, its AdamW part at rows of 256); then three seeds of
# each arm, with and without the sequence-length schedule, and modern planned for half the steps (the direct check).
FAIR_SHAPE = "4x256_T1024"
FAIR_SEEDS = [1337, 42, 7]
FAIR_MUON_LRS = [0.005, 0.01, 0.02]
FAIR_ADAM_LRS = [1e-3, 2e-3, 4e-3]  # extended by halving or doubling while the best is at an edge
FAIR_HALF = 123  # steps of the direct check: 122 updates, 0.50 of 244
BOS = ["--align_bos"]
for schedule, extra in [("", []), ("_short_rows", RECIPE_FLAGS["short_rows"])]:
    RECIPES[f"modern_bos{schedule}_muon_wsd"] = ("--muon_lr", [0.005], [*RECIPES["modern_muon_wsd"][2], *BOS, *extra])
    RECIPES[f"gpt2_bos{schedule}_muon_wsd"] = ("--muon_lr", FAIR_MUON_LRS, [*RECIPES["gpt2_muon_wsd"][2], *BOS, *extra])


def gpt2_bos_recipe(adam_lr: float, schedule: str = "") -> str:
    """GPT-2 + Muon with --align_bos and its AdamW part at adam_lr (2e-3: the plain recipe), registered in RECIPES."""
    name = f"gpt2_bos{schedule}_adam{adam_lr:g}_muon_wsd" if adam_lr != 2e-3 else f"gpt2_bos{schedule}_muon_wsd"
    RECIPES.setdefault(name, ("--muon_lr", FAIR_MUON_LRS, [*RECIPES[f"gpt2_bos{schedule}_muon_wsd"][2], "--max_lr",
                                                             f"{adam_lr:g}"]))
    return name



def run_dir(shape: str, recipe: str, lr: float, seed: int, steps: int = STEPS) -> Path:
    """A run of the comparison; one with fewer --steps (its whole schedule shortened) in a directory of its own."""
    return ROOT / shape / f"{recipe}_lr{lr:g}_s{seed}{'' if steps == STEPS else f'_steps{steps}'}"


def val_curve(path: Path, key: str = "val_loss", steps: int = STEPS) -> dict[int, float] | None:
    """{step: val} of a finished run (one that logged its last validation), else None."""
    metrics = path / "metrics.jsonl"
    if not metrics.exists():
        return None
    val = read_metrics(metrics)[0].get(key, {})
    return val if steps - 1 in val else None


def run(shapes: list[str], recipes: list[str], seeds: list[int], lrs: list[float] | None, steps: int = STEPS,
        jobs: int = 1) -> None:
    """Every run of these not yet finished, `jobs` at a time."""
    runs = [(shape, recipe, lr, seed, steps) for shape in shapes for recipe in recipes
            for lr in lrs or RECIPES[recipe][1] for seed in seeds]
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lambda each: train(*each), runs))  # (list: a failed run raises here)


def train(shape: str, recipe: str, lr: float, seed: int, steps: int = STEPS) -> Path:
    """One run of the comparison, unless it has finished already; its directory."""
    out = run_dir(shape, recipe, lr, seed, steps)
    if val_curve(out, steps=steps) is not None:
        return out
    out.mkdir(parents=True, exist_ok=True)
    print(f"{out} ...", flush=True)
    flag, _, flags = RECIPES[recipe]
    args = [*COMMON, "--max_steps", str(steps), *SHAPES[shape], *scaled(flags, steps, shape), flag, str(lr),
            "--seed", str(seed), "--log_dir", str(out)]
    with open(out / "stdout.txt", "w") as f:
        subprocess.run([sys.executable, *entry_point(args)], stdout=f, stderr=subprocess.STDOUT, check=True)
    return out


def scaled(flags: list[str], steps: int, shape: str) -> list[str]:
    """The flags with the steps of the momentum warmup and the short rows at the same fractions of `steps` as of
    STEPS (the LR schedule already follows --max_steps)."""
    shape_flags = [*COMMON, *SHAPES[shape]]
    seq_len = int(shape_flags[max(i for i, flag in enumerate(shape_flags) if flag == "--seq_len") + 1])  # (the last)
    def at(step: int) -> int:
        return round(step * steps / STEPS)
    flags = list(flags)
    for i, flag in enumerate(flags[:-1]):
        if flag == "--muon_momentum_warmup":
            flags[i + 1] = str(at(int(flags[i + 1])))
        elif flag == "--short_rows":
            rows = parse_short_rows(flags[i + 1], seq_len)
            flags[i + 1] = ",".join(f"{length}:{at(until)}" for length, until in rows)
    return flags


# The parts that change only the optimizer: a run of them snapshots an unpatched model.
TRAINING_PARTS = {"split_muon", "head_lr", "slow_head"}


def patches_model(recipe: str) -> bool:
    flags = RECIPES[recipe][2]
    return "--part" in flags and not set(flags[flags.index("--part") + 1].split("+")) <= TRAINING_PARTS


def entry_point(flags: list[str]) -> list[str]:
    """train_gpt2.py with these flags; an ablation's `--part PART` goes first to dev/modern_ablations.py, which
    patches the model and then runs train_gpt2 with the rest."""
    if "--part" not in flags:
        return ["train_gpt2.py", *flags]
    i = flags.index("--part")
    return ["-m", "dev.modern_ablations", *flags[i:i + 2], *flags[:i], *flags[i + 2:]]


def mean_curve(paths: list[Path], key: str = "val_loss", steps: int = STEPS) -> dict[int, float]:
    """The val curve averaged over seeds (the steps every run logged); empty if a run logged none of `key` (val_bpb
    needs the tokenizer's files)."""
    curves = [val_curve(p, key, steps) for p in paths]
    if None in curves:
        return {}
    return {s: statistics.fmean(c[s] for c in curves) for s in sorted(set.intersection(*(set(c) for c in curves)))}


def steps_and_fraction(curve: dict[int, float], target: float, steps: int = STEPS) -> str:
    """When a val curve first reaches target, as '131 (0.54)': the step and its fraction of the run's updates."""
    reach = steps_to_reach(curve, target)
    return "not reached" if reach is None else f"{reach:.0f} ({reach / (steps - 1):.2f})"


def best_runs(shape: str, recipe: str) -> tuple[float, list[Path]] | None:
    """The LR whose final val loss, averaged over the seeds finished at every LR, is lowest; and all its runs (a
    second seed is run at the best LR only)."""
    runs = {}
    for path in (ROOT / shape).glob(f"{recipe}_lr*_s*"):
        if "_steps" not in path.name and val_curve(path) is not None:
            lr, seed = path.name.removeprefix(recipe + "_lr").split("_s")
            runs.setdefault(float(lr), {})[int(seed)] = path
    if not runs:
        return None
    seeds = set.intersection(*(set(by_seed) for by_seed in runs.values())) or {s for r in runs.values() for s in r}
    final = {lr: statistics.fmean(val_curve(p)[STEPS - 1] for s, p in by_seed.items() if s in seeds)
             for lr, by_seed in runs.items()}
    for lr in sorted(final):
        print(f"    {recipe} lr {lr:g}: final val loss {final[lr]:.4f} (seeds {sorted(seeds & set(runs[lr]))})")
    lr = min(final, key=final.get)
    return lr, [runs[lr][s] for s in sorted(runs[lr])]
