"""--arch modern with one part changed (or several): the ablations of dev/arch_compare.py's recipes
`modern_{part}_muon_wsd` (docs/arch_compare.md). Each part is a patch of model.py (split_muon, head_lr and
slow_head: of optim.py) in this process only; then train_gpt2.py runs with the other flags.

    python -m dev.modern_ablations --part biases --arch modern --no-attention_bias ...   # any train_gpt2.py flags
    python -m dev.modern_ablations --part softcap+value_embeds --arch modern ...         # several parts at once

Put back as GPT-2 has it (measured on modern without attention's biases, --no-attention_bias, as it was then):
    layernorm          LayerNorm (gain and bias) wherever modern has RMSNorm: in the blocks, at the end, as QK-norm
    no_qk_norm         no norm on each head's queries and keys
    gelu_mlp           GPT-2's MLP, GELU at 4× the width (no biases, the output projection zero at init, as modern's)
    biases             a bias on every linear layer of the blocks (zero at init)
    learned_positions  GPT-2's learned position embedding added to the token embedding, and no rotation
    tied_embeddings    one matrix as the token embedding and the output layer (measured on modern as it is; the
                       tied matrix learns at --embed_lr, which the recipes set to GPT-2's 2e-3 or leave at 10×)
Added as modded-nanogpt has it, though Qwen3 has not (measured on modern as it is):
    softcap            the logits soft-capped at 15: 15·tanh(logits/15) (modded-nanogpt's; Gemma 2 caps at 30)
    relu2_mlp          an MLP of ReLU² at 4× the width, not gated, instead of SwiGLU (modded-nanogpt's)
    qk_gain            QK-norm's gains start at √QK_GAIN instead of 1: attention logits QK_GAIN× as large at init, a
                       sharper softmax (modded-nanogpt's scale 0.12 is 1.36× 1/√head_size at its head size of 128)
    x0_mix             each block's input λ·x + μ·x0, x0 the token embedding's output, (λ, μ) learned from (1, 0)
    unet               the first half's block outputs added to the last half's inputs, mirrored, with learned weights
    value_embeds       modded-nanogpt's value embeddings: tables of their own, looked up by token and added to
                       attention's values, min(3, n_layer/2) tables used by the first layers and again by the last,
                       each zero at init and trained as the token embedding is (AdamW at --embed_lr)
The optimizers (split_muon on either architecture; AdamW's betas and Muon's momentum warmup, measured here as patches
first, are train_gpt2.py's flags --adam_beta1 and --muon_momentum_warmup, as the sequence-length schedule is
--short_rows):
    split_muon         Muon orthogonalises the queries', keys' and values' rows of c_attn each on their own, and
                       SwiGLU's gate and up rows, as if each were a matrix of its own (modded-nanogpt's q, k, v are)
    head_lr            modern's untied output layer in an AdamW group of its own, at 3 × --max_lr
    slow_head          the same at --max_lr / 3 (the embedding at 30× the output layer's LR, nearer nanochat's 50×)
The initialisation, and the rotary base (Qwen3 has both as settings):
    embed_std1         the token embedding drawn at std 1 instead of 0.02 (nanochat's and modded-nanogpt's)
    rope_base1k        rotary base θ = 1,000 instead of 10,000 (modded-nanogpt's 1,024): at T = 256 the slowest of the
                       64-wide heads' 32 rotations turns 0.32 rad over a row, not 0.03 (a Qwen3Config's rope_theta)
    proj_init          the blocks' output projections drawn as GPT-2's (std 0.02 / √(2 · n_layer)) instead of zero
    zero_head          the untied output layer zero at init instead of random at std 0.02 (modded-nanogpt's): the
                       first logits are all equal, and the blocks get no gradient at the first step
    embed_norm         an RMSNorm (with its gain) on the token embedding's output, as nanochat and modded-nanogpt norm
                       it (an export could fold it into the table: each row's norm depends on that row alone)
Added as Qwen3-Next has it (a transformers class of its own, Qwen3NextForCausalLM):
    gated_attn         each attention output times a sigmoid gate of the block's normed input (a matrix of its own,
                       Muon's, with a bias where attention has them), before the output projection
    partial_rope       only the first ROTATED_FRACTION of each head's channels rotated (by the frequencies of a head
                       that wide), the rest left as they are: position-free channels (partial_rotary_factor)

A model patched is modern's in everything else, so a snapshot of it loads as neither architecture: those runs are
scored on their val loss only. The parts of the optimizers leave the model as it is (dev/arch_compare.py's
`heldout` scores their snapshots)."""

import functools
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import model
from training import optim

TRAIN_SCRIPT = str(Path(__file__).resolve().parent.parent / "train_gpt2.py")


def layer_norm_everywhere() -> None:
    model.norm = lambda config, size: nn.LayerNorm(size)


def no_qk_norm() -> None:
    modern_init = model.ModernAttention.__init__

    def init(self, config):
        modern_init(self, config)
        self.q_norm = self.k_norm = nn.Identity()
    model.ModernAttention.__init__ = init


class FourTimesMLP(nn.Module):
    """GPT-2's MLP shape (4× wide, not gated) with another activation; no biases, the output projection zero at init,
    as modern's."""

    def __init__(self, config: model.GPTConfig, activation: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.activation = activation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.c_proj.ZERO_INIT = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.activation(self.c_fc(x)))


def four_times_mlp(activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
    model.SwiGLU = functools.partial(FourTimesMLP, activation=activation)


SOFTCAP = 15.0  # modded-nanogpt's since it lowered 30 (Gemma 2's)


def softcap_logits() -> None:
    """Every logit through SOFTCAP·tanh(logit/SOFTCAP). The training loss then builds the whole (B·T, vocab) logits
    (memory a small model can spare) instead of the chunked loss, whose backward is written for plain logits."""
    def capped(logits: torch.Tensor) -> torch.Tensor:
        return SOFTCAP * torch.tanh(logits / SOFTCAP)

    plain_logits = model.GPT.logits
    model.GPT.logits = lambda self, x: capped(plain_logits(self, x))
    model.linear_cross_entropy = lambda x, weight, targets, vocab_size, chunk_tokens, fp8: F.cross_entropy(
        capped(x @ weight.t())[:, :vocab_size].float(), targets)  # (fp8: --fp8_head is not for this ablation)


def after_init(extend) -> None:
    """Run extend(gpt) at the end of every GPT's construction (before the optimizer sees its parameters)."""
    gpt_init = model.GPT.__init__

    def init(self, config):
        gpt_init(self, config)
        extend(self)
    model.GPT.__init__ = init


QK_GAIN = 2.0


def sharper_attention(gpt: model.GPT) -> None:
    for block in gpt.transformer.h:
        for qk_norm in (block.attn.q_norm, block.attn.k_norm):
            nn.init.constant_(qk_norm.weight, QK_GAIN ** 0.5)


def value_embeddings(gpt: model.GPT) -> None:
    config = gpt.config
    tables = min(3, config.n_layer // 2)
    gpt.value_embeds = nn.ModuleList(nn.Embedding(config.padded_vocab_size, config.n_embd) for _ in range(tables))
    for table in gpt.value_embeds:
        nn.init.zeros_(table.weight)
        table.weight.VALUE_EMBED = True
    order = [*range(tables), *[None] * (config.n_layer - 2 * tables), *range(tables)]
    tokens = {}
    gpt.transformer.wte.register_forward_pre_hook(lambda module, args: tokens.update(idx=args[0]))

    def add_to_values(table: nn.Embedding, module, args, out: torch.Tensor) -> torch.Tensor:
        # c_attn's output is (q, k, v) side by side: the table's rows go to v's part
        return out + F.pad(table(tokens["idx"]).to(out.dtype), (2 * config.n_embd, 0))
    for block, table in zip(gpt.transformer.h, order):
        if table is not None:
            block.attn.c_attn.register_forward_hook(functools.partial(add_to_values, gpt.value_embeds[table]))


ROTATED_FRACTION = 0.5  # Qwen3-Next's default is 0.25; modded-nanogpt leaves half of each head unrotated


def partial_rotation() -> None:
    whole_table, whole_rotate = model.rotation_table, model.rotate

    def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        rotated = rotation.size(-1)
        return torch.cat((whole_rotate(x[..., :rotated], rotation), x[..., rotated:]), dim=-1)
    model.rotation_table = lambda max_len, head_size: whole_table(max_len, int(head_size * ROTATED_FRACTION))
    model.rotate = rotate


def gated_attention() -> None:
    """Each attention output element times a sigmoid gate of the block's normed input, before the output projection
    (Qwen3-Next's full-attention layers; Qiu et al. 2025, "Gated Attention for Large Language Models")."""
    modern_init = model.ModernAttention.__init__

    def init(self, config):
        modern_init(self, config)
        self.c_gate = nn.Linear(config.n_embd, config.n_embd, bias=config.attention_bias)  # (Qwen3-Next: q_proj's)
        gates = {}
        self.register_forward_pre_hook(lambda module, args: gates.update(gate=torch.sigmoid(module.c_gate(args[0]))))
        self.c_proj.register_forward_pre_hook(lambda module, args: (args[0] * gates.pop("gate"),))
    model.ModernAttention.__init__ = init


def residual_mixing(gpt: model.GPT) -> None:
    """Each block's input a learned mix of the residual stream and the token embedding's output x0, λ·x + μ·x0, with
    (λ, μ) a block's own, from (1, 0) (modded-nanogpt's: every layer can read the tokens themselves again)."""
    gpt.x0_lambdas = nn.Parameter(torch.tensor([[1.0, 0.0]] * gpt.config.n_layer))
    gpt.x0_lambdas.SCALAR = True
    x0 = {}
    gpt.transformer.wte.register_forward_hook(lambda module, args, out: x0.update(x=out))
    for i, block in enumerate(gpt.transformer.h):
        block.register_forward_pre_hook(
            lambda module, args, i=i: (gpt.x0_lambdas[i, 0] * args[0] + gpt.x0_lambdas[i, 1] * x0["x"], *args[1:]))


def unet_skips(gpt: model.GPT) -> None:
    """The first half's block outputs added, weighted, to the last half's block inputs in reverse order (the last
    block reads the first one's), U-net fashion, each weight learned from 1 (modded-nanogpt's skip connections)."""
    blocks = gpt.transformer.h
    half = len(blocks) // 2
    gpt.skip_weights = nn.Parameter(torch.ones(half))
    gpt.skip_weights.SCALAR = True
    outputs = []
    gpt.transformer.wte.register_forward_hook(lambda module, args, out: outputs.clear())
    for block in blocks[:half]:
        block.register_forward_hook(lambda module, args, out: outputs.append(out))
    for j, block in enumerate(blocks[len(blocks) - half:]):
        block.register_forward_pre_hook(
            lambda module, args, j=j: (args[0] + gpt.skip_weights[j] * outputs.pop(), *args[1:]))


def adamw_group(tag: str, lr_ratio: Callable[[torch.optim.AdamW], float], weight_decay: bool = True) -> None:
    """The parameters marked with the attribute tag in an AdamW group of their own, at lr_ratio(adamw) × --max_lr."""
    plain_adamw = optim.adamw

    def adamw(params, cfg, device_type, fused, embedding=None):
        tagged = [p for p in params if getattr(p, tag, False)]
        adam = plain_adamw([p for p in params if not getattr(p, tag, False)], cfg, device_type, fused, embedding)
        if tagged:
            adam.add_param_group({"params": tagged, "weight_decay": cfg.weight_decay if weight_decay else 0.0,
                                  "lr_ratio": lr_ratio(adam)})
        return adam
    optim.adamw = adamw


def embedding_lr_ratio(adam: torch.optim.AdamW) -> float:
    return next(group["lr_ratio"] for group in adam.param_groups if "lr_ratio" in group)


def learned_scalars(extend) -> None:
    """extend(gpt) at the end of its construction; the scalars it adds (marked SCALAR) learn as the token embedding
    does, without weight decay, which would pull them to 0."""
    after_init(extend)
    adamw_group("SCALAR", embedding_lr_ratio, weight_decay=False)


def tag_output_layer(gpt: model.GPT) -> None:
    gpt.lm_head.weight.OUTPUT_LAYER = True


def output_layer_lr(ratio: float) -> None:
    after_init(tag_output_layer)
    adamw_group("OUTPUT_LAYER", lambda adam: ratio)


def split_newton_schulz() -> None:
    """optim.newton_schulz on each block of rows: 3 for c_attn's (3C, C) update, 2 for SwiGLU's (2·hidden, C), each
    scaled as Muon scales a matrix of its own shape (so by 1/√blocks: Muon scales the whole by √(rows/C)). Muon
    hands it stacks of these matrices transposed (wide), so the blocks are of columns there."""
    whole = optim.newton_schulz

    def split(stack, *args):
        rows, columns = stack.shape[-2:]
        blocks = 3 if columns == 3 * rows else 2 if columns == 2 * model.swiglu_hidden_size(rows) else 1
        if blocks == 1:
            return whole(stack, *args)
        return torch.cat([whole(part, *args) for part in stack.chunk(blocks, dim=-1)], dim=-1) / blocks ** 0.5
    optim.newton_schulz = split


def add_biases(modules: nn.Module) -> None:
    for module in modules.modules():
        if isinstance(module, nn.Linear) and module.bias is None:
            module.bias = nn.Parameter(torch.zeros(module.out_features, device=module.weight.device))


def tied_embeddings() -> None:
    model.GPT.tie_weights = lambda self: setattr(self.lm_head, "weight", self.transformer.wte.weight)


def learned_positions(gpt: model.GPT) -> None:
    wpe = gpt.transformer.wpe = nn.Embedding(gpt.config.block_size, gpt.config.n_embd)
    nn.init.normal_(wpe.weight, mean=0.0, std=0.02)
    # Added to the token embedding's output, as GPT-2's forward adds it (training and validation start at position 0).
    gpt.transformer.wte.register_forward_hook(
        lambda module, args, out: out + wpe(torch.arange(out.size(1), device=out.device)))


def normed_embedding(gpt: model.GPT) -> None:
    gpt.embed_norm = model.norm(gpt.config, gpt.config.n_embd)
    gpt.transformer.wte.register_forward_hook(lambda module, args, out: gpt.embed_norm(out))


def embedding_at_std1(gpt: model.GPT) -> None:
    nn.init.normal_(gpt.transformer.wte.weight, mean=0.0, std=1.0)


def output_projections_as_gpt2s(gpt: model.GPT) -> None:
    for block in gpt.transformer.h:
        for projection in (block.attn.c_proj, block.mlp.c_proj):
            projection.ZERO_INIT, projection.RESIDUAL_SCALED_INIT = False, True  # marked as GPT-2's are
            gpt._init_weights(projection)


def zero_output_layer(gpt: model.GPT) -> None:
    nn.init.zeros_(gpt.lm_head.weight)  # (after its random draw, so every other weight is drawn as in modern)


PATCHES = {"layernorm": layer_norm_everywhere, "no_qk_norm": no_qk_norm,
           "gelu_mlp": lambda: four_times_mlp(functools.partial(F.gelu, approximate="tanh")),
           "biases": lambda: after_init(lambda gpt: add_biases(gpt.transformer.h)),
           "learned_positions": lambda: (setattr(model, "rotate", lambda x, rotation: x),
                                         after_init(learned_positions)),
           "tied_embeddings": tied_embeddings,
           "softcap": softcap_logits, "relu2_mlp": lambda: four_times_mlp(lambda x: F.relu(x).square()),
           "qk_gain": lambda: after_init(sharper_attention), "split_muon": split_newton_schulz,
           "value_embeds": lambda: (after_init(value_embeddings), adamw_group("VALUE_EMBED", embedding_lr_ratio)),
           "embed_std1": lambda: after_init(embedding_at_std1), "zero_head": lambda: after_init(zero_output_layer),
           "proj_init": lambda: after_init(output_projections_as_gpt2s),
           "rope_base1k": lambda: setattr(model, "ROPE_THETA", 1000.0),
           "embed_norm": lambda: after_init(normed_embedding), "gated_attn": gated_attention,
           "partial_rope": partial_rotation,
           "x0_mix": lambda: learned_scalars(residual_mixing), "unet": lambda: learned_scalars(unet_skips),
           "head_lr": lambda: output_layer_lr(3.0), "slow_head": lambda: output_layer_lr(1 / 3)}


def main(argv: list[str]) -> None:
    parts = argv[1].split("+") if len(argv) >= 2 and argv[0] == "--part" else []
    if not parts or any(part not in PATCHES for part in parts):
        sys.exit(f"usage: python -m dev.modern_ablations --part PART[+PART...] <train_gpt2.py flags>, each PART one of "
                 f"{', '.join(PATCHES)}")
    for part in parts:
        PATCHES[part]()
    # The training command as it is, in this process: it builds its model from the patched module.
    sys.argv = [TRAIN_SCRIPT, *argv[2:]]
    runpy.run_path(TRAIN_SCRIPT, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
