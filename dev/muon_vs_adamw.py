"""AdamW vs Muon on Tiny Shakespeare: an LR sweep per optimizer and shape, same steps, data order and schedule.

    python -m data.prepare --source shakespeare
    OMP_NUM_THREADS=1 python -m dev.muon_vs_adamw run     # trains every configuration not yet finished, in turn
    SWEEP_SHAPES=narrow6 python -m dev.muon_vs_adamw run  # one shape (run two shapes side by side on 2 cores)
    python -m dev.muon_vs_adamw report                    # best of each, the steps Muon needs, the PNG
    OMP_NUM_THREADS=1 python -m dev.muon_vs_adamw all     # both: docs/optimizers.md's table in one command
    SWEEP_DTYPE=fp32 SWEEP_ROOT=logs/sweep_fp32 python -m dev.muon_vs_adamw run   # fp32, where bf16 is emulated

Muon's AdamW part (embeddings, biases, LayerNorms) runs at the --max_lr that the AdamW sweep of the same shape found
best, so the Muon sweep varies --muon_lr alone: four LRs each. docs/optimizers.md has the results.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from dev.curves import steps_to_reach
from training.metrics_log import read_metrics

ROOT = Path(os.environ.get("SWEEP_ROOT", "logs/sweep"))
STEPS = {"small": 120, "narrow6": 120}
# bf16 autocast, as the README's tables were measured (a CPU with AMX), unless SWEEP_DTYPE says otherwise: `auto`
# would pick fp32 on a CPU without native bf16, where bf16 is emulated and slow.
DTYPE = os.environ.get("SWEEP_DTYPE", "bf16")
COMMON = ["--dtype", DTYPE, "--data_dir", "data/shakespeare", "--total_batch_size", "1024", "--min_lr_ratio", "0.1",
          "--val_every", "20", "--val_tokens", "8192", "--eval_every", "0", "--sample_every", "0",
          "--snapshot_every", "0", "--resume", "never", "--seed", "1337"]
SHAPES = {
    "small": ["--model", "small", "--micro_batch_size", "4", "--seq_len", "256"],  # the quickstart model
    "narrow6": ["--model", "small", "--n_layer", "6", "--n_embd", "128", "--n_head", "4", "--block_size", "128",
                "--micro_batch_size", "8"],
}
# Four LRs each: three first, then one more past the edge where the best of the three was (0.5e-3 for AdamW, whose
# best was 1e-3 on both shapes; 0.005 for Muon, whose best was 0.01).
ADAMW_LRS = [5e-4, 1e-3, 2e-3, 4e-3]
MUON_LRS = [0.005, 0.01, 0.02, 0.04]


def run_dir(shape, name):
    return ROOT / shape / name


def final_val(shape, name):
    path = run_dir(shape, name) / "metrics.jsonl"
    if not path.exists():
        return None
    val = read_metrics(path)[0]["val_loss"]
    return val.get(STEPS[shape] - 1)


def train(shape, name, flags):
    if final_val(shape, name) is not None:
        return
    out = run_dir(shape, name)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stdout.txt", "w") as f:
        steps = ["--max_steps", str(STEPS[shape]), "--warmup_steps", str(STEPS[shape] // 10)]
        subprocess.run([sys.executable, "train_gpt2.py", *COMMON, *steps, *SHAPES[shape], "--log_dir", str(out),
                        *flags],
                       stdout=f, stderr=subprocess.STDOUT, check=True)


def best(shape, prefix):
    done = {p.name: final_val(shape, p.name) for p in (ROOT / shape).glob(prefix + "*")}
    done = {k: v for k, v in done.items() if v is not None}
    return min(done, key=done.get) if done else None


def run():
    for shape in os.environ.get("SWEEP_SHAPES", ",".join(SHAPES)).split(","):
        for lr in ADAMW_LRS:
            train(shape, f"adamw_lr{lr:g}", ["--optimizer", "adamw", "--max_lr", str(lr)])
        # Muon's embeddings, head, biases and LayerNorms are AdamW's: at the LR the AdamW sweep found best.
        adamw_lr = best(shape, "adamw").removeprefix("adamw_lr")
        for lr in MUON_LRS:
            train(shape, f"muon_lr{lr:g}", ["--optimizer", "muon", "--muon_lr", str(lr), "--max_lr", adamw_lr])


def median_step_ms(shape, name):
    ms = sorted(r["dt_ms"] for r in read_records(run_dir(shape, name) / "metrics.jsonl") if "dt_ms" in r)
    return ms[len(ms) // 2]


def read_records(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def report(out="docs/muon_vs_adamw.png"):
    """The val loss logged at step s is that of the weights after s updates, so the last one (step STEPS-1) is
    after STEPS-1 updates: Muon's fraction is the updates it needs to reach it over those."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(SHAPES), figsize=(6.5 * len(SHAPES), 4.5))
    for ax, shape in zip(axes, SHAPES):
        print(f"== {shape}: {STEPS[shape]} steps")
        for p in sorted((ROOT / shape).iterdir()):
            v = final_val(shape, p.name)
            print(f"  {p.name:16s} final val loss {v:.4f}, {median_step_ms(shape, p.name):.0f} ms/step (median)"
                  if v else f"  {p.name:16s} unfinished")
        a, m = best(shape, "adamw"), best(shape, "muon")
        va = read_metrics(run_dir(shape, a) / "metrics.jsonl")[0]["val_loss"]
        vm = read_metrics(run_dir(shape, m) / "metrics.jsonl")[0]["val_loss"]
        updates = STEPS[shape] - 1
        target = va[updates]
        reach = steps_to_reach(vm, target)
        fraction = "not reached" if reach is None else f"{reach:.1f} updates, {reach / updates:.3f} of {updates}"
        print(f"  best AdamW {a}: {target:.4f}; best Muon {m}: {vm[updates]:.4f}; Muon reaches {target:.4f} in "
              f"{fraction}")
        for name, val, color in ((a, va, "C0"), (m, vm, "C3")):
            steps = sorted(val)
            ax.plot(steps, [val[s] for s in steps], marker=".", color=color, label=name.replace("_lr", ", lr "))
        ax.axhline(target, color="gray", ls=":", lw=0.8, label="best AdamW's final val loss")
        low = min(min(va.values()), min(vm.values()))
        ax.set(title=f"{shape}: val loss, the best of 4 LRs each", xlabel="step", ylabel="val loss",
               ylim=(low - 0.1, low + 2.0))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    {"run": run, "report": report, "all": lambda: (run(), report())}[sys.argv[1]]()
