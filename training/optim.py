"""Which optimizer updates which parameter (--optimizer adamw: AdamW for all; muon: Muon for the blocks' matrices,
AdamW for embeddings (lookups, not linear maps) and 1-D tensors), and the LR schedule. See docs/optimizers.md."""

import functools
import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim._muon import _adjust_lr

from training.config import TrainConfig
from training.distributed import is_dtensor
from training.precision import pick_dtype

# A relative change of the learning rate at a resume beyond this is a jump worth a warning.
LR_JUMP_TOLERANCE = 0.03
# The flag behind each optimizer setting that one sets (the rest, such as AdamW's eps, are set in this file).
SETTING_FLAGS = {("adamw", "weight_decay"): "--weight_decay", ("muon", "weight_decay"): "--muon_weight_decay",
                 ("muon", "momentum"): "--muon_momentum", ("muon", "adjust_lr_fn"): "--muon_adjust_lr",
                 ("adamw", "lr_ratio"): "--embed_lr (as a ratio to --max_lr)", ("adamw", "betas"): "--adam_beta1"}
# modern's untied input embedding learns at this multiple of --max_lr unless --embed_lr says otherwise: a row is
# updated only where its token occurs (on enwiki 10× ended 0.125 lower in val loss than 1×: docs/architectures.md).
EMBED_LR_RATIO = 10.0
# --muon_momentum_warmup starts Muon's momentum here: early gradients change fast, and a shorter average follows them.
MUON_MOMENTUM_START = 0.85


class Optimizers:
    """The run's optimizers as one (learning rate, zero_grad, snapshot state); iterating gives the torch optimizers,
    which the GradScaler unscales and steps and fsdp's get_state_dict takes as a list."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], lr_ratios: dict[str, float],
                 scheduled_momentum: bool = False):
        self.by_name, self.lr_ratios = optimizers, lr_ratios
        # A loaded state brings the saving run's settings; this run's flags win, and replaced_settings keeps {flag:
        # (saved, this run's)} for the resume to say. The scheduled lr (and momentum) are not settings.
        scheduled = ("params", "lr", "momentum") if scheduled_momentum else ("params", "lr")
        self.run_settings = {name: [{k: v for k, v in group.items() if k not in scheduled}
                                    for group in optimizer.param_groups] for name, optimizer in optimizers.items()}
        self.replaced_settings: dict[str, tuple] = {}
        for name, optimizer in optimizers.items():
            # A hook rather than code in load_state_dict: with fsdp, set_state_dict loads each torch optimizer itself.
            optimizer.register_load_state_dict_post_hook(functools.partial(self._keep_run_settings, name))

    def __iter__(self):
        return iter(self.by_name.values())

    def set_lr(self, lr: float) -> None:
        """The schedule's LR, scaled per optimizer (Muon: --muon_lr / --max_lr) and group (embedding: --embed_lr)."""
        for name, optimizer in self.by_name.items():
            for group in optimizer.param_groups:
                group["lr"] = lr * self.lr_ratios[name] * group.get("lr_ratio", 1.0)

    def set_muon_momentum(self, momentum: float) -> None:
        for group in getattr(self.by_name.get("muon"), "param_groups", []):
            group["momentum"] = momentum

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: optimizer.state_dict() for name, optimizer in self.by_name.items()}

    def _keep_run_settings(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        for group, settings in zip(optimizer.param_groups, self.run_settings[name]):
            for key, value in settings.items():
                if group.get(key) != value:
                    self.replaced_settings[SETTING_FLAGS.get((name, key), f"{name} {key}")] = (group.get(key), value)
            group.update(settings)

    def load_state_dict(self, state: dict) -> None:
        if state.keys() != self.by_name.keys():
            raise ValueError(f"the optimizer state holds {sorted(state)}, this run has {sorted(self.by_name)}")
        for name, optimizer in self.by_name.items():
            saved, mine = len(state[name]["param_groups"]), len(optimizer.param_groups)
            if saved != mine:  # (torch would say only that the numbers differ)
                raise ValueError(f"the snapshot's {name} state has {saved} parameter groups, this run's {mine}: it "
                                 "predates --arch modern's group at --embed_lr. Start from its weights with "
                                 "--init_from (a fresh optimizer), or resume it with the code that wrote it.")
            optimizer.load_state_dict(state[name])


def build_optimizers(model: torch.nn.Module, cfg: TrainConfig, device_type: str, fused: bool = True,
                     shared: bool = False) -> Optimizers:
    """AdamW, or Muon + AdamW, at the peak LR. shared: Muon's Newton–Schulz work is split over the ranks."""
    embedding = model.transformer.wte.weight if model.config.arch == "modern" else None  # (gpt2's is lm_head too)
    if cfg.optimizer == "adamw":
        return Optimizers({"adamw": adamw(list(model.parameters()), cfg, device_type, fused, embedding)},
                          {"adamw": 1.0})
    matrices, rest = split_for_muon(model)
    # adjust_lr_fn reads (rows, columns), nn.Linear's (out, in): "original" scales up the widening c_fc and c_attn.
    muon = Muon(matrices, shared=shared, lr=cfg.muon_lr, weight_decay=cfg.muon_weight_decay, momentum=cfg.muon_momentum,
                adjust_lr_fn=cfg.muon_adjust_lr)
    return Optimizers({"muon": muon, "adamw": adamw(rest, cfg, device_type, fused, embedding)},
                      {"muon": cfg.muon_lr / cfg.max_lr, "adamw": 1.0}, scheduled_momentum=cfg.muon_momentum_warmup > 0)


def split_for_muon(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(the 2-D weights inside the transformer blocks, everything else), each parameter in one of the two."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    in_muon = [".h." in f".{name}" and p.dim() == 2 for name, p in named]
    return [p for (_, p), m in zip(named, in_muon) if m], [p for (_, p), m in zip(named, in_muon) if not m]


def adamw(params: list[torch.nn.Parameter], cfg: TrainConfig, device_type: str, fused: bool,
          embedding: torch.nn.Parameter | None = None) -> torch.optim.AdamW:
    """AdamW for params; embedding (an untied input embedding, one of params) in a group of its own, at --embed_lr."""
    # Decay only matrices (matmul weights, embeddings); biases and LayerNorm gains stay free.
    groups = [{"params": [p for p in params if p.dim() >= 2 and p is not embedding], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if embedding is not None:
        embed_lr = cfg.embed_lr if cfg.embed_lr is not None else EMBED_LR_RATIO * cfg.max_lr
        groups.append({"params": [embedding], "weight_decay": cfg.weight_decay, "lr_ratio": embed_lr / cfg.max_lr})
    # The fused kernel: one pass per tensor instead of a dozen (on a CPU 12 ms instead of 70 a step, small preset).
    fused = fused and device_type in ("cuda", "mps", "cpu")
    return torch.optim.AdamW(groups, lr=cfg.max_lr, betas=(cfg.adam_beta1, 0.95), eps=1e-8, fused=fused)


class Muon(torch.optim.Muon):
    """torch.optim.Muon's update and state, its Newton–Schulz run once per shape on the stack of that shape's updates
    (on an H200 3.8 ms instead of 24.6 for GPT-2 124M, bitwise the same). shared (several ranks, or fsdp): each
    matrix's owner (muon_owners) alone orthogonalises it, and every rank receives what it holds of the result."""

    def __init__(self, params, shared: bool = False, **settings):
        super().__init__(params, **settings)
        self.shared = shared  # an attribute, not a setting: snapshots hold what torch.optim.Muon's hold

    @torch.no_grad()
    def step(self, closure=None):  # (torch's signature: fsdp's get_state_dict calls step(closure=None))
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        params, grads, buffers = [], [], []
        self._init_group(group, params, grads, buffers)
        grads, buffers = [local(g) for g in grads], [local(b) for b in buffers]  # what this rank holds of them
        momentum = group["momentum"]
        for grad, buffer in zip(grads, buffers):  # elementwise
            buffer.lerp_(grad, 1 - momentum)

        def update(i: int) -> torch.Tensor:  # made where it is needed (under ddp: by the owner alone)
            return grads[i].lerp(buffers[i], momentum) if group["nesterov"] else buffers[i]

        def orthogonalise(updates: list[torch.Tensor]) -> list[torch.Tensor]:
            return orthogonalise_by_shape(updates, group["ns_coefficients"], group["ns_steps"], group["eps"])

        shapes = [p.shape for p in params]  # the whole matrices' shapes, also of fsdp's shards
        if any(is_dtensor(p) for p in params):
            orthogonal = orthogonalise_sharded(shapes, grads, update, orthogonalise)
        elif self.shared:
            orthogonal = orthogonalise_replicated(shapes, grads, update, orthogonalise)
        else:
            orthogonal = orthogonalise([update(i) for i in range(len(params))])
        for p, shape, result in zip(params, shapes, orthogonal):
            p = local(p)
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(result, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], shape))


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a tensor: its shard of an fsdp DTensor (a view: in-place changes reach the DTensor)."""
    return t.to_local() if is_dtensor(t) else t


def muon_owners(shapes: list[torch.Size], world_size: int) -> list[int]:
    """The rank that orthogonalises each matrix: the largest first, each to the least loaded rank (the lowest on a
    tie), the same on every rank. Newton–Schulz on (m, n), m <= n: m²(2n + m) multiply-adds an iteration."""
    def work(shape: torch.Size) -> int:
        m, n = sorted(shape[:2])
        return m * m * (2 * n + m)

    owners, load = [0] * len(shapes), [0] * world_size
    for i in sorted(range(len(shapes)), key=lambda i: -work(shapes[i])):  # (a stable sort: ties by position)
        owners[i] = min(range(world_size), key=lambda r: load[r])
        load[owners[i]] += work(shapes[i])
    return owners


# Muon's work shared: from the whole matrices' shapes, what this rank holds of their gradients, update(i) (what it
# holds of matrix i's update) and orthogonalise (of a list of matrices), what it holds of each orthogonalised update.

def orthogonalise_replicated(shapes: list[torch.Size], held: list[torch.Tensor], update: Callable,
                             orthogonalise: Callable) -> list[torch.Tensor]:
    """ddp: every rank holds every whole matrix; each owner orthogonalises its own and broadcasts the results."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    owners = muon_owners(shapes, world_size)
    mine = [i for i, owner in enumerate(owners) if owner == rank]
    results = [torch.empty_like(t, dtype=torch.float32) for t in held]
    for i, result in zip(mine, orthogonalise([update(i) for i in mine])):
        results[i] = result
    for work in [dist.broadcast(r, src=owner, async_op=True) for r, owner in zip(results, owners)]:
        work.wait()
    return results


def orthogonalise_sharded(shapes: list[torch.Size], held: list[torch.Tensor], update: Callable,
                          orthogonalise: Callable) -> list[torch.Tensor]:
    """fsdp: every rank holds ceil(rows / world) rows of each matrix (FSDP2's torch.chunk of dim 0; the last fewer or
    none). One all-to-all gathers each owner's matrices, another sends each rank its rows of the results; padded to
    the chunk, rank r's piece of a matrix is row r of the (world, chunk) view of the padded whole."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    owners = muon_owners(shapes, world_size)
    chunk_rows = [math.ceil(shape[0] / world_size) for shape in shapes]
    owned = [[i for i, owner in enumerate(owners) if owner == r] for r in range(world_size)]
    chunk_sizes = [rows * shape[1] for rows, shape in zip(chunk_rows, shapes)]

    def size(matrices: list[int]) -> int:
        return sum(chunk_sizes[i] for i in matrices)

    def padded(t: torch.Tensor, rows: int) -> torch.Tensor:
        return F.pad(t.float(), (0, 0, 0, rows - t.size(0)))

    # To the owners: rank r's rows of every matrix that owner o holds go to o, in order; o gets them from each rank.
    send = torch.cat([padded(update(i), chunk_rows[i]).flatten() for owner in owned for i in owner])
    received = send.new_empty(world_size * size(owned[rank]))
    dist.all_to_all_single(received, send, [size(owned[rank])] * world_size, [size(o) for o in owned])
    pieces = received.view(world_size, -1).split([chunk_sizes[i] for i in owned[rank]], dim=1)
    wholes = [piece.reshape(-1, shapes[i][1])[:shapes[i][0]] for piece, i in zip(pieces, owned[rank])]
    # Back: the owner's results, each rank's rows to that rank.
    results = [padded(result, world_size * chunk_rows[i]).reshape(world_size, -1)
               for result, i in zip(orthogonalise(wholes), owned[rank])]
    send = torch.cat(results, dim=1).flatten() if results else send.new_empty(0)
    received = send.new_empty(sum(size(o) for o in owned))
    dist.all_to_all_single(received, send, [size(o) for o in owned], [size(owned[rank])] * world_size)
    order = [i for owner in owned for i in owner]
    mine = dict(zip(order, received.split([chunk_sizes[i] for i in order])))
    return [mine[i].view(chunk_rows[i], -1)[:rows.size(0)] for i, rows in enumerate(held)]


def orthogonalise_by_shape(updates: list[torch.Tensor], ns_coefficients: tuple[float, float, float], ns_steps: int,
                           eps: float) -> list[torch.Tensor]:
    """newton_schulz of each update, once per shape on the stack of its updates (a tall one transposed to join the
    wide ones, the form it iterates on anyway); in fp32 (what a broadcast sends), contiguous, in the updates' order."""
    wide = [u if u.size(0) <= u.size(1) else u.T for u in updates]
    by_shape: dict[torch.Size, list[int]] = {}
    for i, w in enumerate(wide):
        by_shape.setdefault(w.shape, []).append(i)
    results: list[torch.Tensor] = [torch.empty(0)] * len(updates)
    for indices in by_shape.values():
        stack = newton_schulz(torch.stack([wide[i] for i in indices]), ns_coefficients, ns_steps, eps).float()
        for i, result in zip(indices, stack.unbind()):
            results[i] = (result if result.shape == updates[i].shape else result.T).contiguous()
    return results


def bf16_matmul_is_slow(device: torch.device) -> bool:
    """Where --dtype auto does not pick bf16 (CPUs without AVX512-BF16 or AMX, pre-Ampere GPUs, MPS)."""
    return pick_dtype("auto", device) != torch.bfloat16


def newton_schulz(stack: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                  eps: float) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz of a stack of wide matrices at once; in bf16 as torch's, but in
    fp32 where bf16 matmuls are slow (torch has no option for that)."""
    a, b, c = ns_coefficients
    x = stack.to(torch.float32 if bf16_matmul_is_slow(stack.device) else torch.bfloat16)
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)  # spectral norm ≤ Frobenius norm = 1
    for _ in range(ns_steps):
        gram = x @ x.mT  # (rows, rows): the small side
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def get_lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to max_lr, then cosine decay to min_lr_ratio·max_lr at the last step; or (wsd) max_lr held, then
    a linear decay to it over the last --warmdown_frac of the steps, so that a longer run continues as is."""
    min_lr = cfg.max_lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return cfg.max_lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps - 1:
        return min_lr
    if cfg.lr_schedule == "wsd":
        warmdown_steps = max(1, round(cfg.warmdown_frac * cfg.max_steps))
        steps_left = cfg.max_steps - 1 - step  # 0 at the last step
        return min_lr + min(1.0, steps_left / warmdown_steps) * (cfg.max_lr - min_lr)
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - 1 - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.max_lr - min_lr)


def get_muon_momentum(step: int, cfg: TrainConfig) -> float:
    """Muon's momentum at `step`: from MUON_MOMENTUM_START up to --muon_momentum over --muon_momentum_warmup steps."""
    if step >= cfg.muon_momentum_warmup:
        return cfg.muon_momentum
    return MUON_MOMENTUM_START + step / cfg.muon_momentum_warmup * (cfg.muon_momentum - MUON_MOMENTUM_START)


def schedule_change(step: int, snapshot_config: dict, cfg: TrainConfig) -> tuple[str, bool] | None:
    """On a resume with another schedule than the snapshot's: (a line with the old and new LR at `step`, whether that
    is a jump); None if unchanged."""
    schedule_flags = ("lr_schedule", "max_steps", "warmup_steps", "max_lr", "min_lr_ratio", "warmdown_frac")
    old = replace(cfg, **{k: snapshot_config[k] for k in schedule_flags if k in snapshot_config})
    if all(getattr(old, k) == getattr(cfg, k) for k in schedule_flags):
        return None
    old_lr, new_lr = get_lr(step, old), get_lr(step, cfg)
    line = (f"the LR schedule changed since the snapshot (--max_steps {old.max_steps} → {cfg.max_steps}, "
            f"--lr_schedule {old.lr_schedule} → {cfg.lr_schedule}): at step {step} the old schedule gives "
            f"{old_lr:.3e}, the new one {new_lr:.3e}")
    jump = abs(new_lr - old_lr) > LR_JUMP_TOLERANCE * old_lr
    if jump and cfg.lr_schedule == "cosine":
        line += (". Cosine stretches over --max_steps, so the LR jumps and the loss rises before it falls again. To "
                 "extend a run without a jump, train with --lr_schedule wsd and resume before its warmdown.")
    elif jump:
        line += (". The snapshot is past the new schedule's warmdown start (or in the old one's), so the LR jumps: "
                 f"resume from one before step {cfg.max_steps - round(cfg.warmdown_frac * cfg.max_steps)} instead.")
    return line, jump
