"""memory.py: the model state's bytes, the largest micro-batch that fits, and the measured activation memory of
GPT-2 124M with the chunked loss."""

import pytest
import torch
import torch.nn.functional as F

import model
from memory import MiB, largest_micro_batch, measure_activation_bytes_per_sequence, state_bytes
from model import GPT, PRESETS, GPTConfig


def test_largest_micro_batch_is_the_largest_divisor_of_the_rank_batch_that_fits():
    # Budget 900 (1000 less 10 %), 100 fixed: 800 // 60 = 13 sequences fit, and 12 is the largest divisor of 24.
    choice = largest_micro_batch(1000, 100, 60, rank_batch_sequences=24, headroom=0.1)
    assert choice.size == 12
    assert "13 would fit, but 12 is the largest that divides the rank's 24 sequences" in choice.reason


def test_headroom_is_taken_off_the_available_memory_before_fitting():
    assert largest_micro_batch(1000, 100, 100, rank_batch_sequences=72, headroom=0.0).size == 9  # 900 // 100
    choice = largest_micro_batch(1000, 100, 100, rank_batch_sequences=72, headroom=0.1)  # 800 // 100
    assert choice.size == 8
    assert "9 would not fit" in choice.reason


def test_a_micro_batch_that_exactly_fills_the_budget_fits():
    # Budget 800, 200 fixed: 3 × 200 fills the other 600 exactly; 3 × 201 is 3 bytes over.
    assert largest_micro_batch(1000, 200, 200, rank_batch_sequences=6, headroom=0.2).size == 3
    assert largest_micro_batch(1000, 200, 201, rank_batch_sequences=6, headroom=0.2).size == 2


def test_the_whole_rank_batch_is_one_micro_batch_when_it_fits():
    choice = largest_micro_batch(10 * 2**30, 2**30, 100 * MiB, rank_batch_sequences=16)
    assert choice.size == 16
    assert "whole batch of 16 sequences fits, so no accumulation" in choice.reason


def test_a_prime_rank_batch_that_does_not_fit_whole_goes_one_sequence_at_a_time():
    assert largest_micro_batch(1000, 0, 100, rank_batch_sequences=13, headroom=0.0).size == 1  # 10 fit; 13 is prime


def test_not_even_one_sequence_fitting_is_an_error_with_the_numbers():
    with pytest.raises(ValueError, match=r"one sequence does not fit: 9\.50 GiB .* > 9\.00 GiB \(10\.00 GiB less 10% "):
        largest_micro_batch(10 * 2**30, 9 * 2**30, 2**29, rank_batch_sequences=8, headroom=0.1)


def test_state_bytes_is_16_bytes_per_fp32_parameter_counting_tied_weights_once():
    config = GPTConfig(block_size=8, vocab_size=100, n_layer=2, n_head=2, n_embd=16)
    C = config.n_embd
    # From the shapes: wte padded to 128 rows (and also lm_head, so once), wpe, per block 12·C² + 13·C, ln_f.
    n_params = 128 * C + 8 * C + 2 * (12 * C * C + 13 * C) + 2 * C  # 8,768
    expected = n_params * (4 + 4 + 8)  # fp32 weight, fp32 gradient, AdamW's exp_avg and exp_avg_sq in fp32
    assert state_bytes(GPT(config)) == expected == 140_288
    with torch.device("meta"):
        assert state_bytes(GPT(config)) == expected
    assert state_bytes(GPT(config).to(torch.bfloat16)) == n_params * (2 + 2 + 8)  # the moments stay fp32


def plain_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                               chunk_tokens: int) -> torch.Tensor:
    """The loss before the chunked one: the full (N, vocab) logits, then F.cross_entropy on an fp32 copy."""
    return F.cross_entropy(F.linear(x, weight)[:, :vocab_size].float(), targets)


def test_chunked_loss_saves_at_least_one_fp32_copy_of_the_logits_per_sequence(monkeypatch):
    # GPT-2's vocabulary, the rest small, so the loss dominates; seq_len fills a loss chunk, so its fixed cost cancels.
    config = GPTConfig(block_size=1024, vocab_size=50257, n_layer=1, n_head=2, n_embd=64)
    T = GPT.loss_chunk_tokens
    chunked = measure_activation_bytes_per_sequence(config, T, torch.float32)
    monkeypatch.setattr(model, "linear_cross_entropy", plain_linear_cross_entropy)
    plain = measure_activation_bytes_per_sequence(config, T, torch.float32)
    assert plain - chunked >= T * config.vocab_size * 4  # 196 MiB
    assert chunked < 20 * MiB


@pytest.mark.slow  # about 20 s on two cores: one and two sequences of 1,024 tokens through 124M parameters
@pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="bf16 autocast on this CPU is emulated, slow")
def test_gpt2_124m_takes_under_450_mib_of_activations_per_sequence_in_bf16():
    per_sequence = measure_activation_bytes_per_sequence(PRESETS["gpt2"], 1024, torch.bfloat16)
    # Measured 334 MiB; the full-logits loss took 918 MiB by the same measurement.
    assert 250 * MiB < per_sequence <= 450 * MiB
