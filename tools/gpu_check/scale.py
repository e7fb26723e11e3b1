"""How large a tools/gpu_check.py run is (not a command): its scale on a GPU and under --cpu-smoke."""

from dataclasses import dataclass

from training.config import TrainConfig


@dataclass(frozen=True)
class PerfGoal:
    """Issue 52's goal, on one H100 or H200 against the full-logits baseline in the same process."""
    speed: float = 1.08  # bf16, equal math: at least this times the baseline's tokens/s
    memory: float = 1.0  # at most this times its peak memory
    mfu: float = 0.47  # of the datasheet peak, at least
    fp8_speed: float = 1.15  # with --fp8_head: at least this times the baseline's tokens/s
    fp8_val_loss: float = 0.01  # and a short run's val loss within this of bf16's
    muon: float = 0.95  # Muon's tokens/s at least this times AdamW's
    modern: float = 1.02  # --arch modern's step at most this times GPT-2's
    kernel_losses: float = 0.01  # another attention kernel's losses within this of the default's, step by step


@dataclass(frozen=True)
class PerfScale:
    """The perf stage's sizes (tools/gpu_check_perf.py)."""
    seconds: int  # the stage's budget: a row that would not fit what is left is reported as not run
    step: tuple[int, int, int, int, int]  # micro-batch, micro-steps, timed steps, warm-up steps, rounds
    goal: PerfGoal | None  # None: not judged (a CPU)
    # the short runs with and without --fp8_head: micro-batch (one micro-step a step), steps, max LR, warm-up steps,
    # val tokens
    short_run: tuple[int, int, float, int, int]
    loss_memory: tuple[int, int]  # the loss alone: tokens, tokens per chunk
    compile_mode: str  # timed against torch.compile's default, in a subprocess cut at the time left
    # What each row takes, to skip one that would not fit the time left: (the step's graphs it compiles anew, seconds
    # besides), a compilation costing compile_seconds until the first row has measured one
    row_costs: dict[str, tuple[int, int]]
    compile_seconds: int


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
    perf: PerfScale


# The perf rows' costs on an H100/H200 (GPT-2 124M, B=64 × 8 micro-steps: a step 1.0-1.1 s, a micro-step 0.13 s;
# the leases' bench stages compiled a graph in about 25 s on average, those Inductor's cache held included).
GPU_ROW_COSTS = {"vs_full_logits": (2, 60), "fp8_speed": (1, 10), "fp8_val_loss": (0, 70), "attention": (1, 10),
                 "loss_memory": (0, 45), "muon": (0, 25), "modern": (1, 10),
                 "compile_mode": (1, 30)}

GPU = Scale(device="cuda", dtype="bf16", model="gpt2", seq_len=1024, compile=True, stage_seconds=480,
            bench_sequences=512, bench_steps=10, bench_warmup=3, bench_larger=("gpt2-medium", "gpt2-large"),
            mfu_floor=0.30, vs_full_logits=(64, 8, 5, 2, 2), vs_full_logits_goal=(1.15, 0.75, 0.45),
            generation_floor=5 * 168, train_steps=300, train_batch=131_072, max_lr=TrainConfig.max_lr, eval_every=100,
            val_tokens=1_048_576, hellaswag_limit=500, hellaswag_range=(0.15, 0.60), loss_drop=3.0,
            perf=PerfScale(seconds=540, step=(64, 8, 3, 2, 2), goal=PerfGoal(),
                           short_run=(64, 100, 1e-3, 10, 458_752), loss_memory=(65_536, 4096),
                           compile_mode="max-autotune-no-cudagraphs", row_costs=GPU_ROW_COSTS, compile_seconds=45))

CPU_SMOKE = Scale(device="cpu", dtype="fp32", model="tiny", seq_len=32, compile=False, stage_seconds=600,
                  bench_sequences=8, bench_steps=2, bench_warmup=1, bench_larger=(), mfu_floor=0.0,
                  vs_full_logits=(2, 2, 2, 1, 1), vs_full_logits_goal=None, generation_floor=0.0,
                  train_steps=30, train_batch=256, max_lr=3e-3, eval_every=10, val_tokens=1024, hellaswag_limit=20,
                  hellaswag_range=(0.0, 1.0), loss_drop=1.0,
                  perf=PerfScale(seconds=900, step=(2, 2, 1, 1, 1), goal=None, short_run=(2, 8, 3e-3, 2, 128),
                                 loss_memory=(256, 64), compile_mode="default", row_costs={}, compile_seconds=0))
