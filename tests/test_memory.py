"""memory.py: the model state's bytes, the largest micro-batch that fits, and the measured activation memory of
GPT-2 124M with the chunked loss."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import model
from model import GPT, PRESETS, GPTConfig
from training import memory
from training.memory import MiB, largest_micro_batch, measure_activation_bytes_per_sequence, state_bytes
from training.recompute import ACTIVATION_CHECKPOINTING


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
                               chunk_tokens: int, fp8: bool) -> torch.Tensor:
    """The loss before the chunked one: the full (N, vocab) logits, then F.cross_entropy on an fp32 copy."""
    return F.cross_entropy(F.linear(x, weight)[:, :vocab_size].float(), targets)


@pytest.mark.slow  # a few seconds: keeps `-m 'not slow'` under 90 s
def test_chunked_loss_saves_at_least_one_fp32_copy_of_the_logits_per_sequence(monkeypatch):
    # GPT-2's vocabulary, the rest small, so the loss dominates; seq_len fills a loss chunk, so its fixed cost cancels.
    config = GPTConfig(block_size=1024, vocab_size=50257, n_layer=1, n_head=2, n_embd=64)
    T = 1024
    chunked = measure_activation_bytes_per_sequence(config, T, torch.float32)
    monkeypatch.setattr(model, "linear_cross_entropy", plain_linear_cross_entropy)
    plain = measure_activation_bytes_per_sequence(config, T, torch.float32)
    assert plain - chunked >= T * config.vocab_size * 4  # 196 MiB
    assert chunked < 20 * MiB


@pytest.mark.slow  # about 6 s (MemTracker's import, 8 measurements): the method of the 124M figures below
def test_the_cpus_measurement_on_fake_tensors_counts_the_bytes_of_real_ones(monkeypatch):
    # bf16 autocast with each checkpointing mode, and fp32 (no autocast copies)
    config = GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=32)
    cases = [(torch.bfloat16, mode) for mode in ACTIVATION_CHECKPOINTING] + [(torch.float32, "none")]

    def measured() -> list[int]:
        return [measure_activation_bytes_per_sequence(config, 32, dtype, activation_checkpointing=mode)
                for dtype, mode in cases]

    fake = measured()
    monkeypatch.setattr(memory, "FakeTensorMode", contextlib.nullcontext)  # the same function on real tensors
    real = measured()
    assert fake == real
    assert real[0] > real[2] > real[1] > 0 and real[3] > real[0]  # none > selective > blocks; fp32 > bf16


@pytest.mark.slow  # about 25 s: one and two sequences of 1,024 tokens through 124M parameters, twice, on fake tensors
def test_gpt2_124m_takes_under_450_mib_of_activations_per_sequence_in_bf16_and_checkpointed_blocks_40_percent():
    per_sequence = measure_activation_bytes_per_sequence(PRESETS["gpt2"], 1024, torch.bfloat16)
    # Measured 334 MiB; the full-logits loss took 918 MiB by the same measurement.
    assert 250 * MiB < per_sequence <= 450 * MiB
    checkpointed = measure_activation_bytes_per_sequence(PRESETS["gpt2"], 1024, torch.bfloat16,
                                                         activation_checkpointing="blocks")
    print(f"GPT-2 124M, bf16: {per_sequence / MiB:.0f} MiB per sequence, {checkpointed / MiB:.0f} MiB with "
          f"--activation_checkpointing blocks ({checkpointed / per_sequence:.0%})")
    assert checkpointed <= 0.4 * per_sequence  # measured 45 MiB: 13 %


# ----------------------------------------------------------------------------------------------------------------
# --micro_batch_size auto

def fake_device_memory(monkeypatch, available: int, per_sequence: int) -> None:
    monkeypatch.setattr(memory, "available_bytes", lambda device, ranks_on_node: available)
    monkeypatch.setattr(memory, "measure_activation_bytes_per_sequence", lambda *args, **kwargs: per_sequence)


def test_auto_micro_batch_fits_the_memory_and_divides_the_ranks_share(monkeypatch):
    from training.memory import GiB, auto_micro_batch
    config = PRESETS["tiny"]
    with torch.device("meta"):
        fixed = state_bytes(GPT(config)) * 5 // 4  # 2 ranks: DDP's gradient buckets on top
    # 10 GiB less 10 % headroom, less the state, in 100 MiB sequences: 90 fit, and the rank's share is 48 sequences of
    # 64 tokens (6,144 tokens per step over 2 ranks), whose largest divisor under 90 is 48 itself.
    fake_device_memory(monkeypatch, 10 * GiB, 100 * MiB)
    choice = auto_micro_batch(config, 64, 6144, 2, torch.device("cpu"), torch.bfloat16, 1)
    assert choice.size == 48 and "whole batch of 48 sequences fits" in choice.reason
    fake_device_memory(monkeypatch, 3 * GiB, 100 * MiB)  # (2.7 GiB - fixed) / 100 MiB = 27 fit: 24 divides 48
    choice = auto_micro_batch(config, 64, 6144, 2, torch.device("cpu"), torch.bfloat16, 1)
    assert choice.size == 24 == max(b for b in range(1, 28) if 48 % b == 0)
    assert (int(3 * GiB * 0.9) - fixed) // (100 * MiB) == 27


def test_a_run_with_micro_batch_size_auto_logs_its_choice_and_trains_with_it(tmp_path, monkeypatch, capsys):
    from conftest import make_shards
    from train_gpt2 import run
    from training.config import parse_args
    from training.distributed import Distributed
    from training.memory import GiB

    make_shards(tmp_path / "data", "train", [5000])
    fake_device_memory(monkeypatch, 2 * GiB, 100 * MiB)  # (1.8 GiB - 0.05 GiB) / 100 MiB: 17 fit, 16 divides 32
    cfg = parse_args(["--model", "tiny", "--device", "cpu", "--data_dir", str(tmp_path / "data"), "--log_dir",
                      str(tmp_path), "--micro_batch_size", "auto", "--seq_len", "16", "--total_batch_size", "512",
                      "--max_steps", "1", "--val_every", "0", "--eval_every", "0", "--sample_every", "0",
                      "--snapshot_every", "0", "--dtype", "fp32"])
    run(cfg, Distributed(0, 0, 1, torch.device("cpu")))
    out = capsys.readouterr().out
    assert "--micro_batch_size auto: micro-batch 16:" in out and "17 would fit, but 16 is the largest" in out
    assert "batch: 512 tokens = 16 × 16 × 1 ranks × 2 accumulation steps" in out


def test_a_number_given_for_micro_batch_size_is_kept_and_a_word_is_refused(capsys):
    from training.config import parse_args
    assert parse_args(["--micro_batch_size", "12"]).micro_batch_size == 12
    assert parse_args(["--micro_batch_size", "auto"]).micro_batch_size == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--micro_batch_size", "lots"])
    assert "'lots' is neither a number of sequences nor 'auto'" in capsys.readouterr().err
