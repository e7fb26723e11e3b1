"""The memory budget of tools/bench.py's report and its --plan (not a command): the model's state, its activations
per sequence measured on this device, and the largest micro-batch that fits a card, for GPT-2's sizes under ddp and
fsdp with each --activation_checkpointing."""

from dataclasses import replace

import torch

from model import GPT, PRESETS, GPTConfig
from tools.bench.step import Workload
from training.memory import (
    GiB,
    MiB,
    fixed_bytes,
    largest_micro_batch,
    measure_activation_bytes_per_sequence,
    state_bytes,
)
from training.recompute import ACTIVATION_CHECKPOINTING

# --plan: GPT-2's sizes, on this many cards each, at GPT-2's recipe
PLAN_MODELS = {"124M": "gpt2", "350M": "gpt2-medium", "774M": "gpt2-large", "1.5B": "gpt2-xl"}
PLAN_CARDS = (1, 2, 4, 8)


def memory_budget(work: Workload, dtype: torch.dtype, memory_gb: list[float]) -> dict:
    """The model's state bytes, its measured activation bytes per sequence (on the CPU unless on CUDA), and the
    largest micro-batch that fits each of memory_gb GiB: a power of two dividing GPT-2's 512-sequence batch of
    1,024 tokens, or 0 if not even one sequence fits."""
    device = work.dist_env.device if work.dist_env.device.type == "cuda" else torch.device("cpu")
    config, seq_len = work.plan.model_config, work.plan.seq_len
    per_sequence = measure_activation_bytes_per_sequence(config, seq_len, dtype, device,
                                                         activation_checkpointing=work.cfg.activation_checkpointing)
    with torch.device("meta"):
        state = state_bytes(GPT(config))
    largest = {}
    for gb in memory_gb:
        try:
            largest[f"{gb:g}"] = largest_micro_batch(int(gb * GiB), state, per_sequence, 512).size
        except ValueError:
            largest[f"{gb:g}"] = 0
    return {"state_bytes": state, "activation_bytes_per_sequence": per_sequence, "largest_micro_batch": largest}


def activation_bytes_per_sequence_from_two_depths(config: GPTConfig, seq_len: int, dtype: torch.dtype,
                                                  device: torch.device, activation_checkpointing: str) -> int:
    """measure_activation_bytes_per_sequence of config's whole depth, from models of 1 and 2 of its layers: every
    block keeps the same tensors, so the figure grows by the same amount per layer on top of what the embeddings and
    the loss keep. (Measuring GPT-2 1.5B whole would take a CPU minutes per mode, and more memory than it has.)"""
    one, two = (measure_activation_bytes_per_sequence(replace(config, n_layer=n), seq_len, dtype, device,
                                                      activation_checkpointing=activation_checkpointing)
                for n in (1, 2))
    return one + (config.n_layer - 1) * (two - one)


def plan_micro_batches(config: GPTConfig, bytes_per_sequence: dict[str, int], memory_bytes: int, cards: int,
                       seq_len: int, total_batch_size: int, dtype: torch.dtype) -> dict[tuple[str, str], int]:
    """For `cards` cards of memory_bytes each, {(parallel, activation checkpointing): the largest micro-batch that
    fits a card next to what it holds under that parallelism (fixed_bytes), or 0 if not even one sequence does}, from
    the activations per sequence of each checkpointing mode."""
    rank_sequences = total_batch_size // (seq_len * cards)
    fits = {}
    for parallel in ("ddp", "fsdp"):
        fixed = fixed_bytes(config, cards, parallel, dtype)
        for mode, per_sequence in bytes_per_sequence.items():
            try:
                fits[parallel, mode] = largest_micro_batch(memory_bytes, fixed, per_sequence, rank_sequences).size
            except ValueError:  # one sequence does not fit
                fits[parallel, mode] = 0
    return fits


def memory_plan(memory_gb: list[float], device: torch.device, models: dict[str, GPTConfig] | None = None,
                seq_len: int = 1024, total_batch_size: int = 524_288) -> dict:
    """--plan (see the module doc): GPT-2's sizes unless `models`, at its recipe's sequence length and batch."""
    device = device if device.type == "cuda" else torch.device("cpu")
    models = models or {name: PRESETS[preset] for name, preset in PLAN_MODELS.items()}
    per_sequence = {name: {mode: activation_bytes_per_sequence_from_two_depths(config, seq_len, torch.bfloat16, device,
                                                                               mode)
                           for mode in ACTIVATION_CHECKPOINTING} for name, config in models.items()}
    micro_batch = {}
    for gb in memory_gb:
        micro_batch[f"{gb:g}"] = by_model = {}
        for name, config in models.items():
            by_model[name] = {}
            for cards in PLAN_CARDS:
                fits = plan_micro_batches(config, per_sequence[name], int(gb * GiB), cards, seq_len, total_batch_size,
                                          torch.bfloat16)
                by_model[name][cards] = {f"{parallel} {mode}": size for (parallel, mode), size in fits.items()}
    return {"device": str(device), "seq_len": seq_len, "total_batch_size": total_batch_size,
            "activation_bytes_per_sequence": per_sequence, "micro_batch": micro_batch}


def format_plan(plan: dict) -> str:
    """--plan's tables, in Markdown (the README's are these)."""
    columns = [f"{parallel} {mode}" for parallel in ("ddp", "fsdp") for mode in ACTIVATION_CHECKPOINTING]
    lines = [f"activations per sequence of {plan['seq_len']:,} tokens, bf16, measured on {plan['device']}, "
             f"{' / '.join(ACTIVATION_CHECKPOINTING)}: " + "; ".join(
                 f"{name} " + " / ".join(f"{b / MiB:,.0f}" for b in modes.values()) + " MiB"
                 for name, modes in plan["activation_bytes_per_sequence"].items())]
    for gb, models in plan["micro_batch"].items():
        lines += ["", f"{gb} GiB per card: the largest micro-batch that fits ({plan['total_batch_size']:,} tokens "
                      "per step, AdamW; -: not even one sequence fits)", "",
                  "| model | cards | " + " | ".join(c.replace(" none", "").replace(" ", " + ") for c in columns)
                  + " |", "|---|---:|" + "---:|" * len(columns)]
        for name, by_cards in models.items():
            for cards, sizes in by_cards.items():
                lines.append(f"| {name} | {cards} | " + " | ".join(str(sizes[c] or "-") for c in columns) + " |")
    return "\n".join(lines)
