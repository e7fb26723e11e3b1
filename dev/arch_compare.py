"""Three recipes on real text (enwiki), each with its LR tuned: GPT-2 + AdamW + cosine (2019's), GPT-2 + Muon + WSD
(today's best here) and --arch modern + Muon + WSD; same data, same tokens per step, same steps. The others are
ablations: modern as it was before 2026-11-27 (without attention's biases), and on that modern its embedding at
--max_lr instead of --embed_lr's default 10×, a sweep of Muon's AdamW part (--max_lr) at its best --muon_lr, and the
`modern_{part}_muon_wsd` recipes, one part changed at a time (dev/modern_ablations.py; `a+b` changes two), and changes
of what both Muon recipes share, each at its best LR: `{gpt2,modern}_muon_wsd_warmup5` (5 warmup steps, not 25),
`modern_muon_wsd_wd0` (no weight decay), `{gpt2,modern}_muon_wsd_warmdown50` (the LR decaying over the last half),
`{gpt2,modern}_split_muon_wsd` (Muon orthogonalising q, k, v apart, a patch), and train_gpt2.py's flags
`{gpt2,modern}_adam_betas_muon_wsd` (AdamW's betas (0.8, 0.95)), `{gpt2,modern}_momentum_warmup_muon_wsd` (Muon's
momentum from 0.85), `{gpt2,modern}_short_rows_muon_wsd` (a sequence-length schedule; `_short_rows1024_` the
same fractions of rows of 1,024), and
`{gpt2,modern}_combined_muon_wsd`: those four, and 5 warmup steps (`{gpt2,modern}_combined_flags_muon_wsd`: the same
but for split Muon, train_gpt2.py's flags alone); and
`modern_tied_embeddings{,_embed1x}_muon_wsd`, GPT-2's tied embeddings on modern, `modern_embed_std1{,_lr100x}_muon_wsd`,
the embedding drawn at std 1, `modern_rope_base1k_muon_wsd`, rotary base 1,000, `modern_embed_norm_muon_wsd`, an
RMSNorm on the token embedding, `modern_heads2_muon_wsd`, two heads of 128 instead of four of 64, and
`modern_value_embeds_short_rows_muon_wsd`, value embeddings with the short rows.

    python -m data.prepare --input ../shared/data/enwiki/enwiki.jsonl.gz \\
        --val_input ../shared/data/enwiki/enwiki_val.jsonl.gz --output_dir data/enwiki
    python -m dev.arch_compare run                       # every run not yet finished, in turn (GPU: minutes)
    python -m dev.arch_compare run --shapes 4x256 --recipes gpt2_muon_wsd,modern_muon_wsd --seeds 1337 --lrs 0.02
    python -m dev.arch_compare run --recipes modern_muon_wsd --lrs 0.02 --steps 147   # a shorter run, its own schedule
    python -m dev.arch_compare run --shapes 4x256 --recipes gpt2_muon_wsd --lrs 0.01 --steps 489   # twice as long
    python -m dev.arch_compare run --shapes 4x256_T1024 --recipes gpt2_muon_wsd --seeds 1337   # rows of 1,024
    python -m dev.arch_compare report                    # the tables of docs/architectures.md, and its plot
    python -m dev.arch_compare heldout                   # the best runs' final models on text nobody tuned on
    python -m dev.arch_compare fair --jobs 2             # the fair comparison (--align_bos on for both): runs, tables
    python -m dev.arch_compare fair_report               # its tables from the runs finished so far

Each run is train_gpt2.py in fp32 (or SWEEP_DTYPE) on the auto device: 245 steps of 8,192 tokens (32 rows of 256; 8 rows
of 1,024 at the shape 4x256_T1024, the 124M recipe's row length), 2.0M tokens, past the unigram phase (val loss well
under 7). Validation every 20 steps on the same 65,536 val tokens for every run. A run whose metrics show its last val
loss is not run again, so a sweep can be stopped and continued. Each run keeps its last step's snapshot, so that
`heldout` can score its model on other text: web pages (FineWeb's 20 rows in ../shared/data) and novels (LAMBADA's
passages, from BookCorpus), neither of which any recipe was tuned on."""

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dev.arch_runs import (
    DTYPE,
    FAIR_ADAM_LRS,
    FAIR_HALF,
    FAIR_MUON_LRS,
    FAIR_SEEDS,
    FAIR_SHAPE,
    RECIPES,
    ROOT,
    SEEDS,
    SHAPES,
    STEPS,
    best_runs,
    gpt2_bos_recipe,
    mean_curve,
    patches_model,
    run,
    run_dir,
    steps_and_fraction,
    train,
    val_curve,
)

SHARED_DATA = Path(os.environ.get("SHARED_DATA", "../shared/data"))
HELDOUT = {"fineweb": "fineweb_sample/fineweb_20docs.jsonl", "lambada": "evals/lambada_openai.jsonl"}
HELDOUT_TOKENS = 131_072  # of each text, at most (FineWeb's 20 rows hold 18,454; LAMBADA's 435,383)

COMPARED = ["gpt2_adamw_cosine", "gpt2_muon_wsd", "modern_muon_wsd"]  # the plot's; the others in the table only
# Each table of docs/architectures.md as the runs it reads, in stages: (shapes, recipes, seeds, LRs, steps), the LRs
# None for each recipe's sweep, or BEST for the best LR its runs so far found. `table NAME` runs the missing ones, then
# `report` prints every table (the bf16 tables with SWEEP_DTYPE=bf16 SWEEP_ROOT=logs/arch_sweep_bf16, as measured).
BEST = "best"
SWEPT = ["gpt2_adamw_cosine", "gpt2_muon_wsd", "modern_muon_wsd", "modern_noattnbias_muon_wsd",
         "modern_embed1x_muon_wsd"]
MUON_RECIPES = ["gpt2_muon_wsd", "modern_muon_wsd"]
TABLES = {
    "sweeps": [(["4x256", "6x384"], SWEPT, [1337], None, STEPS), (["4x256", "6x384"], SWEPT, [42], BEST, STEPS),
               (["4x256"], ["modern_adamlr_muon_wsd"], [1337], None, STEPS)],
    "tokens4m": [(["4x256"], MUON_RECIPES, SEEDS, BEST, 2 * STEPS - 1)],
    "rows1024": [(["4x256_T1024"], ["gpt2_muon_wsd"], [1337], [0.005, 0.01, 0.02], STEPS),
                 (["4x256_T1024"], ["modern_muon_wsd"], [1337], [0.0025, 0.005, 0.01], STEPS),
                 (["4x256_T1024"], MUON_RECIPES, [42], BEST, STEPS),
                 (["4x256_T1024"], ["modern_muon_wsd"], [1337], BEST, 123)],
    "short_rows1024": [(["4x256_T1024"], ["gpt2_short_rows_muon_wsd", "modern_short_rows_muon_wsd"], SEEDS, None,
                        STEPS), (["4x256_T1024"], ["gpt2_short_rows1024_muon_wsd"], [1337], None, STEPS),
                       (["4x256_T1024"], ["modern_short_rows_muon_wsd"], SEEDS, None, 123)],
    # every ablation: the parts of modern, and the changes of the recipe both Muon recipes share
    "parts": [(["4x256"], [r for r in RECIPES if r not in [*SWEPT, *MUON_RECIPES, "modern_adamlr_muon_wsd"]
                           and "_bos" not in r and "short_rows1024" not in r], SEEDS, None, STEPS)],
}


def table(name: str, jobs: int) -> None:
    """Every run a table of docs/architectures.md reads that is not finished yet, then every table (`report`)."""
    for shapes, recipes, seeds, lrs, steps in TABLES[name]:
        for shape in shapes:
            for recipe in recipes:
                best = best_runs(shape, recipe) if lrs == BEST else None
                run([shape], [recipe], seeds, [best[0]] if best else lrs, steps, jobs)
    report()



def report(out: str = "docs/arch_compare.png") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s in SHAPES if (ROOT / s).is_dir()]
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.5), squeeze=False)
    rows = ["| shape | recipe | best LR | seeds | final val loss | val bpb | steps to today's best final (fraction) "
            "| steps to 2019's final (fraction) |", "|---|---|---|---|---|---|---|---|"]
    for ax, shape in zip(axes[0], shapes):
        print(f"== {shape}: {STEPS} steps of 8,192 tokens")
        best = {recipe: b for recipe in RECIPES if (b := best_runs(shape, recipe))}
        # The final val losses to reach: today's best recipe's, and 2019's.
        finals = [mean_curve(best[r][1], "val_loss")[STEPS - 1] if r in best else None
                  for r in ("gpt2_muon_wsd", "gpt2_adamw_cosine")]
        target = finals[0]
        for i, (recipe, (lr, paths)) in enumerate(best.items()):
            loss, bpb = mean_curve(paths, "val_loss"), mean_curve(paths, "val_bpb")
            fractions = " | ".join("recipe not run" if final is None else steps_and_fraction(loss, final)
                                   for final in finals)
            rows.append(f"| {shape} | {recipe} | {lr:g} | {len(paths)} | {loss[STEPS - 1]:.4f} | "
                        f"{bpb.get(STEPS - 1, float('nan')):.4f} | {fractions} |")
            if recipe not in COMPARED:  # (an ablation: in the table only)
                continue
            steps = sorted(bpb)
            ax.plot(steps, [bpb[s] for s in steps], marker=".", color=f"C{i}", label=f"{recipe}, lr {lr:g}")
        ax.set(title=f"{shape}: enwiki val bpb, best LR of each recipe", xlabel="step (× 8,192 tokens)",
               ylabel="val bits per byte", ylim=(ax.get_ylim()[0], 2.6))  # (from 3.4 at step 0: the ends apart)
        ax.grid(alpha=0.3)
        ax.legend()
        if target is not None:
            shorter_runs(shape, "*_steps*", target, "today's best final")
        with_short_rows(shape, best)
        longer_horizons(shape)
    print("\n".join(rows))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def shorter_runs(shape: str, pattern: str, target: float, name: str) -> None:
    """Runs of fewer than STEPS steps, each planned with its whole schedule: whether each reaches `target`."""
    for path in sorted((ROOT / shape).glob(pattern)):
        steps = int(path.name.rsplit("_steps", 1)[1])
        if steps < STEPS and (val := val_curve(path, steps=steps)) is not None:
            verdict = "reaches" if val[steps - 1] <= target else "does not reach"
            print(f"  {path.name}: {steps} steps ({(steps - 1) / (STEPS - 1):.2f} of the updates), final val loss "
                  f"{val[steps - 1]:.4f}: {verdict} {name} {target:.4f}")


def with_short_rows(shape: str, best: dict[str, tuple[float, list[Path]]]) -> None:
    """Where both Muon recipes ran with the sequence-length schedule (--short_rows): the steps modern with it needs
    to reach GPT-2 + Muon's final with it, and whether modern's shorter runs with it reach that."""
    if not {"gpt2_short_rows_muon_wsd", "modern_short_rows_muon_wsd"} <= set(best):
        return
    target = mean_curve(best["gpt2_short_rows_muon_wsd"][1])[STEPS - 1]
    modern = mean_curve(best["modern_short_rows_muon_wsd"][1])
    print(f"  with the short rows: GPT-2 + Muon's final val loss {target:.4f}, modern's {modern[STEPS - 1]:.4f}, "
          f"modern's steps to GPT-2's {steps_and_fraction(modern, target)} (by seed: " + ", ".join(
              f"{p.name.rsplit('_s', 1)[1]} {steps_and_fraction(val_curve(p), target)}"
              for p in best["modern_short_rows_muon_wsd"][1]) + ")")
    shorter_runs(shape, "modern_short_rows_muon_wsd_*_steps*", target, "GPT-2 + Muon's final with the short rows")


def longer_horizons(shape: str) -> None:
    """Runs longer than STEPS (`run --steps N`, N > STEPS): the fraction of GPT-2 + Muon's steps at which modern
    reaches its final val loss, both at the LRs they ran at, each curve and their seeds' mean; and whether the same
    modern runs of STEPS, each planned with its whole schedule, reach it."""
    horizons = {}
    for path in (ROOT / shape).glob("*_muon_wsd_lr*_s*_steps*"):
        steps = int(path.name.rsplit("_steps", 1)[1])
        if steps > STEPS and val_curve(path, steps=steps) is not None:
            horizons.setdefault(steps, {}).setdefault(path.name.split("_lr")[0], []).append(path)
    for steps, runs in sorted(horizons.items()):
        if not {"gpt2_muon_wsd", "modern_muon_wsd"} <= set(runs):
            continue
        target = mean_curve(runs["gpt2_muon_wsd"], steps=steps)[steps - 1]
        print(f"  {steps} steps: today's best recipe's final val loss {target:.4f} "
              f"({', '.join(p.name for p in sorted(runs['gpt2_muon_wsd']))})")
        modern = sorted(runs["modern_muon_wsd"])
        for name, curve in [(p.name, val_curve(p, steps=steps)) for p in modern] + [
                ("modern's seeds' mean", mean_curve(modern, steps=steps))]:
            print(f"    {name}: final val loss {curve[steps - 1]:.4f}, steps to today's best final "
                  f"{steps_and_fraction(curve, target, steps)}")
        # The direct check: the same modern runs (LR, seed) of STEPS, each with its whole schedule.
        twins = [p.with_name(p.name.removesuffix(f"_steps{steps}")) for p in modern]
        if planned := [p for p in twins if val_curve(p) is not None]:
            final = statistics.fmean(val_curve(p)[STEPS - 1] for p in planned)
            print(f"    modern planned for {STEPS} steps ({(STEPS - 1) / (steps - 1):.2f} of the updates), its seeds' "
                  f"mean: final val loss {final:.4f}: {'reaches' if final <= target else 'does not reach'} it")


def fair_arms(adam_lr: float, muon_lr: float) -> dict[str, tuple[str, float]]:
    """The fair comparison's four arms, each (recipe, Muon LR): GPT-2 + Muon at its best LRs and modern at its own,
    with and without the sequence-length schedule."""
    return {"GPT-2 + Muon": (gpt2_bos_recipe(adam_lr), muon_lr),
            "GPT-2 + Muon, short rows": (gpt2_bos_recipe(adam_lr, "_short_rows"), muon_lr),
            "modern": ("modern_bos_muon_wsd", 0.005), "modern, short rows": ("modern_bos_short_rows_muon_wsd", 0.005)}


def fair(jobs: int) -> None:
    """The fair comparison, every run not yet finished (`jobs` at a time), then its tables: see FAIR_SHAPE."""
    shape, seed = FAIR_SHAPE, FAIR_SEEDS[0]

    def final(recipe: str, lr: float, seeds: list[int] = FAIR_SEEDS[:1], steps: int = STEPS) -> float:
        return statistics.fmean(val_curve(run_dir(shape, recipe, lr, s, steps), steps=steps)[steps - 1] for s in seeds)

    def train_all(runs: list[tuple[str, float, int] | tuple[str, float, int, int]]) -> None:
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(lambda each: train(shape, *each), runs))

    # 1. GPT-2 + Muon's Muon LR; modern's runs alongside, as they need no sweep
    modern_runs = [(f"modern_bos{schedule}_muon_wsd", 0.005, s) for schedule in ("", "_short_rows") for s in FAIR_SEEDS]
    train_all([("gpt2_bos_muon_wsd", lr, seed) for lr in FAIR_MUON_LRS] + modern_runs)
    muon_lr = min(FAIR_MUON_LRS, key=lambda lr: final("gpt2_bos_muon_wsd", lr))
    # 2. its AdamW part at that Muon LR
    adam_lrs = list(FAIR_ADAM_LRS)
    while True:
        train_all([(gpt2_bos_recipe(lr), muon_lr, seed) for lr in adam_lrs])
        adam_lr = min(adam_lrs, key=lambda lr: final(gpt2_bos_recipe(lr), muon_lr))
        if adam_lr not in (adam_lrs[0], adam_lrs[-1]):
            break
        adam_lrs = [adam_lr / 2, *adam_lrs] if adam_lr == adam_lrs[0] else [*adam_lrs, adam_lr * 2]
    # 3. three seeds of GPT-2 + Muon at its best LRs, with and without the schedule; 4. the direct checks
    arms = fair_arms(adam_lr, muon_lr)
    train_all([(*arms[arm], s) for arm in ("GPT-2 + Muon", "GPT-2 + Muon, short rows") for s in FAIR_SEEDS])
    train_all([(*arms[arm], s, FAIR_HALF) for arm in ("modern", "modern, short rows") for s in FAIR_SEEDS])
    fair_report()


def fair_report() -> None:
    """The fair comparison's tables (docs/architectures.md) from the runs finished so far: the sweep, each seed's finals
    and fractions, the architecture's fraction with and without the schedule, the schedule's gain on each arm, the
    direct checks. A run not finished is "not run" (`fair` runs it); a mean is over the seeds finished, named."""
    shape, sweep_seed = FAIR_SHAPE, FAIR_SEEDS[0]

    def final(recipe: str, lr: float, seed: int = sweep_seed, steps: int = STEPS) -> float | None:
        curve = val_curve(run_dir(shape, recipe, lr, seed, steps), steps=steps)
        return None if curve is None else curve[steps - 1]

    def cell(value: float | None) -> str:
        return "not run" if value is None else f"{value:.4f}"

    def best(finals: dict[float, float | None]) -> float | None:
        finished = {lr: f for lr, f in finals.items() if f is not None}
        return min(finished, key=finished.get) if finished else None

    muon_finals = {lr: final("gpt2_bos_muon_wsd", lr) for lr in FAIR_MUON_LRS}
    muon_lr = best(muon_finals) or FAIR_MUON_LRS[1]
    adam_candidates = sorted({*FAIR_ADAM_LRS, *(FAIR_ADAM_LRS[0] / 2 ** k for k in (1, 2)),
                              *(FAIR_ADAM_LRS[-1] * 2 ** k for k in (1, 2))})
    adam_finals = {lr: final(gpt2_bos_recipe(lr), muon_lr) for lr in adam_candidates}
    adam_finals = {lr: f for lr, f in adam_finals.items() if f is not None or lr in FAIR_ADAM_LRS}
    adam_lr = best(adam_finals) or 2e-3
    print(f"== the fair comparison: {shape}, --align_bos on for both arms, {STEPS} steps of 8,192 tokens, {DTYPE}")
    print(f"GPT-2 + Muon, seed {sweep_seed}: --muon_lr at --max_lr 2e-3: "
          + " · ".join(f"{lr:g}: {cell(f)}" for lr, f in muon_finals.items()) + f"; --max_lr at --muon_lr {muon_lr:g}: "
          + " · ".join(f"{lr:g}: {cell(f)}" for lr, f in adam_finals.items())
          + f"; best --muon_lr {muon_lr:g}, --max_lr {adam_lr:g}")
    arms = fair_arms(adam_lr, muon_lr)
    curves = {arm: {seed: val_curve(run_dir(shape, *arms[arm], seed)) for seed in FAIR_SEEDS} for arm in arms}
    finished = {arm: {seed: c for seed, c in by_seed.items() if c is not None} for arm, by_seed in curves.items()}
    means = {arm: {step: statistics.fmean(c[step] for c in by_seed.values()) for step in next(iter(by_seed.values()))}
             if by_seed else None for arm, by_seed in finished.items()}
    pairs = [("modern", "GPT-2 + Muon"), ("modern, short rows", "GPT-2 + Muon, short rows"),
             ("modern, short rows", "GPT-2 + Muon")]
    rows = ["| seed | " + " | ".join(arms) + " | modern's steps to GPT-2 + Muon's final (fraction of 244) | with "
            "the schedule, both arms | modern, short rows, to GPT-2 + Muon's final without it |",
            "|---|" + "---|" * (len(arms) + 3)]
    seeds_of_means = {arm: ", ".join(map(str, by_seed)) for arm, by_seed in finished.items()}
    for seed, by_arm in [*((seed, {arm: curves[arm][seed] for arm in arms}) for seed in FAIR_SEEDS),
                         ("mean (seeds: " + "; ".join(f"{arm} {s or 'none'}" for arm, s in seeds_of_means.items())
                          + ")", means)]:
        rows.append(f"| {seed} | " + " | ".join(cell(c and c[STEPS - 1]) for c in by_arm.values()) + " | " + " | ".join(
            "not run" if by_arm[modern] is None or by_arm[gpt2] is None else
            steps_and_fraction(by_arm[modern], by_arm[gpt2][STEPS - 1]) for modern, gpt2 in pairs) + " |")
    print("\n".join(rows))
    print("Against the seeds' mean final (the headline's reading): " + "; ".join(
        f"{modern} to {gpt2}: " + ", ".join(f"seed {seed} {steps_and_fraction(curve, means[gpt2][STEPS - 1])}"
                                            for seed, curve in finished[modern].items())
        for modern, gpt2 in pairs[:2] if means[gpt2] is not None))
    gains = {arch: [curves[arch][s][STEPS - 1] - curves[f"{arch}, short rows"][s][STEPS - 1] for s in FAIR_SEEDS
                    if curves[arch][s] is not None and curves[f"{arch}, short rows"][s] is not None]
             for arch in ("GPT-2 + Muon", "modern")}
    print("The schedule's gain in final val loss, by seed run with and without it: " + "; ".join(
        f"{arch} " + (", ".join(f"{g:+.4f}" for g in by_seed) + f" (mean {statistics.fmean(by_seed):+.4f})"
                      if by_seed else "not run") for arch, by_seed in gains.items())
        + ("; the interaction (modern's gain less GPT-2's): "
           f"{statistics.fmean(gains['modern']) - statistics.fmean(gains['GPT-2 + Muon']):+.4f}" if all(gains.values())
           else ""))
    for arm, gpt2 in pairs[:2]:
        halves = {seed: final(*arms[arm], seed, FAIR_HALF) for seed in FAIR_SEEDS}
        if means[gpt2] is None or all(h is None for h in halves.values()):
            print(f"The direct check, {arm} planned for {FAIR_HALF} steps: not run")
            continue
        target = means[gpt2][STEPS - 1]
        print(f"The direct check: {arm} planned for {FAIR_HALF} steps ends at " + ", ".join(
            f"{cell(h)} (seed {seed}{'' if h is None else ': reaches' if h <= target else ': does not reach'})"
            for seed, h in halves.items()) + f" against {gpt2}'s mean final {target:.4f}")


def heldout(recipes: list[str]) -> None:
    """The val loss and bpb, on each held-out text, of every best-LR run of these recipes that kept its final
    snapshot."""
    texts = {}
    for name, source in HELDOUT.items():  # each text whole as the val split (the train split is not read)
        texts[name] = Path("data") / f"heldout_{name}"
        if not texts[name].is_dir():
            subprocess.run([sys.executable, "-m", "data.prepare", "--input", str(SHARED_DATA / source), "--val_input",
                            str(SHARED_DATA / source), "--output_dir", str(texts[name])], check=True)
    header = " | ".join(f"{name} loss | {name} bpb" for name in texts)
    rows = [f"| shape | recipe | LR | seed | enwiki val loss | {header} |",
            "|---|---|---|---|---|" + "---|---|" * len(texts)]
    for shape in SHAPES:
        for recipe in recipes:
            # (a patched model is neither architecture, so tools.evaluate cannot read its snapshot)
            if patches_model(recipe) or (best := best_runs(shape, recipe)) is None:
                continue
            lr, paths = best
            for path in paths:
                if not (snapshots := sorted(path.glob("snapshot_*.pt"))):
                    continue
                scores = []
                for data_dir in texts.values():
                    out = subprocess.run([sys.executable, "-m", "tools.evaluate", "--snapshot", str(snapshots[-1]),
                                          "--data_dir", str(data_dir), "--val_tokens", str(HELDOUT_TOKENS), "--json"],
                                         check=True, capture_output=True, text=True).stdout
                    result = json.loads(out.strip().splitlines()[-1])
                    scores.append(f"{result['val_loss']:.4f} | {result['val_bpb']:.4f}")
                seed = path.name.rsplit("_s", 1)[1]
                rows.append(f"| {shape} | {recipe} | {lr:g} | {seed} | {val_curve(path)[STEPS - 1]:.4f} | "
                            + " | ".join(scores) + " |")
    print("\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "report", "heldout", "fair", "fair_report", "table"))
    parser.add_argument("table", nargs="?", choices=TABLES, help="table: which table of docs/architectures.md")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--lrs", help="only these LRs (comma-separated), instead of each recipe's sweep")
    parser.add_argument("--steps", type=int, default=STEPS,
                        help="a shorter or longer run (its schedules scaled with it)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    args = parser.parse_args()
    if args.command == "fair":
        return fair(args.jobs)
    if args.command == "fair_report":
        return fair_report()
    if args.command == "table":
        return table(args.table, args.jobs)
    if args.command == "report":
        return report()
    if args.command == "heldout":
        return heldout(args.recipes.split(","))
    run(args.shapes.split(","), args.recipes.split(","), [int(s) for s in args.seeds.split(",")],
        [float(x) for x in args.lrs.split(",")] if args.lrs else None, args.steps, args.jobs)


if __name__ == "__main__":
    main()
