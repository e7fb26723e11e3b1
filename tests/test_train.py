"""train_gpt2.py: 2 ranks train exactly like 1 rank, gradients sync once per step, the LR schedule, fp16/bf16
steps, clear errors for bad flags, and a real run whose loss falls and whose metrics.jsonl has the documented keys."""

import copy
import math
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import make_shards
from helpers_train import run_train, write_text_shards
from model import GPT, GPTConfig
from train_gpt2 import run
from training.config import TrainConfig, grad_accum_steps_for, parse_args
from training.distributed import Distributed, average_across_ranks, teardown_distributed
from training.errors import UserError
from training.inputs import model_config, resolve_plan
from training.optim import Muon, build_optimizers
from training.step import train_step

CPU = torch.device("cpu")
# For the in-process tests: a small vocabulary, because the 50,257-way output layer is most of tiny's cost.
SMALL = GPTConfig(block_size=16, vocab_size=128, n_layer=2, n_head=2, n_embd=32)
B, T = 2, 16


def micro_batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n different (x, y) micro-batches of SMALL-vocabulary tokens, y being x shifted by one."""
    tokens = torch.randint(0, SMALL.vocab_size, (n, B * T + 1), generator=torch.Generator().manual_seed(seed))
    return [(row[:-1].view(B, T), row[1:].view(B, T)) for row in tokens]


class ListLoader:
    """Stands in for DistributedDataLoader in train_step: hands out the given micro-batches in order, first
    calling before_batch(), so a test can look at the gradients between micro-steps."""

    def __init__(self, batches, before_batch=lambda: None):
        self.batches, self.before_batch = iter(batches), before_batch

    def next_batch(self):
        self.before_batch()
        return next(self.batches)


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def new_model_and_optimizer():
    torch.manual_seed(0)
    model = GPT(SMALL)
    return model, build_optimizers(model, TrainConfig(weight_decay=0.1, max_lr=1e-3), "cpu")


def take_step(model, optimizer, batches, grad_accum_steps, dtype=torch.float32, scaler=None,
              before_batch=lambda: None):
    """train_step on the CPU with these micro-batches, lr 1e-3 and no clipping (so gradients can be compared)."""
    scaler = scaler or torch.amp.GradScaler("cpu", enabled=False)
    return train_step(model, optimizer, scaler, ListLoader(batches, before_batch), grad_accum_steps, lr=1e-3,
                      grad_clip=0.0, device=CPU, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------
# 2 ranks, in-process: DDP with gradient accumulation, and averaging across ranks (gloo)

class AlwaysSyncDDP(DDP):
    """DDP that ignores train_step's request to skip the sync: the control showing the test below would notice
    a train_step that all-reduced after every micro-step."""

    @property
    def require_backward_grad_sync(self) -> bool:
        return True

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        pass


def accumulate_on_two_ranks(rank: int, ddp_class: type[DDP]) -> dict:
    """One train_step with grad_accum_steps=2 on this rank's micro-batches (the global micro-batches rank and
    rank+2, as DistributedDataLoader deals them), recording every bucket all-reduce and the gradients between
    micro-steps."""
    model, optimizer = new_model_and_optimizer()
    ddp_model = ddp_class(model)
    allreduced_buckets = []

    def counting_allreduce(state, bucket):
        allreduced_buckets.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    ddp_model.register_comm_hook(None, counting_allreduce)
    seen = []  # (all-reduces so far, gradients) before each micro-step
    result = take_step(ddp_model, optimizer, micro_batches(4)[rank::2], grad_accum_steps=2,
                       before_batch=lambda: seen.append((len(allreduced_buckets), flat_grad(model))))
    return {"allreduces_before_micro_step": [n for n, _ in seen], "grad_after_micro_step_0": seen[1][1],
            "allreduced_buckets": allreduced_buckets, "grad": flat_grad(model), "params": flat_params(model),
            "loss": result.loss, "grad_norm": result.grad_norm}


def values_to_average(rank: int) -> list[torch.Tensor]:
    # A scalar (as the loss is) and 3 numbers: sizes other than the world size, so that dividing by the wrong
    # count shows (AVG on gloo has had silent bugs of that kind, e.g. pytorch#162338).
    return [torch.tensor(rank + 1.0), torch.tensor([1.0, 10.0, 100.0]) * (rank + 1)]


def all_reduce_avg(value: torch.Tensor) -> list[float] | float | str:
    try:
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
    except RuntimeError as e:  # what older torch releases did with AVG on gloo
        return str(e)
    return value.tolist()


def two_rank_worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    # The timeout turns a hang (one rank waiting in a collective the other never joins) into an error.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(minutes=2))
    try:
        results = {"average_across_ranks": [average_across_ranks(v).tolist() for v in values_to_average(rank)],
                   "gloo_avg": [all_reduce_avg(v) for v in values_to_average(rank)],
                   "ddp": accumulate_on_two_ranks(rank, DDP),
                   "always_sync": accumulate_on_two_ranks(rank, AlwaysSyncDDP)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        teardown_distributed()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results from two_rank_worker, run once in two spawned gloo processes."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    mp.spawn(two_rank_worker, args=(str(tmp / "store"), str(tmp)), nprocs=2)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def one_rank_reference() -> dict:
    """The step the two ranks take together, taken by one process with grad_accum_steps=4."""
    model, optimizer = new_model_and_optimizer()
    result = take_step(model, optimizer, micro_batches(4), grad_accum_steps=4)
    # What each rank should hold after its first micro-step if nothing was synced: its own micro-batch's gradient.
    local = []
    for rank in range(2):
        fresh, _ = new_model_and_optimizer()
        x, y = micro_batches(4)[rank]
        (fresh(x, y)[1] / 2).backward()
        local.append(flat_grad(fresh))
    return {"grad": flat_grad(model), "params": flat_params(model), "loss": result.loss,
            "grad_norm": result.grad_norm, "local_grad_after_micro_step_0": local}


@pytest.mark.slow
def test_gradients_are_all_reduced_once_per_step_after_the_last_micro_step(two_ranks, one_rank_reference):
    for rank, results in enumerate(two_ranks):
        ddp = results["ddp"]
        assert ddp["allreduces_before_micro_step"] == [0, 0]  # micro-step 0's backward sent nothing
        assert set(Counter(ddp["allreduced_buckets"]).values()) == {1}  # each bucket exactly once
        # Between the micro-steps, each rank holds only its own local gradient.
        torch.testing.assert_close(ddp["grad_after_micro_step_0"],
                                   one_rank_reference["local_grad_after_micro_step_0"][rank], rtol=1e-5, atol=1e-7)
    assert not torch.allclose(two_ranks[0]["ddp"]["grad_after_micro_step_0"],
                              two_ranks[1]["ddp"]["grad_after_micro_step_0"])


@pytest.mark.slow
def test_the_sync_check_catches_a_step_that_syncs_every_micro_step(two_ranks):
    for results in two_ranks:
        always = results["always_sync"]
        assert always["allreduces_before_micro_step"][1] > 0
        assert set(Counter(always["allreduced_buckets"]).values()) == {2}  # every bucket, after both micro-steps
    # Synced after micro-step 0 the ranks already agree, which is what the test above rules out.
    torch.testing.assert_close(two_ranks[0]["always_sync"]["grad_after_micro_step_0"],
                               two_ranks[1]["always_sync"]["grad_after_micro_step_0"])


@pytest.mark.slow
def test_two_ranks_step_like_one_rank_with_twice_the_accumulation(two_ranks, one_rank_reference):
    rank0, rank1 = (r["ddp"] for r in two_ranks)
    assert torch.equal(rank0["params"], rank1["params"])  # the same update on both ranks, bit for bit
    torch.testing.assert_close(rank0["grad"], one_rank_reference["grad"], rtol=1e-5, atol=1e-7)
    # Adam's first update is lr·g/(|g| + eps) ≈ ±lr, which turns rounding in tiny gradients into up to ~lr/100.
    torch.testing.assert_close(rank0["params"], one_rank_reference["params"], rtol=0, atol=1e-5)
    for r in (rank0, rank1):  # the loss both ranks report is the mean over all 4 micro-batches
        assert r["loss"] == pytest.approx(one_rank_reference["loss"], rel=1e-6)
        assert r["grad_norm"] == pytest.approx(one_rank_reference["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_average_across_ranks_is_the_mean_on_gloo(two_ranks):
    for results in two_ranks:  # rank 0 holds 1 and [1, 10, 100], rank 1 twice that
        assert results["average_across_ranks"] == [1.5, [1.5, 15.0, 150.0]]


@pytest.mark.slow
def test_gloo_all_reduce_avg_gives_the_mean(two_ranks):
    # Documents gloo in the pinned torch: all_reduce with ReduceOp.AVG works and is right (gloo gained AVG in 2025,
    # pytorch#149781; before, it raised), so average_across_ranks' SUM / world_size on gloo is a fallback only.
    for results in two_ranks:
        assert results["gloo_avg"] == [1.5, [1.5, 15.0, 150.0]]


# ----------------------------------------------------------------------------------------------------------------
# fp16 (with a GradScaler) and bf16 autocast on the CPU

def two_steps(dtype: torch.dtype, scaler: torch.amp.GradScaler | None = None):
    model, optimizer = new_model_and_optimizer()
    batches = micro_batches(4)
    return [take_step(model, optimizer, batches[2 * i: 2 * i + 2], 2, dtype, scaler) for i in range(2)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_steps_match_fp32(dtype):
    fp32 = two_steps(torch.float32)
    low = two_steps(dtype, torch.amp.GradScaler("cpu", enabled=dtype == torch.float16))
    for ours, reference in zip(low, fp32):
        assert not ours.skipped and math.isfinite(ours.loss)
        assert ours.loss == pytest.approx(reference.loss, abs=2e-3)  # measured: fp16 7e-6 off, bf16 4e-5
        # The norm is of the unscaled gradients (fp16 scales them by 2^16), and it is not fp32's to the last bit,
        # so autocast really computed in low precision.
        assert ours.grad_norm == pytest.approx(reference.grad_norm, rel=1e-2)
        assert ours.grad_norm != reference.grad_norm


def test_the_step_loss_is_the_mean_of_the_micro_batch_losses_and_its_norm_that_of_their_mean():
    model, optimizer = new_model_and_optimizer()
    batches = micro_batches(4)
    reference = copy.deepcopy(model)  # independently: full logits, F.cross_entropy, one backward of the mean
    mean = torch.stack([F.cross_entropy(reference(x)[0].flatten(0, 1), y.flatten()) for x, y in batches]).mean()
    mean.backward()
    result = take_step(model, optimizer, batches, grad_accum_steps=4)
    assert result.loss == pytest.approx(mean.item(), rel=1e-6)
    assert result.grad_norm == pytest.approx(flat_grad(reference).norm().item(), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_with_muon_both_optimizers_step_and_every_parameter_moves(dtype, cpu_bf16):
    torch.manual_seed(0)
    model = GPT(SMALL)
    optimizer = build_optimizers(model, TrainConfig(optimizer="muon", max_lr=1e-3), "cpu")
    before = [p.detach().clone() for p in model.parameters()]
    result = take_step(model, optimizer, micro_batches(2), 2, dtype,
                       torch.amp.GradScaler("cpu", enabled=dtype == torch.float16))
    assert not result.skipped
    assert [torch.equal(p, b) for p, b in zip(model.parameters(), before)] == [False] * len(before)
    adamw = optimizer.by_name["adamw"]  # (the embeddings, biases and LayerNorms; Muon has the block matrices)
    assert all(adamw.state[p]["exp_avg"].abs().sum() > 0 for group in adamw.param_groups for p in group["params"])


def test_fp16_overflow_skips_the_update():
    model, optimizer = new_model_and_optimizer()
    before = flat_params(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # loss · 2^40 overflows fp16 in the backward pass
    result = take_step(model, optimizer, micro_batches(2), 2, torch.float16, scaler)
    assert result.skip_reason == "fp16 overflow"
    assert math.isfinite(result.loss)
    assert torch.equal(flat_params(model), before)
    assert all(not each.state for each in optimizer)  # no optimizer ran, so no moment took the inf in
    assert scaler.get_scale() == 2.0**39  # halved for the next try


# ----------------------------------------------------------------------------------------------------------------
# errors for bad flags

@pytest.mark.parametrize("world_size", [1, 2])
def test_total_batch_not_divisible_names_the_flag_and_a_valid_value(world_size):
    cfg = parse_args(["--micro_batch_size", "4", "--total_batch_size", "1000"])  # not a multiple of 4·64·ranks
    with pytest.raises(UserError) as error:
        grad_accum_steps_for(cfg, seq_len=64, world_size=world_size)
    message = str(error.value)
    suggestion, accumulation = (768, 3) if world_size == 1 else (512, 1)
    assert "--total_batch_size 1000" in message and f"e.g. {suggestion}" in message
    assert grad_accum_steps_for(replace(cfg, total_batch_size=suggestion), 64, world_size) == accumulation


def test_unknown_model_preset_lists_the_presets():
    with pytest.raises(UserError, match=r"--model 'gpt3' is not a known preset; choose one of gpt2, .*tiny"):
        model_config(parse_args(["--model", "gpt3"]))


def test_width_not_divisible_by_heads_is_rejected():
    with pytest.raises(UserError, match="--n_embd 100 must be a multiple of --n_head 3"):
        model_config(parse_args(["--model", "tiny", "--n_embd", "100", "--n_head", "3"]))


def test_seq_len_longer_than_block_size_is_rejected(tmp_path):
    cfg = parse_args(["--model", "tiny", "--seq_len", "65", "--data_dir", str(tmp_path), "--val_every", "0"])
    with pytest.raises(UserError, match="--seq_len 65 exceeds the model's --block_size 64"):
        resolve_plan(cfg, world_size=1)


@pytest.mark.parametrize("schedule", ["64", "4:a", "3:10", "4:9,8:5", "4:0,8:5", "32:4"])
def test_a_bad_short_rows_schedule_names_the_flag_and_an_example(tmp_path, schedule):
    cfg = parse_args(["--model", "tiny", "--seq_len", "16", "--short_rows", schedule, "--data_dir", str(tmp_path),
                      "--val_every", "0"])
    with pytest.raises(UserError, match=f"--short_rows '{schedule}': .* e.g. '64:50,128:100'"):
        resolve_plan(cfg, world_size=1)


@pytest.mark.parametrize("beta1", ["1.0", "-0.1"])
def test_an_adam_beta1_outside_0_to_1_names_the_flag(tmp_path, beta1):
    cfg = parse_args(["--model", "tiny", "--adam_beta1", beta1, "--data_dir", str(tmp_path)])
    with pytest.raises(UserError, match=f"--adam_beta1 {beta1}: pass a number at least 0 and below 1 \\(--help: "
                                        "\"AdamW's first-moment decay"):
        resolve_plan(cfg, world_size=1)


def test_short_rows_train_on_the_same_tokens_cut_into_shorter_rows():
    model, optimizer = new_model_and_optimizer()
    batches = micro_batches(2)
    reference = copy.deepcopy(model)  # independently: each (B, T) micro-batch as (4B, T/4) rows of 4 tokens
    mean = torch.stack([F.cross_entropy(reference(x.reshape(-1, 4))[0].flatten(0, 1), y.flatten())
                        for x, y in batches]).mean()
    whole_rows = torch.stack([F.cross_entropy(reference(x)[0].flatten(0, 1), y.flatten()) for x, y in batches]).mean()
    result = train_step(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), ListLoader(batches), 2,
                        lr=1e-3, grad_clip=0.0, device=CPU, dtype=torch.float32, row_length=4)
    assert result.loss == pytest.approx(mean.item(), rel=1e-6)
    assert abs(mean.item() - whole_rows.item()) > 1e-3  # (so the rows were really cut)


# ----------------------------------------------------------------------------------------------------------------
# whole runs of train_gpt2.py

RANK_RUN_ARGS = ["--micro_batch_size", "4", "--seq_len", "32", "--total_batch_size", "512", "--max_steps", "5",
                 "--warmup_steps", "2", "--max_lr", "1e-2", "--dtype", "fp32", "--val_every", "2",
                 "--val_tokens", "512", "--snapshot_every", "0"]


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory):
    """The same 5 steps of 512 tokens (micro-batches of 4 × 32): 1 process × 4 micro-steps, and 2 torchrun ranks ×
    2 micro-steps."""
    tmp = tmp_path_factory.mktemp("ranks")
    # Tokens from a 100-word vocabulary: learnable, so the loss falls fast and the steps really differ. (The bytes
    # tokenizer's shards: a model 257 ids wide, not 50,304.)
    make_shards(tmp / "data", "train", [8 * 512 + 1], vocab=100, tokenizer="bytes")
    make_shards(tmp / "data", "val", [4 * 128 + 1], seed=1, vocab=100, tokenizer="bytes")
    args = ["--data_dir", str(tmp / "data"), *RANK_RUN_ARGS]
    return run_train(args, tmp / "one"), run_train(args, tmp / "two", nproc=2)


@pytest.mark.slow
def test_two_ranks_train_like_one_rank(rank_runs):
    one, two = rank_runs
    assert "1 ranks × 4 accumulation steps" in one.proc.stdout and "2 ranks × 2 accumulation steps" in two.proc.stdout
    assert [r["step"] for r in one.train] == [r["step"] for r in two.train] == list(range(5))  # rank 0 logs alone
    assert one.train[-1]["loss"] < one.train[0]["loss"] - 0.5  # the steps move the model a lot
    for a, b in zip(one.train, two.train):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        # Adam ignores the scale of the gradient, so the norm is what shows a gradient summed instead of averaged.
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["lr"] == a["lr"]
    assert [r["step"] for r in one.val] == [r["step"] for r in two.val] == [0, 2, 4]
    for a, b in zip(one.val, two.val):
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-4)


@pytest.mark.slow
def test_loss_falls_on_tiny_shakespeare(tmp_path, shared_data, gpt2_encoding):
    text = (shared_data / "tinyshakespeare" / "input.txt").read_text()
    write_text_shards(tmp_path / "data", text, gpt2_encoding)
    run = run_train(["--data_dir", str(tmp_path / "data"), "--micro_batch_size", "4", "--seq_len", "32",
                     "--total_batch_size", "128", "--max_steps", "30", "--warmup_steps", "5", "--max_lr", "3e-3",
                     "--dtype", "fp32", "--val_every", "15", "--val_tokens", "2048", "--snapshot_every", "0"],
                    tmp_path / "logs")
    losses = [r["loss"] for r in run.train]
    assert len(losses) == 30
    assert losses[0] == pytest.approx(math.log(50257), abs=0.1)  # an untrained model guesses uniformly
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0
    val = [r["val_loss"] for r in run.val]
    assert [r["step"] for r in run.val] == [0, 15, 29]
    assert val[-1] < val[0] - 2.0


@pytest.mark.slow
def test_metrics_jsonl_has_the_documented_keys(rank_runs):
    data = rank_runs[0].proc.args[rank_runs[0].proc.args.index("--data_dir") + 1]
    for train_run in rank_runs:
        assert len(train_run.records) == 5 + 3 + 1  # steps, validations, the timeline record
        for r in train_run.train:
            assert set(r) == {"step", "loss", "lr", "grad_norm", "dt_ms", "tokens_per_sec", "mfu", "tokens_by_source",
                              "epoch_by_source"}
            assert r["tokens_by_source"] == {data: 512 * (r["step"] + 1)} and r["epoch_by_source"] == {data: 0}
            assert r["tokens_per_sec"] == pytest.approx(512 / (r["dt_ms"] / 1000)) and r["mfu"] > 0
        assert all(set(r) == {"step", "val_loss", "val_bpb"} for r in train_run.val)


# ----------------------------------------------------------------------------------------------------------------
# what reaches the optimizer: the clipped gradients and the scheduled learning rate

def spy_on_adamw_steps(monkeypatch) -> list[dict]:
    """Record, at every AdamW update, the learning rates of its param groups and the global gradient norm."""
    seen, real_step = [], torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        seen.append({"lrs": [group["lr"] for group in self.param_groups],
                     "grad_norm": torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()})
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return seen


@pytest.mark.parametrize("grad_clip", [0.05, 0.0])
def test_the_optimizer_sees_gradients_clipped_to_grad_clip_and_zero_means_off(monkeypatch, grad_clip):
    seen = spy_on_adamw_steps(monkeypatch)
    model, optimizer = new_model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    result = train_step(model, optimizer, scaler, ListLoader(micro_batches(2)), 2, lr=1e-3, grad_clip=grad_clip,
                        device=CPU, dtype=torch.float32)
    assert result.grad_norm > 0.5  # the norm before clipping, well above the clip below
    expected = grad_clip if grad_clip else result.grad_norm
    assert seen[0]["grad_norm"] == pytest.approx(expected, rel=1e-5)


def test_every_update_of_a_real_run_uses_the_scheduled_learning_rate(tmp_path, monkeypatch):
    seen = spy_on_adamw_steps(monkeypatch)
    make_shards(tmp_path / "data", "train", [2000], vocab=256, tokenizer="bytes")  # (a model 257 ids wide)
    make_shards(tmp_path / "data", "val", [500], seed=1, vocab=256, tokenizer="bytes")
    cfg = parse_args(["--model", "tiny", "--device", "cpu", "--data_dir", str(tmp_path / "data"), "--log_dir",
                      str(tmp_path / "logs"), "--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size",
                      "32", "--max_steps", "8", "--warmup_steps", "3", "--max_lr", "1e-3", "--val_every", "0",
                      "--eval_every", "0", "--sample_every", "0", "--snapshot_every", "0", "--dtype", "fp32"])
    run(cfg, Distributed(0, 0, 1, CPU))
    # Written out from the schedule's definition: warmup 1/3, 2/3, 3/3 of max_lr in steps 0-2, then a cosine from
    # max_lr at step 3 to min_lr = 1e-4 at step 7, the last.
    schedule = [1e-3 / 3, 2e-3 / 3, 1e-3] + [1e-4 + 0.5 * (1 + math.cos(math.pi * k / 4)) * 9e-4 for k in range(5)]
    assert len(seen) == 8
    for lrs, expected in zip([s["lrs"] for s in seen], schedule):
        assert lrs == [pytest.approx(expected, rel=1e-12)] * 2  # both groups: decayed and not


def record_calls(monkeypatch, cls: type, method: str, record) -> None:
    """Call record(self, *args) before every call of cls.method."""
    real = getattr(cls, method)

    def spied(self, *args, **kwargs):
        record(self, *args)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(cls, method, spied)


def test_a_real_run_follows_the_momentum_warmup_the_short_rows_and_adams_beta1(tmp_path, monkeypatch, cpu_bf16):
    momenta, adam_betas, rows = [], [], []
    record_calls(monkeypatch, Muon, "step", lambda muon: momenta.append(muon.param_groups[0]["momentum"]))
    record_calls(monkeypatch, torch.optim.AdamW, "step",
                 lambda adam: adam_betas.append({group["betas"] for group in adam.param_groups}))
    record_calls(monkeypatch, GPT, "forward", lambda gpt, idx, *args: rows.append(tuple(idx.shape)))
    make_shards(tmp_path / "data", "train", [2000], vocab=256, tokenizer="bytes")  # (a model 257 ids wide)
    cfg = parse_args(["--model", "tiny", "--device", "cpu", "--data_dir", str(tmp_path / "data"), "--log_dir",
                      str(tmp_path / "logs"), "--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size",
                      "32", "--max_steps", "8", "--warmup_steps", "3", "--val_every", "0", "--eval_every", "0",
                      "--sample_every", "0", "--snapshot_every", "0", "--dtype", "fp32", "--optimizer", "muon",
                      "--muon_momentum_warmup", "4", "--short_rows", "4:2,8:5", "--adam_beta1", "0.8"])
    run(cfg, Distributed(0, 0, 1, CPU))
    # From 0.85 up to --muon_momentum's 0.95 in 4 steps; rows of 4 tokens in steps 0-1, of 8 in 2-4, then 16.
    assert momenta == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95, 0.95, 0.95], abs=1e-12)
    assert rows == [(8, 4)] * 2 + [(4, 8)] * 3 + [(2, 16)] * 3
    assert adam_betas == [{(0.8, 0.95)}] * 8
