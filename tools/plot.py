"""Plot training runs from their metrics.jsonl files: loss, val bits per byte, HellaSwag accuracy, the zero-shot
eval_score and learning rate against step.

    python -m tools.plot logs/run_a/metrics.jsonl logs/run_b/metrics.jsonl --out runs.png

Each run is one labelled line per panel, named after its folder (or after the file, when it is not called
metrics.jsonl). GPT-2 124M's scores are drawn as dashed reference lines: val loss 3.2924 on FineWeb-Edu and
HellaSwag acc_norm 0.3114 (lm-evaluation-harness's, as evals.py scores it); runs written before evals.py logged
hellaswag_acc, scored completion style as llm.c and build-nanogpt do (GPT-2 124M: 0.2955), drawn dotted beside it.

metrics.jsonl holds one JSON object per line, written by train_gpt2.py: training steps ("loss", "lr", ...),
validation ("val_loss", "val_bpb"), the zero-shot tasks ("hellaswag/acc_norm", ..., "eval_score"; older runs:
"hellaswag_acc"), and events such as {"event": "resume", ...},
which are skipped, as are null losses (a step whose update was skipped for a NaN). After a crash and resume, the
steps between the last snapshot and the crash are trained and logged a second time; the LATER line for a step wins,
because it belongs to the run that continued. A line that is not such an object (a run killed mid-write leaves half
a line; a step that is not a whole number, a metric that is not a number) is skipped, and the number skipped said
once per file. A file with no metrics line left is an error (exit status 2): nothing of it could be drawn, and a
plot without a run that was asked for would mislead.
"""

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # render to a file; no display needed
import matplotlib.pyplot as plt

from training.metrics_log import read_metrics

GPT2_124M_VAL_LOSS = 3.2924
GPT2_124M_HELLASWAG = 0.3114  # acc_norm, lm-evaluation-harness
GPT2_124M_HELLASWAG_COMPLETION = 0.2955  # acc_norm, completion style (llm.c, build-nanogpt; runs before evals.py)


def read_run(path: str | Path) -> dict[str, dict[int, float]]:
    """read_metrics, saying once on stderr how many lines were skipped; ValueError if no metrics line is left."""
    series, skipped = read_metrics(path)
    if skipped:
        print(f"{path}: skipped {len(skipped)} broken line(s), the first {skipped[0]} (a run killed mid-write "
              "leaves half a line)", file=sys.stderr)
    if not any(series.values()):
        broken = f" ({len(skipped)} broken line(s), the first {skipped[0]})" if skipped else ""
        raise ValueError(f"{path} holds no metrics to plot{broken}. Pass the metrics.jsonl that train_gpt2.py writes "
                         "into its log dir.")
    return series


def run_label(path: str | Path) -> str:
    path = Path(path).resolve()
    return path.parent.name if path.stem == "metrics" else path.stem


def summary(label: str, series: dict[str, dict[int, float]]) -> str:
    parts = [f"{label}: {len(series['loss'])} train steps"]
    if series["val_loss"]:
        parts.append(f"min val loss {min(series['val_loss'].values()):.4f}")
    if series["val_bpb"]:
        parts.append(f"min val bpb {min(series['val_bpb'].values()):.4f}")
    if series["hellaswag/acc_norm"]:
        parts.append(f"max HellaSwag acc_norm {max(series['hellaswag/acc_norm'].values()):.4f}")
    if series["hellaswag_acc"]:
        parts.append(f"max HellaSwag (completion style) {max(series['hellaswag_acc'].values()):.4f}")
    if series["eval_score"]:
        parts.append(f"max eval_score {max(series['eval_score'].values()):.4f}")
    return ", ".join(parts)


def plot_runs(paths: list[str | Path], out: str | Path) -> None:
    fig, (ax_loss, ax_bpb, ax_hella, ax_score, ax_lr) = plt.subplots(1, 5, figsize=(30, 5))
    runs = [(read_run(path), run_label(path)) for path in paths]
    for i, (series, label) in enumerate(runs):
        color = f"C{i}"
        # Train loss is noisy and dense, so it is faint; val loss, measured on fixed held-out data, is the headline.
        for ax, name, style in ((ax_loss, "loss", dict(alpha=0.35, lw=0.8, label=f"{label} train")),
                                (ax_loss, "val_loss", dict(marker=".", label=f"{label} val")),
                                (ax_bpb, "val_bpb", dict(marker=".", label=label)),
                                (ax_hella, "hellaswag/acc_norm", dict(marker=".", label=label)),
                                (ax_hella, "hellaswag_acc", dict(marker=".", ls=":", label=f"{label} (completion)")),
                                (ax_score, "eval_score", dict(marker=".", label=label)),
                                (ax_lr, "lr", dict(label=label))):
            steps = sorted(series[name])
            if steps:
                ax.plot(steps, [series[name][s] for s in steps], color=color, **style)
        print(summary(label, series))

    ax_loss.axhline(GPT2_124M_VAL_LOSS, color="k", ls="--", lw=1, label=f"GPT-2 124M val ({GPT2_124M_VAL_LOSS})")
    ax_hella.axhline(GPT2_124M_HELLASWAG, color="k", ls="--", lw=1, label=f"GPT-2 124M ({GPT2_124M_HELLASWAG})")
    if any(series["hellaswag_acc"] for series, _ in runs):
        ax_hella.axhline(GPT2_124M_HELLASWAG_COMPLETION, color="k", ls=":", lw=1,
                         label=f"GPT-2 124M, completion style ({GPT2_124M_HELLASWAG_COMPLETION})")
    for ax, title in ((ax_loss, "loss"), (ax_bpb, "val bits per byte (comparable across tokenizers)"),
                      (ax_hella, "HellaSwag accuracy (acc_norm)"),
                      (ax_score, "eval_score (zero-shot accuracy centred on chance)"), (ax_lr, "learning rate")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel with nothing logged (no val_bpb offline, say) stays empty
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files written by train_gpt2.py, one per run")
    parser.add_argument("--out", default="plot.png", help="PNG file to write")
    args = parser.parse_args(argv)
    for path in args.metrics:
        if not Path(path).is_file():
            parser.error(f"{path}: no such file. Pass the metrics.jsonl that train_gpt2.py writes into its log dir.")
    if not Path(args.out).parent.is_dir():
        parser.error(f"--out {args.out}: no directory {Path(args.out).parent} to write it in. Create it, or pass "
                     "another path.")
    try:
        plot_runs(args.metrics, args.out)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
