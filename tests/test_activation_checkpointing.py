"""--activation_checkpointing none|blocks|selective: the same losses and gradients as keeping every activation (one
process, 2 ranks under ddp and under fsdp, compiled), the recomputation each mode promises (counted in FLOPs), and
the memory model measuring with it (see test_memory.py for GPT-2 124M's figures)."""

import contextlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import perturb_
from helpers_train import RandomBatches, on_ranks
from model import GPT, GPTConfig
from training.config import TrainConfig, parse_args
from training.distributed import Distributed
from training.memory import auto_micro_batch, measure_activation_bytes_per_sequence
from training.parallel import build_training_model
from training.recompute import recompute_cheap_ops, set_activation_checkpointing
from training.step import train_step

CONFIG = GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=32)
MODES = ("none", "blocks", "selective")


def loss_gradients_and_flops(mode: str, compile: bool = False, config: GPTConfig = CONFIG,
                             perturb: float = 0.0) -> tuple[float, list[torch.Tensor], int]:
    """One forward and backward in fp32 of the same model and batch, with `mode`, and (eager) the FLOPs of the matmuls
    that ran (FlopCounterMode counts what executes: a recomputed matmul counts again; 0 compiled). Compiled as one
    graph (fullgraph): the checkpoint is compiled, not left to eager at a graph break. perturb: noise on every weight
    (arch="modern" starts with zero output projections, through which no gradient would reach the rest)."""
    torch.manual_seed(0)
    model = perturb_(GPT(config), perturb)
    set_activation_checkpointing(model, mode)
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size + 1), generator=torch.Generator().manual_seed(1))
    flops = FlopCounterMode(display=False)
    with contextlib.nullcontext() if compile else flops:
        _, loss = (torch.compile(model, fullgraph=True) if compile else model)(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    return loss.item(), [p.grad for p in model.parameters()], flops.get_total_flops()


@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_checkpointing_gives_the_same_loss_and_gradients_and_recomputes_what_it_says(mode):
    loss, grads, flops = loss_gradients_and_flops(mode)
    kept_loss, kept_grads, kept_flops = loss_gradients_and_flops("none")
    assert loss == pytest.approx(kept_loss, rel=1e-6, abs=0)
    assert all(torch.allclose(g, k, rtol=0, atol=1e-6 * k.abs().max()) for g, k in zip(grads, kept_grads))
    if mode == "blocks":  # every block's forward runs again in backward, up to its last matmul: torch's recomputation
        # stops once backward has the tensors it needs, and the MLP's projection needs only its input, recomputed
        x = torch.zeros(2, CONFIG.block_size, CONFIG.n_embd)
        with FlopCounterMode(display=False) as forward, torch.no_grad():
            for block in GPT(CONFIG).transformer.h:
                block(x)
        last_matmuls = CONFIG.n_layer * 2 * x[..., 0].numel() * 4 * CONFIG.n_embd * CONFIG.n_embd
        assert flops == kept_flops + forward.get_total_flops() - last_matmuls > kept_flops
    else:  # the matmuls' and attention's outputs are kept: only cheap ops run again
        assert flops == kept_flops


@pytest.mark.slow  # over 3 s on two busy cores: keeps `-m 'not slow'` within a minute
def test_less_is_kept_for_backward_and_auto_micro_batch_fits_more_sequences(monkeypatch):
    from training import memory
    per_sequence = {mode: measure_activation_bytes_per_sequence(CONFIG, CONFIG.block_size, torch.float32,
                                                                activation_checkpointing=mode) for mode in MODES}
    assert per_sequence["blocks"] < per_sequence["selective"] < per_sequence["none"]
    # --micro_batch_size auto measures with the run's mode: 64 sequences per rank, room for about 40 of none's
    monkeypatch.setattr(memory, "available_bytes", lambda device, ranks: int(
        (memory.fixed_bytes(CONFIG, 1, "ddp", torch.float32) + 40.5 * per_sequence["none"]) / 0.9))
    sizes = {mode: auto_micro_batch(CONFIG, 32, 64 * 32, 1, torch.device("cpu"), torch.float32, 1,
                                    activation_checkpointing=mode).size for mode in MODES}
    assert sizes["none"] == 32 and sizes["blocks"] == 64


def test_the_flag_reaches_every_block_and_is_checked():
    cfg = parse_args(["--activation_checkpointing", "selective"])
    trainee = build_training_model(GPT(CONFIG), Distributed(0, 0, 1, torch.device("cpu")), torch.float32, cfg,
                                   compile=False)
    assert [block.recompute for block in trainee.raw.transformer.h] == [recompute_cheap_ops] * CONFIG.n_layer
    assert parse_args([]).activation_checkpointing == "none"
    with pytest.raises(SystemExit):
        parse_args(["--activation_checkpointing", "all"])


def checkpointing_worker(rank: int) -> dict:
    """3 steps of 2 ranks, each of its own batches, for each parallelism and mode: the losses and gradient norms."""
    results = {}
    for parallel in ("ddp", "fsdp"):
        for mode in MODES:
            torch.manual_seed(0)
            trainee = build_training_model(GPT(CONFIG), Distributed(rank, rank, 2, torch.device("cpu")), torch.float32,
                                  TrainConfig(activation_checkpointing=mode), compile=False, parallel=parallel)
            batches = RandomBatches(rank, CONFIG.vocab_size, seq_len=CONFIG.block_size)
            steps = [train_step(trainee.model, trainee.optimizer, trainee.scaler, batches, 2, 1e-3, 1.0,
                                torch.device("cpu"), torch.float32) for _ in range(3)]
            results[f"{parallel} {mode}"] = [value for s in steps for value in (s.loss, s.grad_norm)]
    return results


@pytest.mark.slow  # two spawned processes
def test_checkpointed_training_on_two_ranks_gives_the_same_losses_under_ddp_and_fsdp(tmp_path):
    for rank in on_ranks(checkpointing_worker, tmp_path):
        for parallel in ("ddp", "fsdp"):
            kept = rank[f"{parallel} none"]  # loss, grad norm, loss, ...
            assert kept[-2] < kept[0]
            for mode in ("blocks", "selective"):
                assert rank[f"{parallel} {mode}"] == pytest.approx(kept, rel=1e-6, abs=0), (parallel, mode)


@pytest.mark.slow  # torch.compile: about 20 s per mode on a CPU
@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_compiled_checkpointing_gives_the_same_loss_and_gradients(mode):
    loss, grads, _ = loss_gradients_and_flops(mode, compile=True)
    kept_loss, kept_grads, _ = loss_gradients_and_flops("none")
    assert loss == pytest.approx(kept_loss, rel=1e-6, abs=0)
    assert all(torch.allclose(g, k, rtol=0, atol=1e-5 * k.abs().max()) for g, k in zip(grads, kept_grads))
