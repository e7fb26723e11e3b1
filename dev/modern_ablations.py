"""--arch modern with one of its parts put back as GPT-2 had it: the ablations of dev/arch_compare.py's recipes
`modern_without_*` (README, "Architectures"). Each part is a patch of model.py in this process only; then
train_gpt2.py runs with the other flags.

    python -m dev.modern_ablations --without qk_norm --arch modern --optimizer muon ...   # any train_gpt2.py flags

    rmsnorm   LayerNorm (gain and bias) wherever modern has RMSNorm: in the blocks, at the end, and as QK-norm
    qk_norm   no norm on each head's queries and keys
    swiglu    GPT-2's MLP, GELU at 4× the width (no biases, the output projection zero at init, as modern's are)
    no_bias   a bias on every linear layer of the blocks (zero at init), as GPT-2 has
    rotary    GPT-2's learned position embedding added to the token embedding, and no rotation

The patched model is modern's in everything else, so a snapshot of it does not load as either architecture: these
runs are scored on their val loss only."""

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


def add_biases(gpt: model.GPT) -> None:
    for module in gpt.transformer.h.modules():
        if isinstance(module, nn.Linear) and module.bias is None:
            module.bias = nn.Parameter(torch.zeros(module.out_features, device=module.weight.device))


def learned_positions(gpt: model.GPT) -> None:
    wpe = gpt.transformer.wpe = nn.Embedding(gpt.config.block_size, gpt.config.n_embd)
    nn.init.normal_(wpe.weight, mean=0.0, std=0.02)
    # Added to the token embedding's output, as GPT-2's forward adds it (training and validation start at position 0).
    gpt.transformer.wte.register_forward_hook(
        lambda module, args, out: out + wpe(torch.arange(out.size(1), device=out.device)))


PATCHES = {"rmsnorm": layer_norm_everywhere, "qk_norm": no_qk_norm, "swiglu": gelu_mlp,
           "no_bias": lambda: after_init(add_biases),
           "rotary": lambda: (setattr(model, "rotate", lambda x, positions: x), after_init(learned_positions))}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "--without" or argv[1] not in PATCHES:
        sys.exit(f"usage: python -m dev.modern_ablations --without {{{','.join(PATCHES)}}} <train_gpt2.py flags>")
    PATCHES[argv[1]]()
    train_gpt2.main(argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
