"""AdamW vs Muon on Tiny Shakespeare: an LR sweep per optimizer and shape, same steps, data order and schedule.

    python sweeps/muon_sweep.py run      # trains every configuration not yet finished (sequentially)
    python sweeps/muon_sweep.py report   # best of each, the steps Muon needs, docs/muon_vs_adamw.png
"""
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plot import read_metrics  # noqa: E402

ROOT = Path(os.environ.get("SWEEP_ROOT", "logs/sweep"))
STEPS = {"small": 200, "narrow6": 150}
COMMON = ["--data_dir", "data/shakespeare", "--total_batch_size", "2048", "--min_lr_ratio", "0.1", "--val_every", "25",
          "--val_tokens", "16384",
          "--hellaswag_every", "0", "--sample_every", "0", "--ckpt_every", "0", "--resume", "never", "--seed", "1337"]
SHAPES = {
    "small": ["--model", "small", "--micro_batch_size", "8", "--seq_len", "256"],  # the quickstart model
    "narrow6": ["--model", "small", "--n_layer", "6", "--n_embd", "128", "--n_head", "4", "--block_size", "128",
                "--micro_batch_size", "16"],
}
ADAMW_LRS = [1e-3, 2e-3, 4e-3]
MUON_LRS = [0.01, 0.02, 0.04]


def run_dir(shape, name):
    return ROOT / shape / name


def final_val(shape, name):
    path = run_dir(shape, name) / "metrics.jsonl"
    if not path.exists():
        return None
    val = read_metrics(path)["val_loss"]
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


def steps_to_reach(val: dict[int, float], target: float) -> float | None:
    """The first step at which the val curve (linearly interpolated between evaluations) is at or below target."""
    points = sorted(val.items())
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if v1 <= target:
            return s0 + (v0 - target) / (v0 - v1) * (s1 - s0) if v0 > target else s0
    return None


def mean_step_ms(shape, name):
    ms = [json.loads(line)["dt_ms"] for line in open(run_dir(shape, name) / "metrics.jsonl") if '"dt_ms"' in line]
    ms = sorted(ms[5:])
    return ms[len(ms) // 2]


def report(out="docs/muon_vs_adamw.png"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(SHAPES), figsize=(7 * len(SHAPES), 4.5))
    for ax, shape in zip(axes, SHAPES):
        print(f"== {shape}")
        for p in sorted((ROOT / shape).iterdir()):
            v = final_val(shape, p.name)
            print(f"  {p.name:16s} final val {v if v is None else round(v, 4)}"
                  + (f"  {mean_step_ms(shape, p.name):.0f} ms/step" if v else ""))
        a, m = best(shape, "adamw"), best(shape, "muon")
        va = read_metrics(run_dir(shape, a) / "metrics.jsonl")["val_loss"]
        vm = read_metrics(run_dir(shape, m) / "metrics.jsonl")["val_loss"]
        target = va[STEPS[shape] - 1]
        reach = steps_to_reach(vm, target)
        frac = None if reach is None else (reach + 1) / STEPS[shape]
        print(f"  best AdamW {a} {target:.4f}; best Muon {m} {vm[STEPS[shape] - 1]:.4f}; Muon reaches {target:.4f} "
              "at step "
              f"{reach if reach is None else round(reach, 1)} -> fraction {frac if frac is None else round(frac, 3)}")
        for name, val, color in ((a, va, "C0"), (m, vm, "C3")):
            steps = sorted(val)
            ax.plot(steps, [val[s] for s in steps], marker=".", color=color, label=name.replace("_lr", ", lr "))
        ax.axhline(target, color="gray", ls=":", lw=0.8)
        ax.set(title=f"{shape}: val loss, best of 3 LRs each", xlabel="step", ylabel="val loss",
               ylim=(min(min(va.values()), min(vm.values())) - 0.1, min(va.values()) + 2.5))
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    {"run": run, "report": report}[sys.argv[1]]()
