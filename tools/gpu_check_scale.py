"""How large a tools/gpu_check.py run is (not a command): its scale on a GPU and under --cpu-smoke."""

from dataclasses import dataclass

from config import TrainConfig


@dataclass(frozen=True)
class Scale:
    """The sizes of a check run: GPT-2 on a GPU, or the tiny preset on the CPU (--cpu-smoke)."""
    device: str
    dtype: str
    model: str  # of the bench and train stages
    seq_len: int
    compile: bool  # compiled runs in bench and train (minutes on a CPU, so not in the smoke run)
    stage_seconds: int  # each stage's budget
    # bench
    bench_sequences: int  # the batch --micro_batch_size auto fits a divisor of: the 124M recipe's 512 sequences
    bench_steps: int
    bench_warmup: int
    bench_larger: tuple[str, ...]  # benched too (compiled) while the stage has half its budget left
    mfu_floor: float  # the compiled bench and the train run reach this at least (0: not judged, as on a CPU)
    # ours against the full-logits loss: micro-batch, micro-steps, timed steps after warm-up steps, rounds
    vs_full_logits: tuple[int, int, int, int, int]
    # issue 30's goal for that comparison: at least this speed ratio, at most this memory ratio, at least this MFU;
    # None: not judged (a CPU)
    vs_full_logits_goal: tuple[float, float, float] | None
    generation_floor: float  # tokens/s of cached generation (124M, batch 1) at least
    # train
    train_steps: int
    train_batch: int  # tokens per optimizer step
    max_lr: float
    eval_every: int  # validation, HellaSwag and samples
    val_tokens: int
    hellaswag_limit: int
    hellaswag_range: tuple[float, float]  # acc_norm of an early model: about chance (0.25), on this many examples
    loss_drop: float  # the last 10 steps' mean loss lies this far below step 0's at least



GPU = Scale(device="cuda", dtype="bf16", model="gpt2", seq_len=1024, compile=True, stage_seconds=480,
            bench_sequences=512, bench_steps=10, bench_warmup=3, bench_larger=("gpt2-medium", "gpt2-large"),
            mfu_floor=0.30, vs_full_logits=(64, 8, 5, 2, 2), vs_full_logits_goal=(1.15, 0.75, 0.45),
            generation_floor=5 * 168, train_steps=300, train_batch=131_072, max_lr=TrainConfig.max_lr, eval_every=100,
            val_tokens=1_048_576, hellaswag_limit=500, hellaswag_range=(0.15, 0.60), loss_drop=3.0)


CPU_SMOKE = Scale(device="cpu", dtype="fp32", model="tiny", seq_len=32, compile=False, stage_seconds=600,
                  bench_sequences=8, bench_steps=2, bench_warmup=1, bench_larger=(), mfu_floor=0.0,
                  vs_full_logits=(2, 2, 2, 1, 1), vs_full_logits_goal=None, generation_floor=0.0,
                  train_steps=30, train_batch=256, max_lr=3e-3, eval_every=10, val_tokens=1024, hellaswag_limit=20,
                  hellaswag_range=(0.0, 1.0), loss_drop=1.0)
