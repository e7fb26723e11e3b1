"""optim.py: which optimizer updates which parameter, Muon's Newton–Schulz where bf16 is slow, Muon's work shared by
the ranks (ddp, fsdp), the LR schedules and extending a run; and Muon through the whole run: DDP, FSDP, fp16,
snapshots, resume (exact, after a killed rank, on another number of ranks)."""

import copy
import math
import os
import signal
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.optim._muon as torch_muon
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

import cpu_host
import train_gpt2
from conftest import ROOT, copy_run, make_shards
from helpers_train import (
    RandomBatches,
    launched,
    main_in_process,
    on_ranks,
    read_metrics,
    records_so_far,
    run_train,
    wait_until,
    worker_pids,
)
from model import GPT, PRESETS
from rundir.snapshot import list_snapshots, load_snapshot, snapshot_path
from training import optim
from training.config import TrainConfig
from training.distributed import Distributed, teardown_distributed
from training.errors import UserError
from training.optim import Muon, build_optimizers, get_lr, muon_owners, newton_schulz, schedule_change, split_for_muon
from training.parallel import build_training_model, shard
from training.precision import pick_dtype
from training.safe_load_shards import read_shard_metadata
from training.step import train_step

TINY = PRESETS["tiny"]
FP32_NEWTON_SCHULZ = ROOT / "tests" / "train_with_fp32_newton_schulz.py"
BLOCK_MATRICES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


# ----------------------------------------------------------------------------------------------------------------
# the parameter split

def test_adamw_decays_matrices_only():
    model = GPT(TINY)
    optimizers = build_optimizers(model, TrainConfig(weight_decay=0.1, max_lr=6e-4), device_type="cpu")
    assert list(optimizers.by_name) == ["adamw"]
    optimizer = optimizers.by_name["adamw"]
    names = {id(p): name for name, p in model.named_parameters()}  # tied lm_head appears once, as wte
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = {names[id(p)] for p in decay["params"]}
    free = {names[id(p)] for p in no_decay["params"]}
    assert all(n.endswith(("wte.weight", "wpe.weight", "c_attn.weight", "c_proj.weight", "c_fc.weight"))
               for n in decayed)
    assert all(n.endswith("bias") or ".ln_" in n for n in free)
    assert len(decayed) == 2 + 4 * TINY.n_layer  # wte, wpe + four matrices per block
    assert len(free) == 2 + 8 * TINY.n_layer  # ln_f's gain and bias; per block 2 LayerNorms x 2 and 4 biases
    # Every parameter in exactly one group.
    ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(names)
    for group in optimizer.param_groups:
        assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-8 and group["lr"] == 6e-4


def test_muon_takes_the_block_matrices_and_adamw_everything_else_each_exactly_once():
    model = GPT(TINY)
    optimizers = build_optimizers(model, TrainConfig(optimizer="muon", max_lr=1e-3, muon_lr=0.02), "cpu")
    names = {id(p): name for name, p in model.named_parameters()}
    muon, adamw = optimizers.by_name["muon"], optimizers.by_name["adamw"]
    in_muon = [names[id(p)] for g in muon.param_groups for p in g["params"]]
    in_adamw = [names[id(p)] for g in adamw.param_groups for p in g["params"]]
    assert sorted(in_muon) == sorted(f"transformer.h.{i}.{m}.weight" for i in range(TINY.n_layer)
                                     for m in BLOCK_MATRICES)
    assert sorted(in_muon + in_adamw) == sorted(names.values())  # each once, none left out
    assert model.lm_head.weight is model.transformer.wte.weight and "transformer.wte.weight" in in_adamw
    # Both follow the schedule: Muon's LR is the schedule's scaled by muon_lr / max_lr.
    optimizers.set_lr(5e-4)
    assert [g["lr"] for g in muon.param_groups] == [pytest.approx(0.01, rel=1e-12)]
    assert [g["lr"] for g in adamw.param_groups] == [5e-4, 5e-4]


def test_an_adamw_state_saved_before_optimizers_were_named_is_refused_naming_what_it_holds():
    model = GPT(TINY)
    plain = optim.adamw(list(model.parameters()), TrainConfig(), "cpu", fused=False)  # GPT-2's two groups, as before
    optimizers = build_optimizers(model, TrainConfig(), "cpu", fused=False)
    with pytest.raises(ValueError, match=r"holds \['param_groups', 'state'\], this run has \['adamw'\]"):
        optimizers.load_state_dict(plain.state_dict())


# ----------------------------------------------------------------------------------------------------------------
# Newton–Schulz: torch's iteration, batched by shape, in fp32 where bf16 is slow

NS_ARGS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)  # torch.optim.Muon's defaults


def alone(matrix: torch.Tensor, *args) -> torch.Tensor:
    """newton_schulz of one matrix, wide or tall: as torch's _zeropower_via_newtonschulz takes it."""
    tall = matrix.size(0) > matrix.size(1)
    result = newton_schulz((matrix.T if tall else matrix)[None], *(args or NS_ARGS))[0]
    return result.T if tall else result


@pytest.mark.parametrize("shape", [(48, 16), (16, 48)])
@pytest.mark.parametrize("slow", [False, True])
def test_newton_schulz_is_torchs_iteration_in_bf16_or_fp32(monkeypatch, shape, slow):
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    theirs = torch_muon._zeropower_via_newtonschulz(grad, *NS_ARGS).float()  # bf16
    monkeypatch.setattr(optim, "bf16_matmul_is_slow", lambda device: slow)
    ours = alone(grad)
    assert ours.dtype == (torch.float32 if slow else torch.bfloat16) and ours.shape == grad.shape
    # bf16: the same operations (equal on this machine's CPU); fp32: bf16's rounding, compounded over 5 iterations
    assert (ours.float() - theirs).norm() / theirs.norm() < (0.02 if slow else 0.005)


def test_newton_schulz_runs_in_fp32_exactly_where_the_cpu_has_no_bf16_arithmetic(cpu_bf16):
    grad = torch.randn(16, 48, generator=torch.Generator().manual_seed(0))
    assert newton_schulz(grad[None], *NS_ARGS).dtype == (torch.bfloat16 if cpu_bf16 else torch.float32)
    assert pick_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if cpu_bf16 else torch.float32)


@pytest.mark.parametrize("avx512_bf16", [False, True])
@pytest.mark.parametrize("amx", [False, True])
def test_a_cpu_has_bf16_arithmetic_with_avx512_bf16_or_amx(monkeypatch, avx512_bf16, amx):
    """The detection itself (every other test forces its answer: conftest.py's cpu_bf16)."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert cpu_host.detected_bf16_arithmetic() == (avx512_bf16 or amx)


@pytest.mark.parametrize("slow", [False, True])
def test_muon_orthogonalises_each_shape_once_as_a_stack_and_each_matrix_as_alone(monkeypatch, slow):
    """A tall matrix joins the wide ones of its transposed shape; the results come back in order, in fp32, each
    what newton_schulz gives the matrix alone."""
    monkeypatch.setattr(optim, "bf16_matmul_is_slow", lambda device: slow)
    generator = torch.Generator().manual_seed(0)
    updates = [torch.randn(*shape, generator=generator) for shape in ((48, 16), (16, 48), (16, 16), (16, 48), (24, 8))]
    calls, real = [], optim.newton_schulz
    monkeypatch.setattr(optim, "newton_schulz", lambda stack, *args: calls.append(tuple(stack.shape)) or real(stack,
                                                                                                              *args))
    results = optim.orthogonalise_by_shape(updates, *NS_ARGS)
    assert sorted(calls) == [(1, 8, 24), (1, 16, 16), (3, 16, 48)]
    for update, result in zip(updates, results):
        one = alone(update).float()
        assert result.dtype == torch.float32 and result.is_contiguous() and result.shape == update.shape
        assert (result - one).abs().max() <= 1e-5 * one.abs().max()  # fp32: a stack's matmul may round apart


def set_random_grads(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)


# ----------------------------------------------------------------------------------------------------------------
# Muon's work shared by the ranks

def test_muon_owners_give_each_matrix_one_rank_and_every_rank_a_fair_share_of_the_work():
    with torch.device("meta"):
        shapes = [p.shape for p in split_for_muon(GPT(PRESETS["gpt2"]))[0]]  # 12 × (c_attn, c_proj, c_fc, c_proj)

    def work(shape):  # Newton–Schulz's multiply-adds per iteration, as muon_owners counts them
        m, n = sorted(shape)
        return m * m * (2 * n + m)

    for world_size, worst in ((1, 1.0), (2, 1.0), (3, 1.0), (8, 1.03)):
        owners = muon_owners(shapes, world_size)
        assert owners == muon_owners(shapes, world_size) and sorted(set(owners)) == list(range(world_size))
        load = [sum(work(s) for s, o in zip(shapes, owners) if o == r) for r in range(world_size)]
        assert max(load) / (sum(load) / world_size) <= worst + 1e-9, (world_size, load)
    assert muon_owners(shapes[:3], 8) == [1, 2, 0]  # fewer matrices than ranks: one each, the largest (c_fc) first


@pytest.fixture
def process_group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    teardown_distributed()


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("parallel", ["one process", "ddp", "fsdp"])
def test_muon_updates_exactly_as_torchs_muon(monkeypatch, request, parallel, adjust_lr, cpu_bf16):
    """The update itself, on one process, with whole matrices shared by the ranks (ddp) or fsdp's DTensor shards,
    against torch.optim.Muon on a plain model: momentum, Nesterov, decoupled weight decay and the per-shape LR, on
    wide and tall matrices. Both run optim.newton_schulz (torch's would round in bf16 where ours may not), torch's
    once per matrix, ours batched by shape."""
    if parallel != "one process":  # (one process needs none, and tearing one down takes a while)
        request.getfixturevalue("process_group_of_one")
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", alone)
    model = GPT(TINY)
    reference = copy.deepcopy(model)
    initial = [p.detach().clone() for p in split_for_muon(reference)[0]]
    if parallel == "fsdp":
        shard(model, torch.float32, init_device_mesh("cpu", (1,)))
    settings = dict(lr=0.02, weight_decay=0.01, momentum=0.9, adjust_lr_fn=adjust_lr)
    ours, theirs = Muon(split_for_muon(model)[0], shared=parallel != "one process", **settings), torch.optim.Muon(
        split_for_muon(reference)[0], **settings)
    for seed in range(3):
        set_random_grads(reference, seed)
        for p, q in zip(model.parameters(), reference.parameters()):
            p.grad = distribute_tensor(q.grad, p.device_mesh, p.placements) if parallel == "fsdp" else q.grad.clone()
        ours.step()
        theirs.step()
    whole = [p.full_tensor() if parallel == "fsdp" else p for p in split_for_muon(model)[0]]
    # The one difference is the order of additions in a stack's matmuls against a single matrix's: in fp32, roundings
    # of the orthogonalised update (entries below 1) of ~1e-7, times lr · its scale (≤ 0.064), over 3 steps: ≤ 1e-6
    # (5e-8 measured, with AMX and as AVX2-only). In bf16 its roundings hide them: equal bit for bit on both.
    assert max((p - q).abs().max().item() for p, q in zip(whole, split_for_muon(reference)[0])) <= 1e-6
    assert not any(torch.equal(p, q) for p, q in zip(whole, initial))  # (they moved)


def muon_shares_worker(rank: int) -> dict:
    """Four steps of 2 DDP ranks with Muon's work shared and with each rank doing all of it (as before issue 27), the
    same model and batches (a rank's own, the same in every step: the loss falls); the shapes of the matrices each
    rank ran Newton–Schulz on (in stacks of a shape, a tall matrix transposed), per step."""
    calls, real = [], optim.newton_schulz

    def counted(stack, *args):
        calls.extend([sorted(stack.shape[1:])] * stack.size(0))
        return real(stack, *args)

    optim.newton_schulz = counted
    cfg = TrainConfig(optimizer="muon", max_lr=1e-3, muon_lr=0.05, muon_weight_decay=0.01)
    result, weights = {}, {}
    batch = RandomBatches(rank, TINY.vocab_size).next_batch()
    batches = SimpleNamespace(next_batch=lambda: batch)
    for name, shared in (("shares", True), ("all", False)):
        torch.manual_seed(0)
        trainee = build_training_model(GPT(TINY), Distributed(rank, rank, 2, torch.device("cpu")), torch.float32, cfg,
                              compile=False)
        optimizers = trainee.optimizer if shared else build_optimizers(trainee.raw, cfg, "cpu", shared=False)
        assert optimizers.by_name["muon"].shared == shared
        losses, orthogonalised = [], []
        for _ in range(4):
            before = len(calls)
            losses.append(train_step(trainee.model, optimizers, trainee.scaler, batches, 1, 1e-3, 1.0,
                                     torch.device("cpu"), torch.float32).loss)
            orthogonalised.append(sorted(calls[before:]))
        result[name] = {"losses": losses, "orthogonalised": orthogonalised}
        weights[name] = [p.detach().clone() for p in trainee.raw.parameters()]
    result["weight_difference"] = max((p - q).abs().max().item() for p, q in zip(weights["shares"], weights["all"]))
    return result


@pytest.mark.slow  # two spawned processes
def test_ddp_ranks_each_orthogonalise_their_share_and_update_as_every_rank_doing_all_did(tmp_path, cpu_bf16):
    ranks = on_ranks(muon_shares_worker, tmp_path)
    shapes = [p.shape for p in split_for_muon(GPT(TINY))[0]]
    owners = muon_owners(shapes, 2)
    for rank, result in enumerate(ranks):
        assert result["all"]["orthogonalised"] == [sorted(sorted(s) for s in shapes)] * 4  # the control: all of them
        share = sorted(sorted(s) for s, owner in zip(shapes, owners) if owner == rank)
        assert result["shares"]["orthogonalised"] == [share] * 4 and len(share) == len(shapes) // 2
        assert result["shares"]["losses"] == pytest.approx(result["all"]["losses"], rel=1e-6, abs=0)
        assert result["weight_difference"] <= 1e-6
    assert ranks[0]["shares"]["losses"] == ranks[1]["shares"]["losses"]
    assert ranks[0]["shares"]["losses"][-1] < ranks[0]["shares"]["losses"][0]


# ----------------------------------------------------------------------------------------------------------------
# resuming with other optimizer flags

OLD_FLAGS = {"weight_decay": 0.1, "muon_momentum": 0.95, "muon_weight_decay": 0.0, "muon_adjust_lr": "original"}
NEW_FLAGS = {"weight_decay": 0.5, "muon_momentum": 0.8, "muon_weight_decay": 0.05, "muon_adjust_lr": "match_rms_adamw"}


def torchs_own(model: GPT, cfg: TrainConfig) -> dict[str, torch.optim.Optimizer]:
    """The optimizers of `cfg`, built straight from torch with its flags (GPT-2's decay on matrices only)."""
    matrices, rest = optim.split_for_muon(model) if cfg.optimizer == "muon" else ([], list(model.parameters()))
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=cfg.max_lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    if cfg.optimizer == "adamw":
        return {"adamw": adamw}
    return {"muon": torch.optim.Muon(matrices, lr=cfg.muon_lr, weight_decay=cfg.muon_weight_decay,
                                     momentum=cfg.muon_momentum, adjust_lr_fn=cfg.muon_adjust_lr), "adamw": adamw}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_loaded_state_keeps_this_runs_optimizer_flags_and_says_which_it_replaced(optimizer, monkeypatch):
    old = TrainConfig(optimizer=optimizer, max_lr=1e-2, muon_lr=0.02, **OLD_FLAGS)
    new = TrainConfig(optimizer=optimizer, max_lr=1e-2, muon_lr=0.02, **NEW_FLAGS)
    # What the flags decide is compared bit for bit, so both sides orthogonalise with torch's own Newton–Schulz, one
    # matrix at a time, in bf16 on every CPU (ours batches by shape, in fp32 where bf16 is slow: tested above).
    monkeypatch.setattr(optim, "orthogonalise_by_shape", lambda updates, *args: [
        torch_muon._zeropower_via_newtonschulz(u, *args) for u in updates])
    model = GPT(TINY)
    saved = build_optimizers(model, old, "cpu")
    set_random_grads(model, seed=0)
    for o in saved:
        o.step()
    state = copy.deepcopy(saved.state_dict())
    for group in state["adamw"]["param_groups"]:
        group["betas"] = (0.8, 0.9)  # as a snapshot from a version of optim.py with other betas would hold

    resumed_model, reference_model = copy.deepcopy(model), copy.deepcopy(model)
    resumed = build_optimizers(resumed_model, new, "cpu")
    resumed.load_state_dict(copy.deepcopy(state))  # (loading keeps the tensors, which the step then changes)

    decay, free = resumed.by_name["adamw"].param_groups
    assert (decay["weight_decay"], free["weight_decay"]) == (0.5, 0.0)
    assert decay["betas"] == free["betas"] == (0.9, 0.95)
    if optimizer == "muon":
        (muon,) = resumed.by_name["muon"].param_groups
        assert (muon["momentum"], muon["weight_decay"], muon["adjust_lr_fn"]) == (0.8, 0.05, "match_rms_adamw")
    # The next update is that of torch's optimizers built with the new flags, given the same state.
    reference = torchs_own(reference_model, new)
    for name, o in reference.items():
        o.load_state_dict({"state": state[name]["state"], "param_groups": o.state_dict()["param_groups"]})
    set_random_grads(resumed_model, seed=1)
    set_random_grads(reference_model, seed=1)
    for o in (*resumed, *reference.values()):
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(resumed_model.parameters(), reference_model.parameters()))
    # What the state held instead, to be said at the resume.
    muon_changes = {"--muon_momentum": (0.95, 0.8), "--muon_weight_decay": (0.0, 0.05),
                    "--muon_adjust_lr": ("original", "match_rms_adamw")}
    assert resumed.replaced_settings == {"--weight_decay": (0.1, 0.5), "--adam_beta1": ((0.8, 0.9), (0.9, 0.95))} | (
        muon_changes if optimizer == "muon" else {})


def resume_with_other_flags(data, tmp_path, monkeypatch, capsys, parallel: str, old: list[str], new: list[str],
                            said: dict) -> None:
    """A run with the flags old, resumed with new: each step trains with new's settings, and the resume record says
    what they replaced."""
    args = ["--data_dir", str(data), "--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "32",
            "--warmup_steps", "1", "--max_steps", "3", "--val_every", "0", "--dtype", "fp32", "--snapshot_every", "2",
            "--parallel", parallel]
    main_in_process([*args, *old, "--log_dir", str(tmp_path / "before")])
    settings = []  # each step's, as train_step gets them

    def train_step(model, optimizers, *rest, **kwargs):
        settings.append({(name, key): value for name, o in optimizers.by_name.items()
                         for key, value in o.param_groups[0].items() if key in ("weight_decay", "momentum")})
        return real_train_step(model, optimizers, *rest, **kwargs)

    real_train_step = train_gpt2.train_step
    monkeypatch.setattr(train_gpt2, "train_step", train_step)
    snapshot = snapshot_path(tmp_path / "before", 1, sharded=parallel == "fsdp")
    main_in_process([*args, *new, "--log_dir", str(tmp_path / "after"), "--resume", str(snapshot)])
    flags = dict(zip(new[::2], new[1::2]))
    assert settings == [{("adamw", "weight_decay"): float(flags.get("--weight_decay", 0.1))} | (
        {("muon", "weight_decay"): 0.05, ("muon", "momentum"): 0.8} if "muon" in new else {})]
    resume = next(r for r in read_metrics(tmp_path / "after") if r.get("event") == "resume")
    assert resume["optimizer_settings"] == said
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "this run's flags apply" in line]
    assert all(f"{flag} {before} → {after}" in line for flag, (before, after) in said.items()), line


@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])  # (fsdp: 2 s)
def test_a_run_resumed_with_other_optimizer_flags_trains_with_them_and_says_so(data, tmp_path, monkeypatch, capsys,
                                                                               parallel):
    resume_with_other_flags(data, tmp_path, monkeypatch, capsys, parallel, ["--weight_decay", "0.1"],
                            ["--weight_decay", "0.5"], {"--weight_decay": [0.1, 0.5]})


def test_a_muon_run_resumed_with_other_muon_flags_trains_with_them_and_says_so(data, tmp_path, monkeypatch, capsys,
                                                                               cpu_bf16):
    resume_with_other_flags(data, tmp_path, monkeypatch, capsys, "ddp", ["--optimizer", "muon"],
                            ["--optimizer", "muon", "--muon_momentum", "0.8", "--muon_weight_decay", "0.05"],
                            {"--muon_momentum": [0.95, 0.8], "--muon_weight_decay": [0.0, 0.05]})


# ----------------------------------------------------------------------------------------------------------------
# the schedules

def test_cosine_warms_up_linearly_then_decays_to_min_lr():
    cfg = TrainConfig(max_lr=6e-4, min_lr_ratio=0.1, warmup_steps=10, max_steps=111)  # 100 decay intervals
    assert get_lr(0, cfg) == pytest.approx(6e-5, rel=1e-12)  # max_lr / warmup_steps
    assert get_lr(4, cfg) == pytest.approx(3e-4, rel=1e-12)
    assert get_lr(9, cfg) == pytest.approx(6e-4, rel=1e-12)  # end of warmup: the peak
    assert get_lr(10, cfg) == pytest.approx(6e-4, rel=1e-12)  # cosine at progress 0
    assert get_lr(35, cfg) == pytest.approx(6e-5 + 0.5 * (1 + math.sqrt(0.5)) * 5.4e-4, rel=1e-12)  # a quarter
    assert get_lr(60, cfg) == pytest.approx(3.3e-4, rel=1e-12)  # halfway: (max_lr + min_lr) / 2
    assert get_lr(110, cfg) == pytest.approx(6e-5, rel=1e-12)  # the last step: min_lr_ratio · max_lr
    decay = [get_lr(s, cfg) for s in range(10, 111)]
    assert all(a > b for a, b in zip(decay, decay[1:]))


def test_wsd_warms_up_holds_max_lr_then_decays_linearly_over_the_last_fraction():
    cfg = TrainConfig(lr_schedule="wsd", max_lr=1e-3, min_lr_ratio=0.1, warmup_steps=10, max_steps=110,
                      warmdown_frac=0.2)  # warmdown: the last 22 steps, 88..109
    assert get_lr(0, cfg) == pytest.approx(1e-4, rel=1e-12)
    assert get_lr(9, cfg) == get_lr(10, cfg) == get_lr(87, cfg) == 1e-3  # warmup's end, the stable phase
    assert get_lr(88, cfg) == pytest.approx(1e-4 + 21 / 22 * 9e-4, rel=1e-12)  # the first step of the decay
    assert get_lr(98, cfg) == pytest.approx(1e-4 + 11 / 22 * 9e-4, rel=1e-12)
    assert get_lr(109, cfg) == pytest.approx(1e-4, rel=1e-12)  # the last step: min_lr_ratio · max_lr
    assert sum(get_lr(s, cfg) < 1e-3 for s in range(10, 110)) == 22


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_a_run_one_step_longer_than_its_warmup_ends_at_min_lr(schedule):
    cfg = TrainConfig(lr_schedule=schedule, max_lr=1e-3, min_lr_ratio=0.1, warmup_steps=10, max_steps=11)
    assert get_lr(9, cfg) == pytest.approx(1e-3, rel=1e-12)  # the warmup's last step: the peak
    assert get_lr(10, cfg) == pytest.approx(1e-4, rel=1e-12)  # the run's last step: min_lr_ratio · max_lr


def test_schedule_change_at_a_resume_is_no_jump_for_wsd_in_its_stable_phase_and_a_warning_for_cosine():
    wsd = TrainConfig(lr_schedule="wsd", max_steps=1000, warmup_steps=10, warmdown_frac=0.2)
    assert schedule_change(500, vars(wsd), wsd) is None  # nothing changed: nothing to say
    line, jump = schedule_change(500, vars(wsd), TrainConfig(**vars(wsd) | {"max_steps": 3000}))
    assert not jump and "gives 6.000e-04, the new one 6.000e-04" in line
    # From the old warmdown, the LR goes back up: a jump, with the way around it.
    line, jump = schedule_change(900, vars(wsd), TrainConfig(**vars(wsd) | {"max_steps": 3000}))
    assert jump and "before step 2400" in line
    cosine = TrainConfig(max_steps=1000, warmup_steps=10)
    line, jump = schedule_change(800, vars(cosine), TrainConfig(max_steps=3000, warmup_steps=10))
    assert jump and "--lr_schedule wsd" in line


@pytest.mark.slow  # a few seconds: keeps `-m 'not slow'` under 90 s
def test_extending_a_finished_wsd_run_from_its_stable_phase_continues_at_max_lr(tmp_path, capsys):
    make_shards(tmp_path / "data", "train", [600], seed=0, vocab=257, tokenizer="bytes")  # (a model 257 ids wide)
    args = ["--data_dir", str(tmp_path / "data"), "--micro_batch_size", "2", "--seq_len", "16",
            "--total_batch_size", "32", "--warmup_steps", "1", "--max_lr", "1e-3", "--val_every", "0",
            "--snapshot_every", "2", "--keep_last", "5", "--dtype", "fp32", "--lr_schedule", "wsd", "--warmdown_frac",
            "0.5"]
    main_in_process([*args, "--max_steps", "6", "--log_dir", str(tmp_path / "short")])  # warmdown: steps 3-5
    main_in_process([*args, "--max_steps", "12", "--log_dir", str(tmp_path / "long"), "--resume",
                     str(snapshot_path(tmp_path / "short", 1))])
    out, err = capsys.readouterr()
    assert "already finished" not in out and "WARNING" not in err
    assert "at step 2 the old schedule gives 1.000e-03, the new one 1.000e-03" in out
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "long") if "lr" in r}
    assert [lrs[s] for s in range(2, 6)] == [1e-3] * 4  # where the short run had decayed
    # Under cosine, the same extension warns.
    cosine = [a if a != "wsd" else "cosine" for a in args]
    main_in_process([*cosine, "--max_steps", "6", "--log_dir", str(tmp_path / "cos")])
    main_in_process([*cosine, "--max_steps", "12", "--log_dir", str(tmp_path / "cos_long"), "--resume",
                     str(snapshot_path(tmp_path / "cos", 3))])  # (a directory of its own: "cos" holds step 5)
    assert "WARNING: the LR schedule changed" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# Muon through the run

JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--warmup_steps", "2",
       "--val_every", "0", "--optimizer", "muon", "--muon_lr", "0.05"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon_data")
    # Learnable tokens of the bytes tokenizer (the loss falls): a model 257 ids wide, not GPT-2's 50,257.
    make_shards(root, "train", [300, 300], seed=0, vocab=100, tokenizer="bytes")
    return root


def losses(log_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(log_dir) if "loss" in r}


@pytest.mark.slow  # over 3 s: keeps `-m 'not slow'` under 90 s
def test_an_fp16_muon_run_steps_saves_both_optimizers_and_its_scale_and_resumes_exactly(data, tmp_path, monkeypatch):
    monkeypatch.setattr(optim, "bf16_matmul_is_slow", lambda device: True)  # Newton–Schulz in fp32 on every CPU
    args = [*JOB, "--data_dir", str(data), "--dtype", "fp16", "--max_steps", "4", "--snapshot_every", "2"]
    main_in_process([*args, "--log_dir", str(tmp_path / "whole")])
    whole = losses(tmp_path / "whole")
    assert not [r for r in read_metrics(tmp_path / "whole") if r.get("skipped")]
    state = load_snapshot(snapshot_path(tmp_path / "whole", 1))
    assert state["scaler"]["scale"] == 2.0**16 and state["optimizer"].keys() == {"muon", "adamw"}
    # Muon stepped: a momentum buffer per block matrix, holding its gradients
    buffers = [s["momentum_buffer"] for s in state["optimizer"]["muon"]["state"].values()]
    assert len(buffers) == 4 * TINY.n_layer and all(b.abs().sum() > 0 for b in buffers)
    copy_run(tmp_path / "whole", tmp_path / "resumed", 1)
    main_in_process([*args, "--log_dir", str(tmp_path / "resumed")])
    assert losses(tmp_path / "resumed") == {2: whole[2], 3: whole[3]}  # bitwise
    # The snapshot of a Muon run cannot continue under AdamW.
    with pytest.raises(UserError, match=r"--optimizer muon \(this run: adamw\)"):
        main_in_process([*args, "--log_dir", str(tmp_path / "other"), "--optimizer", "adamw", "--resume",
                         str(snapshot_path(tmp_path / "whole", 1))])


@pytest.mark.slow
def test_two_muon_ranks_with_a_killed_rank_train_like_one_process_and_resume_on_one(data, tmp_path, monkeypatch):
    """2 DDP ranks, one of them SIGKILLed after a snapshot and both restarted by torchrun, against one process
    accumulating the same micro-batches: every rank applies the same Muon update, and the resume is exact; then a
    2-rank snapshot resumed on one process. Newton–Schulz in fp32 everywhere, as in the fsdp test below (both
    precisions under ddp: test_ddp_ranks_each_orthogonalise_their_share_...)."""
    monkeypatch.setattr(optim, "bf16_matmul_is_slow", lambda device: True)  # as the script does for its processes
    args = [*JOB, "--data_dir", str(data), "--dtype", "fp32", "--max_steps", "12", "--snapshot_every", "4"]
    main_in_process([*args, "--log_dir", str(tmp_path / "one")])
    with launched(args, tmp_path / "two", nproc=2, launcher_args=["--max-restarts", "1"],
                  script=FP32_NEWTON_SCHULZ) as proc:
        wait_until(lambda: list_snapshots(tmp_path / "two"), proc, tmp_path / "two", "the snapshot of step 3")
        os.kill(worker_pids(proc)[1], signal.SIGKILL)
        assert proc.wait(timeout=120) == 0, (tmp_path / "two" / "output.txt").read_text()[-4000:]
    records = records_so_far(tmp_path / "two")
    assert [r["step"] for r in records if r.get("event") == "resume"] in ([4], [8])
    two, reference = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(two) == list(range(12)) and reference[11] < reference[0] - 0.1
    worst = max(abs(two[s] - reference[s]) / reference[s] for s in range(12))
    print(f"2 ranks (killed and resumed) vs 1 process, Muon: max relative loss difference {worst:.1e}")
    assert worst <= 1e-5
    # The 2-rank snapshot of step 7 continues on one process: the same Muon state, the next tokens.
    main_in_process([*args, "--resume", str(snapshot_path(tmp_path / "two", 7)), "--log_dir", str(tmp_path / "moved")])
    assert losses(tmp_path / "moved") == pytest.approx({s: reference[s] for s in range(8, 12)}, rel=1e-5)


@pytest.mark.slow
def test_muon_under_fsdp_on_two_ranks_trains_like_one_process_and_resumes_on_one_and_on_two(data, tmp_path,
                                                                                            monkeypatch):
    """2 fsdp ranks, each orthogonalising its share of the matrices from the rows the other sends, against one process
    with torch.optim.Muon; then the 2-rank snapshot of step 3 (sharded momentum) resumed on 1 process and on 2.
    Newton–Schulz in fp32 everywhere (see tests/train_with_fp32_newton_schulz.py): in bf16 the same runs differ by
    1.6e-5 within 4 steps, from gradients that differ only in the order fsdp adds them up."""
    monkeypatch.setattr(optim, "bf16_matmul_is_slow", lambda device: True)  # as the script does for its processes
    args = [*JOB, "--data_dir", str(data), "--dtype", "fp32", "--max_steps", "8", "--snapshot_every", "4"]
    main_in_process([*args, "--log_dir", str(tmp_path / "one")])
    fsdp = [*args, "--parallel", "fsdp"]
    run_train(fsdp, tmp_path / "two", nproc=2, script=FP32_NEWTON_SCHULZ)
    two = losses(tmp_path / "two")
    reference = losses(tmp_path / "one")
    # Each step moves the loss by far more than the bound: equal losses mean equal updates.
    assert sorted(two) == list(range(8)) and min(abs(reference[s + 1] - reference[s]) for s in range(7)) > 1e-3
    worst = max(abs(two[s] - reference[s]) / reference[s] for s in range(8))
    print(f"Muon, 2 fsdp ranks vs 1 process: max relative loss difference {worst:.1e}")
    assert worst <= 1e-5
    # The momentum is in the snapshot as fsdp left it: half of each matrix's rows from each rank.
    shards = read_shard_metadata(snapshot_path(tmp_path / "two", 3, sharded=True)).state_dict_metadata
    momentum = shards["optimizer.state.transformer.h.0.mlp.c_fc.weight.momentum_buffer"]
    assert momentum.size == (4 * TINY.n_embd, TINY.n_embd)
    assert sorted(chunk.offsets[0] for chunk in momentum.chunks) == [0, 2 * TINY.n_embd]
    for name, nproc in (("on_one", None), ("on_two", 2)):
        copy_run(tmp_path / "two", tmp_path / name, 3)
        if nproc is None:
            main_in_process([*fsdp, "--log_dir", str(tmp_path / name)])
        else:
            run_train(fsdp, tmp_path / name, nproc=nproc, script=FP32_NEWTON_SCHULZ)
        assert losses(tmp_path / name) == pytest.approx({s: two[s] for s in range(4, 8)}, rel=1e-5), name
