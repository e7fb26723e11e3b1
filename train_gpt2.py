"""Pretrain GPT-2.

    torchrun --standalone --nproc_per_node=2 train_gpt2.py     # 2 GPUs (NCCL), or 2 CPU processes (gloo)
    python train_gpt2.py --model small --data_dir data/shakespeare   # one GPU, Apple MPS or CPU

The defaults reproduce GPT-2 124M on FineWeb-Edu 10B (524,288-token batches, 19,073 steps). The story of a run:
set up the processes and the device, build the data loaders and the model, resume from the newest snapshot if
there is one, then loop {validate, evaluate HellaSwag, sample, train one step, log, snapshot}.
"""

import argparse
import contextlib
import math
import os
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import capture_rng_state, find_latest_snapshot, list_snapshots, load_snapshot, prune_snapshots
from checkpoint import restore_rng_state, save_snapshot, snapshot_path
from dataloader import DistributedDataLoader
from mfu import peak_flops, synchronize
from model import GPT, PRESETS, GPTConfig
from run_logger import RunLogger
from sample import default_device, generate_text


def arg(default, help: str, choices: tuple[str, ...] | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    # data
    data_dir: str = arg("data/fineweb_edu10B", "directory of *_train_*.bin / *_val_*.bin shards")
    shuffle: bool = arg(True, "shuffle shard and chunk order each epoch (seeded; validation never shuffles)")
    # model
    model: str = arg("gpt2", f"architecture preset: {', '.join(PRESETS)}")
    n_layer: int | None = arg(None, "override the preset's number of layers")
    n_head: int | None = arg(None, "override the preset's number of attention heads")
    n_embd: int | None = arg(None, "override the preset's embedding width")
    block_size: int | None = arg(None, "override the preset's context length (the model's maximum)")
    # batch: total_batch_size tokens per optimizer step = micro_batch_size·seq_len·world_size·grad_accum_steps
    seq_len: int | None = arg(None, "training sequence length T (≤ block_size; default: block_size)")
    micro_batch_size: int = arg(64, "sequences per rank per micro-step B; lower it if you run out of memory")
    total_batch_size: int = arg(524288, "tokens per optimizer step (GPT-2 used ~0.5M)")
    # optimization
    max_steps: int = arg(19073, "optimizer steps (19,073 × 524,288 ≈ 10B tokens, one FineWeb-Edu 10B epoch)")
    warmup_steps: int = arg(715, "linear LR warmup steps")
    max_lr: float = arg(6e-4, "peak learning rate")
    min_lr_ratio: float = arg(0.1, "final learning rate as a fraction of max_lr")
    weight_decay: float = arg(0.1, "AdamW weight decay on matrices")
    grad_clip: float = arg(1.0, "clip the global gradient norm to this (0 = off)")
    # speed
    dtype: str = arg("auto", "autocast dtype (fp16 adds a GradScaler; auto: the fastest safe one)",
                     choices=("auto", "bf16", "fp16", "fp32"))
    device: str = arg("auto", "where to train (auto: cuda, else mps, else cpu)", choices=("auto", "cuda", "mps", "cpu"))
    compile: bool = arg(False, "torch.compile the model")
    seed: int = arg(1337, "random seed (weights init, data shuffling)")
    # evaluation and logging
    val_every: int = arg(250, "validate every N steps (0 = never)")
    val_tokens: int = arg(10_485_760, "tokens per validation (same for any world size)")
    val_steps: int | None = arg(None, "validation micro-batches per rank; overrides --val_tokens")
    hellaswag_every: int = arg(250, "HellaSwag every N steps (0 = never)")
    hellaswag_path: str | None = arg(None, "local HellaSwag val jsonl (default: download on first use)")
    hellaswag_limit: int | None = arg(None, "evaluate only the first N HellaSwag examples")
    sample_every: int = arg(250, "rank 0 prints sampled text every N steps (0 = never)")
    log_dir: str = arg("logs", "metrics.jsonl (and, by default, snapshots) go here")
    wandb_project: str | None = arg(None, "wandb project; logging to wandb is on when this is set")
    wandb_mode: str | None = arg(None, "online|offline|disabled (default: online with a project, else disabled)")
    wandb_run_name: str | None = arg(None, "wandb run name")
    # fault tolerance
    ckpt_dir: str | None = arg(None, "snapshot directory (default: --log_dir)")
    ckpt_every: int = arg(500, "snapshot every N steps (0 = off); the last step always writes one")
    keep_last: int = arg(2, "keep this many newest snapshots")
    resume: str = arg("auto", "auto (newest valid snapshot in --ckpt_dir) | never | PATH to a snapshot")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(TrainConfig):
        if f.type is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            kind = {"int | None": int, "str | None": str}.get(str(f.type), f.type)
            parser.add_argument(f"--{f.name}", type=kind, default=f.default, choices=f.metadata["choices"],
                                help=f.metadata["help"])
    return TrainConfig(**vars(parser.parse_args(argv)))


# ----------------------------------------------------------------------------------------------------------------
# processes and devices

@dataclass
class Distributed:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def setup_distributed(device_arg: str) -> Distributed:
    """One process per device. torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; without them we are the only process."""
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in
                                    (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    device_type = default_device() if device_arg == "auto" else device_arg
    device = torch.device(f"cuda:{local_rank}" if device_type == "cuda" else device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(minutes=10)))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps one TCPStore for the whole job, where a dead round's addresses are still
            # stored after a restart; a per-restart prefix makes each round meet only its own peers. (With
            # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every round gets a fresh store instead, and needs no prefix.)
            store = dist.PrefixStore(f"restart_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
            nodes, max_restarts = int(os.environ["GROUP_WORLD_SIZE"]), int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
            if rank == 0 and nodes > 1 and max_restarts > 0:
                # A node whose workers are restarted for another node's failure keeps its restart count, so
                # after a failure the nodes' prefixes can differ and their workers never meet.
                print("WARNING: restarts of a multi-node job need a fresh store per restart: export "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node before torchrun (see README, Multi-node).",
                      file=sys.stderr)
        # A timeout, so that ranks whose peer died raise instead of waiting forever in a collective.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timedelta(minutes=10))
    return Distributed(rank, local_rank, world_size, device)


def average_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks, for logging (gloo's AVG is right in torch 2.13: tests/test_train.py checks)."""
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype; 'auto' is the fastest that is safe on the device (fp32 means no autocast)."""
    if name != "auto":
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu":
        # CPUs with AVX512-BF16 or AMX run bf16 matmuls 2-3x faster than fp32 (and a bf16 step ~2x faster). Others,
        # even plain AVX-512 ones, which mkldnn's own bf16 check accepts, have no bf16 arithmetic to gain from.
        return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported() \
            else torch.float32
    return torch.float32  # MPS: fp32 is the one dtype every macOS version runs correctly (see README)


def autocast_context(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def keep_freed_memory() -> None:
    """On a CPU with glibc (Linux), keep freed memory in the process for reuse instead of returning it to the OS.

    glibc hands every freed block over 32 MB straight back to the kernel, so each step's logits and their
    gradients (hundreds of MB: B·T × 50,304) are page-faulted and zeroed afresh in the next step. On the small
    preset on 2 cores this makes a bf16 step 1.6x and an fp32 step 1.3-1.5x faster (bench.py). The price: freed
    blocks are reused less tightly than fresh pages, so the peak resident memory grows (there: 2.3 -> 2.7 GB in
    bf16, 2.3 -> 3.5 GB in fp32), once; it does not creep up over a run.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, Windows, musl): nothing to tune
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from <malloc.h>
    libc.mallopt(M_MMAP_MAX, 0)  # big blocks come from the heap, where freed ones are reused...
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # ...and the heap is never shrunk


# ----------------------------------------------------------------------------------------------------------------
# the model, the optimizer and the learning rate

def model_config(cfg: TrainConfig) -> GPTConfig:
    if cfg.model not in PRESETS:
        raise SystemExit(f"--model {cfg.model!r} is not a known preset; choose one of {', '.join(PRESETS)}.")
    overrides = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "block_size") if getattr(cfg, k)}
    config = replace(PRESETS[cfg.model], **overrides)
    if config.n_embd % config.n_head:
        raise SystemExit(f"--n_embd {config.n_embd} must be a multiple of --n_head {config.n_head}.")
    return config


def get_lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to max_lr, then cosine decay to min_lr_ratio·max_lr at the last step."""
    min_lr = cfg.max_lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return cfg.max_lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps - 1:
        return min_lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - 1 - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.max_lr - min_lr)


def training_seq_len(cfg: TrainConfig, config: GPTConfig) -> int:
    seq_len = cfg.seq_len or config.block_size
    if seq_len > config.block_size:
        raise SystemExit(f"--seq_len {seq_len} exceeds the model's --block_size {config.block_size}; lower --seq_len "
                         "or raise --block_size.")
    return seq_len


def grad_accum_steps_for(cfg: TrainConfig, seq_len: int, world_size: int) -> int:
    tokens_per_micro_step = cfg.micro_batch_size * seq_len * world_size
    if cfg.total_batch_size % tokens_per_micro_step:
        raise SystemExit(
            f"--total_batch_size {cfg.total_batch_size} is not a multiple of --micro_batch_size × --seq_len × ranks "
            f"= {cfg.micro_batch_size} × {seq_len} × {world_size} = {tokens_per_micro_step}. Pick a total batch that "
            "is, e.g. " f"{max(1, cfg.total_batch_size // tokens_per_micro_step) * tokens_per_micro_step}.")
    return cfg.total_batch_size // tokens_per_micro_step


# ----------------------------------------------------------------------------------------------------------------
# one training step

@dataclass
class StepResult:
    loss: float  # mean over the whole batch, averaged across ranks
    grad_norm: float
    skipped: bool  # fp16 only: the GradScaler found inf/NaN gradients and skipped the update
    data_seconds: float  # time spent waiting for the data loader


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               loader: DistributedDataLoader, grad_accum_steps: int, lr: float, grad_clip: float,
               device: torch.device, dtype: torch.dtype) -> StepResult:
    """One optimizer update on total_batch_size tokens, accumulated over grad_accum_steps micro-steps."""
    model.train()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    data_seconds = 0.0
    for micro_step in range(grad_accum_steps):
        t0 = time.perf_counter()
        x, y = to_device(*loader.next_batch(), device)
        data_seconds += time.perf_counter() - t0
        if isinstance(model, DDP):
            # Gradients are all-reduced only after the last micro-step: the earlier backward passes just add into
            # .grad locally. (Setting the flag rather than `with model.no_sync()` keeps one code path.)
            model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
        with autocast_context(device, dtype):
            _, loss = model(x, y)
        # Each micro-loss is a mean over its B·T tokens; dividing by the number of micro-steps makes the summed
        # gradients the gradient of the mean over the whole batch, not their sum.
        loss = loss / grad_accum_steps
        loss_sum += loss.detach()
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    scale_before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    skipped = scaler.is_enabled() and scaler.get_scale() < scale_before
    return StepResult(average_across_ranks(loss_sum).item(), grad_norm.item(), skipped, data_seconds)


def to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device.type == "cuda":  # pinned memory lets the copy run asynchronously with the GPU's work
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# ----------------------------------------------------------------------------------------------------------------
# evaluation

@torch.no_grad()
def validation_loss(model: torch.nn.Module, loader: DistributedDataLoader, steps: int, device: torch.device,
                    dtype: torch.dtype) -> float:
    model.eval()
    loader.reset()
    loss_sum = torch.zeros((), device=device)
    for _ in range(steps):
        x, y = to_device(*loader.next_batch(), device)
        with autocast_context(device, dtype):
            _, loss = model(x, y)
        loss_sum += loss.detach()
    return average_across_ranks(loss_sum / steps).item()


def validation_steps(cfg: TrainConfig, loader: DistributedDataLoader, world_size: int) -> int:
    """Micro-batches per rank per validation: --val_tokens worth, at most one pass over the val shards."""
    if cfg.val_steps:
        return cfg.val_steps
    tokens_per_micro_step = loader.B * loader.T * world_size
    available = sum((n - 1) // tokens_per_micro_step for n in loader.shard_tokens)
    return max(1, min(cfg.val_tokens // tokens_per_micro_step, available))


def print_samples(model: GPT, step: int, logger: RunLogger) -> None:
    texts = generate_text(model, "Hello, I'm a language model,", num_samples=4, max_new_tokens=32,
                          temperature=1.0, top_k=50, seed=42)
    for text in texts:
        print(f"sample {step}: {text!r}")
    logger.log_samples(step, texts)


# ----------------------------------------------------------------------------------------------------------------
# snapshots and signals

class StopRequest:
    """SIGTERM (a preemption, or torchrun stopping workers) asks for a snapshot at the next step boundary.

    The handler only sets a flag; ranks agree on it at the step boundary, so they all stop after the same step.
    """

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor(float(self.requested), device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def make_snapshot(raw_model: GPT, optimizer, scaler, step: int, train_loader: DistributedDataLoader,
                  cfg: TrainConfig, wandb_id: str) -> dict | None:
    """Everything needed to continue bit for bit after `step`. Collective: every rank calls it; rank 0 gets it."""
    mine = (capture_rng_state(), train_loader.state_dict())
    per_rank = [mine]
    if dist.is_initialized():
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
    rng_states, loader_states = zip(*per_rank)
    # The loader's position is the same on every rank by design (see dataloader.py), so one copy resumes any
    # number of ranks; check that rather than trust it, on every rank so that all of them stop together.
    if any(s != loader_states[0] for s in loader_states):
        raise RuntimeError(f"data loader positions differ across ranks at step {step}: {loader_states}")
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return {"model": raw_model.state_dict(), "model_config": asdict(raw_model.config),
            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "step": step,
            "loader": loader_states[0], "rng": list(rng_states), "config": asdict(cfg), "wandb_id": wandb_id}


def choose_snapshot(cfg: TrainConfig, ckpt_dir: str, dist_env: Distributed) -> tuple[str, dict] | None:
    """Which snapshot to resume from, or None for a fresh start. Every rank reads the same one."""
    if cfg.resume == "never":
        if dist_env.is_master and list_snapshots(ckpt_dir):
            print(f"WARNING: --resume never, but {ckpt_dir} already holds snapshots; a later --resume auto would pick "
                  "the highest step among them, perhaps the older run's. Use a fresh --ckpt_dir.", file=sys.stderr)
        return None
    if cfg.resume != "auto":
        # Every rank checks, so that none is left waiting in a collective for a rank 0 that has exited.
        if not os.path.isfile(cfg.resume):
            raise SystemExit(f"--resume {cfg.resume}: no such file. Pass the path of a snapshot_*.pt file, 'auto' "
                             "(the newest valid snapshot in --ckpt_dir) or 'never' (start fresh).")
        return cfg.resume, load_snapshot(cfg.resume)
    # Rank 0 picks the newest snapshot that loads, warning once about broken ones; the others read the same file.
    found = find_latest_snapshot(ckpt_dir) if dist_env.is_master else None
    path = str(found[0]) if found else None
    if dist.is_initialized():
        box = [path]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
    if path is None:
        return None
    return path, found[1] if found else load_snapshot(path)


def restore_snapshot(path: str, state: dict, raw_model: GPT, optimizer, scaler, train_loader: DistributedDataLoader,
                     cfg: TrainConfig, dist_env: Distributed) -> None:
    if state["model_config"] != asdict(raw_model.config):
        raise SystemExit(f"{path} holds a model {state['model_config']}, but this run builds "
                         f"{asdict(raw_model.config)}. Pass the --model/--n_layer/--n_head/--n_embd/--block_size of "
                         "the run that wrote it, or --resume never to start over.")
    raw_model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    train_loader.load_state_dict(state["loader"])
    if len(state["rng"]) == dist_env.world_size:
        restore_rng_state(state["rng"][dist_env.rank])
    else:  # a different number of ranks: the data position carries over exactly (see dataloader.py)
        torch.manual_seed(cfg.seed + state["step"] + dist_env.rank)


# ----------------------------------------------------------------------------------------------------------------
# the run

def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    dist_env = setup_distributed(cfg.device)
    ckpt_dir = cfg.ckpt_dir or cfg.log_dir
    log = print if dist_env.is_master else (lambda *a, **k: None)
    try:
        run(cfg, dist_env, ckpt_dir, log)
        if dist.is_initialized():
            # Leave together: a rank that tears gloo down while rank 0 still writes the last snapshot can abort.
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(cfg: TrainConfig, dist_env: Distributed, ckpt_dir: str, log) -> None:
    device, master = dist_env.device, dist_env.is_master
    torch.manual_seed(cfg.seed)
    # TF32 matmuls on Ampere+ GPUs: ~8x faster than full fp32 at a precision training does not notice.
    torch.set_float32_matmul_precision("high")
    if device.type == "cpu":
        keep_freed_memory()  # reuse freed logits/gradient memory instead of page-faulting it in every step

    # --- data
    config = model_config(cfg)
    seq_len = training_seq_len(cfg, config)
    grad_accum_steps = grad_accum_steps_for(cfg, seq_len, dist_env.world_size)
    train_loader = DistributedDataLoader(cfg.data_dir, "train", cfg.micro_batch_size, seq_len, dist_env.rank,
                                         dist_env.world_size, grad_accum_steps, shuffle=cfg.shuffle, seed=cfg.seed)
    val_loader = None
    if cfg.val_every:
        val_loader = DistributedDataLoader(cfg.data_dir, "val", cfg.micro_batch_size, seq_len, dist_env.rank,
                                           dist_env.world_size)
        val_steps = validation_steps(cfg, val_loader, dist_env.world_size)

    # --- model and optimizer
    raw_model = GPT(config).to(device)
    dtype = pick_dtype(cfg.dtype, device)
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.max_lr, device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    # --- resume
    if cfg.ckpt_every and cfg.keep_last < 1:
        raise SystemExit(f"--keep_last {cfg.keep_last} would delete every snapshot, so nothing could resume. Keep at "
                         "least 1, or turn snapshots off with --ckpt_every 0.")
    start_step, wandb_id = 0, uuid.uuid4().hex[:12]
    logger = RunLogger(cfg.log_dir, enabled=master)
    snapshot = choose_snapshot(cfg, ckpt_dir, dist_env)
    if snapshot:
        path, state = snapshot
        if state["step"] >= cfg.max_steps - 1:
            log(f"{path} is from step {state['step']}, the last of --max_steps {cfg.max_steps}: the run is already "
                "finished, nothing to do. (Raise --max_steps to train on, or --resume never to start over.)")
            return
        restore_snapshot(path, state, raw_model, optimizer, scaler, train_loader, cfg, dist_env)
        start_step, wandb_id = state["step"] + 1, state["wandb_id"]
        log(f"resuming from {path} at step {start_step}")
        logger.log({"event": "resume", "step": start_step, "snapshot": str(path)})
        del snapshot, state  # the snapshot's copies of the weights and optimizer state: gigabytes for big models
    logger.start_wandb(cfg.wandb_project, cfg.wandb_mode or ("online" if cfg.wandb_project else "disabled"),
                       wandb_id, cfg.wandb_run_name, asdict(cfg) | {"model_config": asdict(config),
                       "world_size": dist_env.world_size, "grad_accum_steps": grad_accum_steps})

    model = torch.compile(raw_model) if cfg.compile else raw_model
    if dist_env.world_size > 1:
        model = DDP(model, device_ids=[dist_env.local_rank] if device.type == "cuda" else None)

    hellaswag_examples = None
    if cfg.hellaswag_every:
        from data import hellaswag
        hellaswag_examples = hellaswag.load_examples(cfg.hellaswag_path, cfg.hellaswag_limit)

    tokens_per_step = cfg.total_batch_size
    flops_per_step = raw_model.flops_per_token(seq_len) * tokens_per_step
    peak = peak_flops(device, dtype) * dist_env.world_size
    log(f"model: {cfg.model} {config} | {raw_model.num_params():,} parameters\n"
        f"device: {device} × {dist_env.world_size} ranks | dtype {str(dtype).removeprefix('torch.')} | "
        f"compile {cfg.compile}\nbatch: {tokens_per_step:,} tokens = {cfg.micro_batch_size} × {seq_len} × "
        f"{dist_env.world_size} ranks × {grad_accum_steps} accumulation steps"
        + (f"\nvalidation: {val_steps} × {cfg.micro_batch_size * seq_len * dist_env.world_size:,} tokens"
           if val_loader else ""))

    stop = StopRequest()
    last_step = cfg.max_steps - 1
    for step in range(start_step, cfg.max_steps):
        # --- evaluate (before the update, so step 0 shows the untrained model)
        if val_loader and (step % cfg.val_every == 0 or step == last_step):
            val_loss = validation_loss(model, val_loader, val_steps, device, dtype)
            log(f"step {step:5d} | val loss {val_loss:.4f}")
            logger.log({"step": step, "val_loss": val_loss})
        if hellaswag_examples and (step % cfg.hellaswag_every == 0 or step == last_step):
            # The uncompiled module: HellaSwag's sequence lengths vary and would make torch.compile recompile.
            acc = hellaswag.evaluate(raw_model, hellaswag_examples, device.type, dtype if dtype != torch.float32
                                     else None, dist_env.rank, dist_env.world_size)
            log(f"step {step:5d} | hellaswag acc_norm {acc:.4f}")
            logger.log({"step": step, "hellaswag_acc": acc})
        if master and cfg.sample_every and step > 0 and (step % cfg.sample_every == 0 or step == last_step):
            print_samples(raw_model, step, logger)

        # --- train
        synchronize(device)
        t0 = time.perf_counter()
        lr = get_lr(step, cfg)
        result = train_step(model, optimizer, scaler, train_loader, grad_accum_steps, lr, cfg.grad_clip, device,
                            dtype)
        synchronize(device)
        dt = time.perf_counter() - t0
        tokens_per_sec = tokens_per_step / dt
        mfu = flops_per_step / dt / peak
        log(f"step {step:5d} | loss {result.loss:.6f} | lr {lr:.2e} | norm {result.grad_norm:.4f} | "
            f"{dt * 1000:.1f} ms | {tokens_per_sec:,.0f} tok/s | mfu {100 * mfu:.1f}%"
            + (" | fp16 overflow: step skipped" if result.skipped else ""))
        # An fp16 overflow makes the norm inf/NaN, which strict JSON readers reject: logged as null.
        grad_norm = result.grad_norm if math.isfinite(result.grad_norm) else None
        logger.log({"step": step, "loss": result.loss, "lr": lr, "grad_norm": grad_norm,
                    "dt_ms": dt * 1000, "tokens_per_sec": tokens_per_sec, "mfu": mfu}
                   | ({"skipped": True} if result.skipped else {}))

        # --- snapshot
        stopping = stop.agreed(device)
        if cfg.ckpt_every and ((step + 1) % cfg.ckpt_every == 0 or step == last_step or stopping):
            state = make_snapshot(raw_model, optimizer, scaler, step, train_loader, cfg, wandb_id)
            if state is not None:
                save_snapshot(state, snapshot_path(ckpt_dir, step))
                prune_snapshots(ckpt_dir, cfg.keep_last)
                log(f"snapshot written: {snapshot_path(ckpt_dir, step)}")
        if stopping:
            log(f"stopping after step {step} on SIGTERM; " + ("rerun the same command to resume" if cfg.ckpt_every
                else "no snapshot written, as --ckpt_every is 0"))
            break
    logger.finish()


if __name__ == "__main__":
    main(sys.argv[1:])
