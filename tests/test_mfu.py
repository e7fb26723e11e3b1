"""mfu.py and model.GPT.flops_per_token: the FLOP count behind MFU, and where the hardware peak comes from."""

import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from model import GPT, GPTConfig
from training import mfu

# Small enough to count by hand: vocabulary 100 (padded to 128 inside), 2 layers, 2 heads, 8 wide.
HAND_CONFIG = GPTConfig(block_size=8, vocab_size=100, n_layer=2, n_head=2, n_embd=8)


def test_flops_per_token_matches_a_hand_count():
    C, T = 8, 8
    wte = 100 * C  # the tied token embedding / output layer, without its 28 padding rows
    block = (2 * C  # ln_1 gain and bias
             + C * 3 * C + 3 * C  # c_attn
             + C * C + C  # attn.c_proj
             + 2 * C  # ln_2
             + C * 4 * C + 4 * C  # c_fc
             + 4 * C * C + C)  # mlp.c_proj
    ln_f = 2 * C
    n = wte + 2 * block + ln_f  # 800 + 2·872 + 16 = 2560 (wpe not counted: a lookup, no matmul)
    attention = 2 * 6 * T * C  # per layer: Q·Kᵀ and A·V, each 2·T·C FLOPs per token forward, ×3 with backward
    model = GPT(HAND_CONFIG)
    assert model.num_params() == n == 2560
    assert model.flops_per_token(T) == 6 * n + 2 * attention == 16896


def test_six_n_is_what_the_matmuls_of_a_training_step_cost():
    # PyTorch's own FLOP counter over a real forward + backward: 2 FLOPs per multiply-add, each weight used in
    # one forward and two backward matmuls, and no biases or LayerNorms; on the CPU it does not see inside
    # scaled_dot_product_attention. The loss multiplies the output layer's 28 padding rows too (a matmul of padded
    # width runs faster on GPUs than one of 100): work the hardware does, but not the model's, so 6·N leaves it out.
    torch.manual_seed(0)
    model = GPT(HAND_CONFIG)
    B, T = 3, 8
    idx = torch.randint(0, HAND_CONFIG.vocab_size, (B, T))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    matmul_weights = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "wpe" not in name)
    matmul_weights -= (128 - 100) * 8  # the padding rows
    assert matmul_weights == 100 * 8 + 2 * (8 * 24 + 8 * 8 + 8 * 32 + 32 * 8)  # = 2336
    padding_flops = 6 * (128 - 100) * 8 * B * T
    assert counter.get_total_flops() == 6 * matmul_weights * B * T + padding_flops == 336_384 + 32_256


def test_cpu_peak_is_a_measured_positive_number():
    peak = mfu.peak_flops(torch.device("cpu"), torch.float32)
    assert math.isfinite(peak.flops) and peak.flops > 1e9  # any CPU from the last 15 years does over 1 GFLOP/s


def test_gpu_names_map_to_their_datasheet_peaks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert mfu.peak_flops(torch.device("cuda"), torch.bfloat16).flops == 989e12
    assert mfu.table_peak_flops("NVIDIA H100 PCIe", torch.bfloat16)[1] == 756e12  # not the SXM figure
    assert mfu.table_peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16)[1] == 312e12
    assert mfu.table_peak_flops("NVIDIA L40", torch.bfloat16)[1] == 181e12  # not the L4's
    assert mfu.table_peak_flops("NVIDIA GeForce GTX 1080", torch.bfloat16) is None  # unknown: measured instead
