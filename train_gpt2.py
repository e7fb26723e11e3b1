"""Pretrain GPT-2.

    torchrun --standalone --nproc_per_node=2 train_gpt2.py     # 2 GPUs (NCCL), or 2 CPU processes (gloo)
    python train_gpt2.py --config recipes/shakespeare_small.toml   # one GPU, Apple MPS or CPU
    python train_gpt2.py --config recipes/shakespeare_finetune_gpt2.toml   # finetune OpenAI's GPT-2

The defaults reproduce GPT-2 124M on FineWeb-Edu 10B (524,288-token batches, 19,073 steps). A run checks every input,
sets up the processes, builds the data loaders and the model, resumes from the newest snapshot if there is one, then
loops {read the step's data, evaluate, train one step, log, snapshot}. Every rank stops together between two steps,
with a snapshot, on SIGTERM, a first Ctrl-C, a shard that fails or changed, or a divergence (--on_divergence).
"""

import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from dataloader import DistributedDataLoader, ShardReadError
from evaluation import tasks as evals
from evaluation.validation import validation_loss, validation_record
from model import GPT
from rundir.lock import RunLock, lock_run_directories
from rundir.snapshot import FORMAT, read_model
from rundir.store import Snapshots
from training import hf
from training.config import HF_MODELS, Plan, TrainConfig, parse_args, row_length
from training.distributed import Distributed, hangs_reported, setup_distributed, synchronize, teardown_distributed
from training.divergence import DivergenceGuard, StopRequest
from training.errors import UserError, run_entry_point
from training.inputs import check_inputs, resolve_plan
from training.memory import choose_micro_batch, keep_freed_memory
from training.mfu import Peak, peak_flops
from training.mixture import MixtureLoader, source_names
from training.optim import get_lr, get_muon_momentum, schedule_change
from training.parallel import TrainingModel, build_training_model
from training.precision import dtype_name, pick_dtype, set_deterministic
from training.run_logger import RunLogger
from training.step import StepResult, train_step
from training.tokenizer import Tokenizer, generate_text, tokenizer_from_spec


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv, __doc__)
    check_inputs(cfg)  # every flag and torchrun's environment, before a process group, file, lock or download
    stop = StopRequest()
    with stop.handling_signals():  # from here on, SIGTERM and a first Ctrl-C stop the run between two steps
        dist_env = setup_distributed(cfg.device, cfg.parallel, cfg.dist_timeout)
        # Settings for the whole process, made here so that run() changes nothing outside itself.
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere+: ~8x faster than fp32, precise enough
        if cfg.deterministic:
            set_deterministic()
        if dist_env.device.type == "cpu":
            keep_freed_memory()  # reuse freed activation memory instead of page-faulting it in every step
        try:
            # Output directories that cannot be written, or another run's, end the run here (exit 2), untouched.
            with (hangs_reported(cfg.dist_timeout, dist_env.rank),
                  lock_run_directories({"--log_dir": cfg.log_dir, "--snapshot_dir": cfg.snapshot_dir}, dist_env,
                                       cfg.run_lock) as run_lock):
                run(cfg, dist_env, stop, run_lock)
                if dist.is_initialized():
                    # Leave together: a rank tearing gloo down while rank 0 still writes the last snapshot can abort.
                    dist.barrier()
        finally:
            teardown_distributed()


def run(cfg: TrainConfig, dist_env: Distributed, stop: StopRequest | None = None, run_lock: RunLock | None = None
        ) -> None:
    device, master = dist_env.device, dist_env.is_master
    stop = stop or StopRequest()
    print0 = print if master else (lambda *args, **kwargs: None)  # stdout on rank 0; `metrics`: metrics.jsonl, wandb
    dtype = pick_dtype(cfg.dtype, device)
    if cfg.micro_batch_size == "auto":
        cfg = replace(cfg, micro_batch_size=choose_micro_batch(cfg, dist_env, dtype, print0))
    plan = resolve_plan(cfg, dist_env.world_size)
    torch.manual_seed(cfg.seed)

    # --- data, and the text the tasks and samples are read and written with
    train_loader, val_loaders = data_loaders(cfg, plan, dist_env)
    # Loaded now, as the tasks' files: a tokenizer this node cannot have (tiktoken offline) fails at start-up.
    tokenizer = tokenizer_from_spec(train_loader.tokenizer) if cfg.eval_every or cfg.sample_every else None
    eval_suite = task_suite(cfg, plan, dist_env, tokenizer) if cfg.eval_every else None

    # --- model, optimizer, and the snapshot to resume from
    trainee = build_training_model(initial_model(cfg, plan), dist_env, dtype, cfg, cfg.compile, parallel=cfg.parallel)
    guard = DivergenceGuard(cfg.skip_zscore)
    snapshots = Snapshots(plan.snapshot_dir, cfg.snapshot_every, cfg.keep_last, cfg.resume, trainee, train_loader,
                          asdict(cfg), dist_env, print0, {"guard": guard}, run_lock)
    start_step, resumed_from = snapshots.resume()
    if start_step >= cfg.max_steps:
        print0(already_finished(resumed_from, start_step, cfg.max_steps))
        return

    # --- logging and evaluations
    metrics = RunLogger(cfg.log_dir, snapshots.run, master, run_lock)
    log_start(cfg, plan, dist_env, snapshots, trainee, metrics, start_step, resumed_from, print0)
    evaluations = Evaluations(cfg, plan, trainee, val_loaders, eval_suite, metrics, stop, dist_env, dtype, tokenizer)
    peak = peak_flops(device, dtype)  # after the RNG restore: it leaves the global generators alone
    if master:
        log_setup(cfg, plan, trainee.raw, dist_env, dtype, peak)
        log_epochs(cfg, plan, train_loader)
    divergence = DivergenceResponse(cfg, snapshots, guard, train_loader, metrics, print0)
    TrainingLoop(cfg, plan, trainee, train_loader, guard, snapshots, evaluations, divergence,
                 peak.flops * dist_env.world_size, metrics, stop, device, dtype).train(start_step, print0)


@dataclass
class TrainingLoop:
    """The loop of a run, over what run() built."""
    cfg: TrainConfig
    plan: Plan
    trainee: TrainingModel
    train_loader: DistributedDataLoader | MixtureLoader
    guard: DivergenceGuard
    snapshots: Snapshots
    evaluations: "Evaluations"
    divergence: "DivergenceResponse"
    peak_flops: float  # of all the devices together
    metrics: RunLogger
    stop: StopRequest
    device: torch.device
    dtype: torch.dtype

    def train(self, start_step: int, print0) -> None:
        cfg, stop, snapshots, guard = self.cfg, self.stop, self.snapshots, self.guard
        last_step = cfg.max_steps - 1
        step = start_step
        stopped = None  # where the run stopped on a request, if it did
        while step < cfg.max_steps:  # (not a for loop: a rollback takes the step back)
            # --- between steps: this step's data is read now; all ranks stop here together on a signal or a bad shard
            try:
                self.train_loader.read_ahead()
            except ShardReadError as e:
                stop.data_failed(e)
            if stop.agreed(self.device):
                stopped = f"after step {step - 1}" if step > 0 else "before step 0"
                break
            # --- evaluate (before the update, so step 0 shows the untrained model); a stop request cuts it short
            if not self.evaluations.run_due(step, last_step):
                stopped = f"during the evaluation before step {step}"
                break
            # --- train
            if step == self.plan.anneal_step:
                mix = dict(zip(self.plan.sources, self.plan.anneal_weights))
                print0(f"step {step:5d} | the --anneal_mix starts: {mix}")
                self.metrics.log({"event": "anneal", "step": step, "data_mix": mix})
            result = self.timed_step(step)
            if guard.skips_in_a_row >= cfg.max_skips:  # the same on every rank: they all stop or roll back
                step = self.divergence.respond(step, result.skip_reason)
                continue
            # --- snapshot (of the state after the step)
            snapshots.save_if_due(step, last_step, stopping=False, healthy=guard.skips_in_a_row == 0)
            step += 1
        if stopped:
            written = snapshots.save_if_due(step - 1, last_step, stopping=True, healthy=guard.skips_in_a_row == 0)
        self.metrics.finish()
        if stopped and stop.reason == "data":
            raise UserError(data_failure_message(stop.failure, stopped, written, snapshots))
        if stopped:
            print0(f"stopping {stopped} on {stop.reason}; rerun the same command to resume")

    def timed_step(self, step: int) -> StepResult:
        """One optimizer step, timed and logged."""
        cfg, trainee = self.cfg, self.trainee
        synchronize(self.device)
        t0 = time.perf_counter()
        lr = get_lr(step, cfg)
        result = train_step(trainee.model, trainee.optimizer, trainee.scaler, self.train_loader,
                            self.plan.grad_accum_steps, lr, cfg.grad_clip, self.device, self.dtype, self.guard,
                            muon_momentum=get_muon_momentum(step, cfg), row_length=row_length(step, self.plan))
        synchronize(self.device)
        seconds, flops = time.perf_counter() - t0, trainee.raw.flops_per_token(self.plan.seq_len) * cfg.total_batch_size
        speed = {"dt_ms": seconds * 1000, "tokens_per_sec": cfg.total_batch_size / seconds,
                 "mfu": flops / seconds / self.peak_flops}
        log_step(step, result, lr, speed, self.metrics, self.train_loader)
        return result


def data_failure_message(failure: str, stopped: str, written: Path | None, snapshots: Snapshots) -> str:
    """The error of a run whose shard changed or failed to read, and where to resume from once it is restored."""
    newest = written or snapshots.newest_healthy()
    if newest:
        resume = f"the newest snapshot is {newest}: restore the shard and rerun the same command to resume from it"
    else:
        resume = "there is no snapshot yet: restore the shard and start again"
    return (f"{failure} Every rank stopped {stopped}; {resume}. (A run trains on exactly the shards it started "
            "with, so any change to one under it stops it, a new file renamed over it too: write new or re-made "
            "shards into another directory, for a new run.)")


# ----------------------------------------------------------------------------------------------------------------
# the steps of the run

def data_loaders(cfg: TrainConfig, plan: Plan, dist_env: Distributed
                 ) -> tuple[DistributedDataLoader | MixtureLoader, dict[str, DistributedDataLoader]]:
    """Each rank's train loader, and val loader of each source by name (token ids checked now, not mid-step)."""
    def loader(source: str, split: str, **train) -> DistributedDataLoader:
        return DistributedDataLoader(source, split, cfg.micro_batch_size, plan.seq_len, dist_env.rank,
                                     dist_env.world_size, vocab_size=plan.model_config.vocab_size, **train)

    sources = [loader(source, "train", grad_accum_steps=plan.grad_accum_steps, shuffle=cfg.shuffle, seed=cfg.seed,
                      align_bos=plan.align_bos) for source in plan.sources]
    train_loader = MixtureLoader(sources, plan.weights, plan.anneal_weights, plan.anneal_step, cfg.seed) \
        if cfg.data_mix or cfg.anneal_mix else sources[0]
    names = source_names(plan.sources)
    return train_loader, {names[source]: loader(source, "val") for source in plan.sources} if plan.val_steps else {}


def task_suite(cfg: TrainConfig, plan: Plan, dist_env: Distributed, tokenizer: Tokenizer | None) -> evals.Suite:
    """The zero-shot tasks, loaded now, so that a missing file or no network says so at start-up."""
    docs = evals.load_tasks(evals.parse_task_names(cfg.eval_tasks, "--eval_tasks"), cfg.eval_dir, cfg.eval_limit,
                            dist_env.local_rank, dist_env.device)
    # Batches of a training micro-batch's tokens: that fits, as evaluating keeps no activations for a backward.
    return evals.Suite(docs, plan.model_config.block_size, cfg.micro_batch_size * plan.seq_len, tokenizer)


def already_finished(resumed_from: str, start_step: int, max_steps: int) -> str:
    return (f"{resumed_from} is from step {start_step - 1}, the last of --max_steps {max_steps}: the run is "
            "already finished, nothing to do. To train on, raise --max_steps and resume from a snapshot taken "
            "before the LR decayed (--resume PATH --snapshot_dir NEW_DIR: a branch writes its snapshots apart from "
            "the later ones of this run): with --lr_schedule wsd, one from the stable phase continues with no LR "
            "jump; with cosine, or from this last snapshot (no new directory needed), the LR jumps back up (a "
            "warning says by how much). Or --resume never to start over.")


def log_start(cfg: TrainConfig, plan: Plan, dist_env: Distributed, snapshots: Snapshots, trainee: TrainingModel,
              metrics: RunLogger, start_step: int, resumed_from: str | None, print0) -> None:
    """Where the run starts, in the log and on wandb: a resume (the settings it changed) or --init_from, and the run."""
    if metrics.metrics_path.name != "metrics.jsonl":
        print0(f"metrics go to {metrics.metrics_path}: {cfg.log_dir}/metrics.jsonl is another run's")
    if resumed_from:
        print0(f"resuming from {resumed_from} at step {start_step}")
        replaced = trainee.optimizer.replaced_settings
        metrics.log({"event": "resume", "step": start_step, "snapshot": str(resumed_from)}
                    | ({"optimizer_settings": replaced} if replaced else {}))
        if replaced:
            print0("the snapshot's optimizer settings differ from this run's; this run's flags apply: "
                   + ", ".join(f"{flag} {saved} → {flagged}" for flag, (saved, flagged) in replaced.items()))
        change = schedule_change(start_step, snapshots.resumed_config, cfg)
        if change and dist_env.is_master:
            line, jump = change
            print(f"WARNING: {line}" if jump else line, file=sys.stderr if jump else sys.stdout)
    elif cfg.init_from != "scratch":
        print0(f"initialised from {cfg.init_from}")
        metrics.log({"event": "init", "step": 0, "init_from": cfg.init_from})
    # (after the resume or init event) whose metrics these are, for run_logger.metrics_path
    metrics.log({"event": "timeline", "format": FORMAT, "step": start_step, "continued": snapshots.continued}
                | asdict(snapshots.record))
    metrics.start_wandb(cfg.wandb_project, cfg.wandb_mode or ("online" if cfg.wandb_project else "disabled"),
                        snapshots.run, cfg.wandb_run_name, asdict(cfg) | {
                           "model_config": asdict(plan.model_config), "world_size": dist_env.world_size,
                           "grad_accum_steps": plan.grad_accum_steps})


def initial_model(cfg: TrainConfig, plan: Plan) -> GPT:
    """Random weights, or the --init_from ones (cropped to --block_size), before compile and DDP see the model."""
    if cfg.init_from == "scratch":
        return GPT(plan.model_config)
    if cfg.init_from in HF_MODELS or (Path(cfg.init_from) / "config.json").is_file():
        try:
            model = hf.from_pretrained(cfg.init_from)
        except OSError as e:  # what transformers raises for no network, an unknown name or missing weight files
            raise UserError(f"--init_from {cfg.init_from}: the Hugging Face weights could not be loaded "
                            f"({str(e).strip().splitlines()[0]}). On a node without network, save them elsewhere "
                            "with GPT2LMHeadModel.from_pretrained(name).save_pretrained(directory), copy the "
                            "directory over and pass --init_from directory.") from e
    else:
        try:
            model = read_model(cfg.init_from)
        except ValueError as e:  # its bytes changed since they were written: the reader's message names the file
            raise UserError(f"--init_from: {e}") from e
    model.crop_block_size(plan.model_config.block_size)
    return model


class DivergenceResponse:
    """--on_divergence, once --max_skips updates in a row were skipped: roll back to the newest healthy snapshot (at
    most --max_rollbacks times), or stop with a UserError on every rank (docs/reliability.md)."""

    def __init__(self, cfg: TrainConfig, snapshots: Snapshots, guard: DivergenceGuard,
                 train_loader: DistributedDataLoader | MixtureLoader, metrics: RunLogger, print0):
        self.cfg, self.snapshots, self.guard, self.train_loader = cfg, snapshots, guard, train_loader
        self.metrics, self.print0 = metrics, print0

    def respond(self, step: int, reason: str) -> int:
        """Roll back and return the step to go on at, or raise UserError."""
        cfg, position, where = self.cfg, self.train_loader.state_dict(), self.train_loader.where()
        if cfg.on_divergence == "rollback" and self.guard.rollbacks < cfg.max_rollbacks:
            rollbacks = self.guard.rollbacks
            restored = self.snapshots.rollback()  # the guard's state too, from before this rollback
            if restored is not None:
                snapshot_step, path = restored
                # The run's count, not the snapshot's (a snapshot from before the guard holds no count either).
                self.guard.skips_in_a_row, self.guard.rollbacks = 0, rollbacks + 1
                self.snapshots.commit_rollback(snapshot_step, path)
                next_step, rollbacks = snapshot_step + 1, self.guard.rollbacks
                self.print0(f"step {step:5d} | {cfg.max_skips} updates skipped in a row (last: {reason}): rollback "
                            f"{rollbacks} of {cfg.max_rollbacks} to {path}; training goes on at step {next_step} "
                            f"with the data after the skipped steps ({where})")
                self.metrics.log({"event": "rollback", "step": step, "to_step": next_step, "snapshot": path,
                                  "rollbacks": rollbacks, "reason": reason, "data_position": position})
                return next_step
        rollbacks = self.guard.rollbacks
        healthy = self.snapshots.newest_healthy()
        self.metrics.log({"event": "diverged", "step": step, "reason": reason, "rollbacks": rollbacks,
                          "data_position": position, "healthy_snapshot": healthy})
        self.metrics.finish()
        after = f"after {rollbacks} rollback(s) (--max_rollbacks {cfg.max_rollbacks}), " if rollbacks else ""
        restart = (f"The newest healthy snapshot is {healthy}: restart from it with --resume {healthy} "
                   "--snapshot_dir NEW_DIR (a branch: its snapshots apart from this run's later ones) and "
                   if healthy else "There is no healthy snapshot to restart from: start again with ")
        raise UserError(
            f"training diverged: {after}{cfg.max_skips} updates in a row were skipped up to step {step} (the last "
            f"for {reason}; --max_skips {cfg.max_skips}), with the data loader at {where}. {restart}a lower "
            f"--max_lr (now {cfg.max_lr:g}), or --skip_zscore 6 to skip loss spikes before they run away, or "
            "--on_divergence rollback to reload the newest healthy snapshot automatically and skip the data that "
            "diverged.")


class Evaluations:
    """Validation, the zero-shot tasks and samples, each on its own beat."""

    def __init__(self, cfg: TrainConfig, plan: Plan, trainee: TrainingModel, val_loaders, eval_suite,
                 metrics: RunLogger, stop: StopRequest, dist_env: Distributed, dtype: torch.dtype,
                 tokenizer: Tokenizer | None = None):
        self.cfg, self.plan, self.trainee, self.val_loaders = cfg, plan, trainee, val_loaders
        self.eval_suite, self.metrics, self.stop = eval_suite, metrics, stop
        self.dist_env, self.dtype, self.tokenizer = dist_env, dtype, tokenizer  # the data's (None: GPT-2's)

    def run_due(self, step: int, last_step: int) -> bool:
        """The evaluations due before `step`'s update; False if a stop request cut them short."""
        cfg, device, dtype = self.cfg, self.dist_env.device, self.dtype

        def should_stop() -> bool:
            return self.stop.agreed(device)

        print0 = print if self.dist_env.is_master else (lambda *args: None)
        if self.val_loaders and (step % cfg.val_every == 0 or step == last_step):
            results = {}
            for name, loader in self.val_loaders.items():
                try:
                    results[name] = validation_loss(self.trainee.model, loader, self.plan.val_steps, device, dtype,
                                                    should_stop)
                except ShardReadError as e:  # raised on every rank together: they agree on the stop as on a train's
                    self.stop.data_failed(e)
                    self.stop.agreed(device)
                    return False
                if results[name] is None:
                    return False
            record = validation_record(results)  # (no bpb where the tokenizer cannot be loaded offline)
            line = " | ".join([f"step {step:5d}"] + [f"{key} {value:.4f}" for key, value in record.items()])
            print0(line.replace("| val_", "| val "))  # (val loss, val bpb: as before mixtures)
            self.metrics.log({"step": step} | record)
        evals_due = self.eval_suite and (step % cfg.eval_every == 0 or step == last_step)
        sample_due = cfg.sample_every and step > 0 and (step % cfg.sample_every == 0 or step == last_step)
        # The uncompiled module, whole: the tasks' sequence lengths vary and would make torch.compile recompile,
        # and each rank scores other batches (and only rank 0 samples), so fsdp's gathers could not pair up.
        full_model = self.trainee.full_model() if evals_due or sample_due else None
        if evals_due:
            results = evals.evaluate(full_model, self.eval_suite, device, dtype, self.dist_env.rank,
                                     self.dist_env.world_size, should_stop=should_stop)
            if results is None:
                return False
            print0(f"step {step:5d} | " + " | ".join(f"{key} {value:.4f}" for key, value in results.items()))
            self.metrics.log({"step": step} | results)
        if self.dist_env.is_master and sample_due and not self.stop.requested:
            # Rank 0 alone, so no collective: a stop request seen later is agreed on after the step.
            texts = generate_text(full_model, "Hello, I'm a language model,", num_samples=4, max_new_tokens=32,
                                  temperature=1.0, top_k=50, seed=42, tokenizer=self.tokenizer)
            for text in texts:
                print(f"sample {step}: {text!r}")
            self.metrics.log_samples(step, texts)
        return True


def log_setup(cfg: TrainConfig, plan: Plan, model: GPT, dist_env: Distributed, dtype: torch.dtype,
              peak: Peak) -> None:
    tokens_per_micro_step = cfg.micro_batch_size * plan.seq_len * dist_env.world_size
    name = cfg.model or ("gpt2" if cfg.init_from == "scratch" else cfg.init_from)
    print(f"model: {name} {plan.model_config} | {model.num_params():,} parameters\n"
          f"device: {dist_env.device} × {dist_env.world_size} ranks | dtype {dtype_name(dtype)} | compile "
          f"{cfg.compile} | peak {peak.flops / 1e12:,.1f} TFLOP/s per device ({peak.source})\n"
          f"batch: {cfg.total_batch_size:,} tokens = {cfg.micro_batch_size} × {plan.seq_len} × "
          f"{dist_env.world_size} ranks × {plan.grad_accum_steps} accumulation steps"
          + "".join(f", rows of {length} tokens before step {until}" for length, until in plan.short_rows)
          + (f"\nvalidation: {plan.val_steps} × {tokens_per_micro_step:,} tokens" if plan.val_steps else ""))


def log_epochs(cfg: TrainConfig, plan: Plan, train_loader: DistributedDataLoader | MixtureLoader,
               max_epochs: int = 4) -> None:
    """Each source's tokens and how many times --max_steps reads them (its expected share), warning past max_epochs."""
    anneal_step = cfg.max_steps if plan.anneal_step is None else min(plan.anneal_step, cfg.max_steps)
    for source, weight, annealed in zip(train_loader.sources, plan.weights, plan.anneal_weights or plan.weights):
        tokens = sum(source.shard_tokens)
        epochs = (anneal_step * weight + (cfg.max_steps - anneal_step) * annealed) * cfg.total_batch_size / tokens
        print(f"data: {source.data_dir}: {tokens:,} tokens, read {epochs:.2f} times by step {cfg.max_steps}")
        if epochs > max_epochs:
            print(f"WARNING: {source.data_dir} is read {epochs:.1f} times: past about {max_epochs} epochs, repeated "
                  "data stops helping (Muennighoff et al., 2023, \"Scaling Data-Constrained Language Models\"). Give "
                  "it less weight, or more data.", file=sys.stderr)


def log_step(step: int, result: StepResult, lr: float, speed: dict, metrics: RunLogger,
             train_loader: DistributedDataLoader | MixtureLoader) -> None:
    print0 = print if metrics.enabled else (lambda *args: None)
    print0(f"step {step:5d} | loss {result.loss:.6f} | lr {lr:.2e} | norm {result.grad_norm:.4f} | "
           f"{speed['dt_ms']:.1f} ms | {speed['tokens_per_sec']:,.0f} tok/s | mfu {100 * speed['mfu']:.1f}%"
           + (f" | step skipped: {result.skip_reason}" if result.skipped else ""))
    # A NaN or inf loss or norm (a skipped step) is logged as null, as strict JSON readers reject NaN.
    loss, grad_norm = (v if math.isfinite(v) else None for v in (result.loss, result.grad_norm))
    epochs = {source.data_dir: source.epoch for source in train_loader.sources}
    metrics.log({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm} | speed
                | {"tokens_by_source": train_loader.tokens_by_source(step + 1), "epoch_by_source": epochs}
                | ({"skipped": True, "skip_reason": result.skip_reason} if result.skipped else {}))


def command_line(argv: list[str]) -> None:
    """`python train_gpt2.py ARGS`: main, a UserError ending it with one paragraph and exit 2, a second Ctrl-C with one
    line and death by SIGINT as Python's on an unhandled KeyboardInterrupt (a calling script stops too)."""
    try:
        run_entry_point(lambda: main(argv))
    except KeyboardInterrupt:
        print("aborted by a second Ctrl-C: the steps since the last snapshot are lost; a snapshot being written was "
              "removed, the older ones are as they were.", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


if __name__ == "__main__":
    command_line(sys.argv[1:])
