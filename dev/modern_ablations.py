"""--arch modern with one of its parts put back as GPT-2 has it: the ablations of dev/arch_compare.py's recipes
`modern_{part}_muon_wsd` (README, "Architectures"). Each part is a patch of model.py in this process only; then
train_gpt2.py runs with the other flags.

    python -m dev.modern_ablations --gpt2_part biases --arch modern --optimizer muon ...   # any train_gpt2.py flags

    layernorm          LayerNorm (gain and bias) wherever modern has RMSNorm: in the blocks, at the end, as QK-norm
    no_qk_norm         no norm on each head's queries and keys
    gelu_mlp           GPT-2's MLP, GELU at 4× the width (no biases, the output projection zero at init, as modern's)
    biases             a bias on every linear layer of the blocks (zero at init)
    attention_biases   a bias on attention's linear layers only (what Qwen3's attention_bias=True has)
    learned_positions  GPT-2's learned position embedding added to the token embedding, and no rotation

The patched model is modern's in everything else, so a snapshot of it loads as neither architecture: these runs are
scored on their val loss only."""

import sys

import torch
from torch import nn

import model
import train_gpt2


def layer_norm_everywhere() -> None:
    model.norm = lambda config, size: nn.LayerNorm(size)


def no_qk_norm() -> None:
    modern_init = model.ModernAttention.__init__

    def init(self, config):
        modern_init(self, config)
        self.q_norm = self.k_norm = nn.Identity()
    model.ModernAttention.__init__ = init


class GeluMLP(nn.Module):
    def __init__(self, config: model.GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.c_proj.ZERO_INIT = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


def gelu_mlp() -> None:
    model.SwiGLU = GeluMLP


def after_init(extend) -> None:
    """Run extend(gpt) at the end of every GPT's construction (before the optimizer sees its parameters)."""
    gpt_init = model.GPT.__init__

    def init(self, config):
        gpt_init(self, config)
        extend(self)
    model.GPT.__init__ = init


def add_biases(modules: nn.Module) -> None:
    for module in modules.modules():
        if isinstance(module, nn.Linear) and module.bias is None:
            module.bias = nn.Parameter(torch.zeros(module.out_features, device=module.weight.device))


def learned_positions(gpt: model.GPT) -> None:
    wpe = gpt.transformer.wpe = nn.Embedding(gpt.config.block_size, gpt.config.n_embd)
    nn.init.normal_(wpe.weight, mean=0.0, std=0.02)
    # Added to the token embedding's output, as GPT-2's forward adds it (training and validation start at position 0).
    gpt.transformer.wte.register_forward_hook(
        lambda module, args, out: out + wpe(torch.arange(out.size(1), device=out.device)))


PATCHES = {"layernorm": layer_norm_everywhere, "no_qk_norm": no_qk_norm, "gelu_mlp": gelu_mlp,
           "biases": lambda: after_init(lambda gpt: add_biases(gpt.transformer.h)),
           "attention_biases": lambda: after_init(lambda gpt: [add_biases(block.attn) for block in gpt.transformer.h]),
           "learned_positions": lambda: (setattr(model, "rotate", lambda x, positions: x),
                                         after_init(learned_positions))}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "--gpt2_part" or argv[1] not in PATCHES:
        sys.exit(f"usage: python -m dev.modern_ablations --gpt2_part {{{','.join(PATCHES)}}} <train_gpt2.py flags>")
    PATCHES[argv[1]]()
    train_gpt2.main(argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
