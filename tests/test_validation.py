"""validation.py: the validation loss and bits per byte, checked against a computation of their own."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dataloader import DistributedDataLoader, write_shard
from evaluation import validation
from evaluation.validation import token_byte_lengths, validation_loss
from helpers_train import write_text_shards
from model import GPT, PRESETS
from training import tokenizer

CPU = torch.device("cpu")


def test_token_byte_lengths_are_the_utf8_bytes_of_each_token(gpt2_encoding):
    lengths = token_byte_lengths()
    assert lengths.shape == (50257,)
    assert lengths[gpt2_encoding.encode_ordinary(" the")[0]] == 4
    assert lengths[gpt2_encoding.encode_ordinary("é")[0]] == 2  # one token, two UTF-8 bytes
    assert lengths[gpt2_encoding.eot_token] == 0  # a document boundary, no text


def nats_bytes_tokens(model: GPT, loader: DistributedDataLoader, steps: int, encoding) -> tuple[float, int, int]:
    """Independently of validation.py: the full logits' cross-entropy summed over `steps` batches' targets, the bytes
    tiktoken decodes the targets to, and their number."""
    nats, num_bytes, num_tokens = 0.0, 0, 0
    with torch.no_grad():
        for _ in range(steps):
            x, y = loader.next_batch()
            logits, _ = model(x)
            nats += F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="sum").item()
            num_bytes += len(encoding.decode_bytes(y.flatten().tolist()))
            num_tokens += y.numel()
    return nats, num_bytes, num_tokens


def test_val_bpb_equals_the_nats_per_byte_of_the_decoded_shakespeare_targets(tmp_path, shared_data, gpt2_encoding):
    text = (shared_data / "tinyshakespeare" / "input.txt").read_text()
    write_text_shards(tmp_path, text, gpt2_encoding)
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    B, T, steps = 4, 64, 3
    val = validation_loss(model, DistributedDataLoader(tmp_path, "val", B, T), steps, CPU, torch.float32)

    nats, num_bytes, num_tokens = nats_bytes_tokens(model, DistributedDataLoader(tmp_path, "val", B, T), steps,
                                                    gpt2_encoding)
    assert val.loss == pytest.approx(nats / num_tokens, rel=1e-5)
    assert val.bpb == pytest.approx(nats / math.log(2) / num_bytes, rel=1e-5)
    assert 3.0 < num_bytes / num_tokens < 5.0  # English prose: about 4 bytes a GPT-2 token


def test_two_ranks_give_the_bits_per_byte_of_all_their_targets(tmp_path, shared_data, gpt2_encoding, monkeypatch):
    # Two ranks played in one process, rank 1 first: the collective records what rank 1 hands it, then gives rank 0
    # the mean of its own value and rank 1's, as an all-reduce would.
    write_text_shards(tmp_path, (shared_data / "tinyshakespeare" / "input.txt").read_text()[:100_000], gpt2_encoding)
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    B, T, steps = 2, 32, 3
    rank_1 = []
    monkeypatch.setattr(validation, "average_across_ranks", lambda t: rank_1.append(t) or t)
    validation_loss(model, DistributedDataLoader(tmp_path, "val", B, T, 1, 2), steps, CPU, torch.float32)
    given = iter(rank_1)
    monkeypatch.setattr(validation, "average_across_ranks", lambda t: (t + next(given)) / 2)
    val = validation_loss(model, DistributedDataLoader(tmp_path, "val", B, T, 0, 2), steps, CPU, torch.float32)

    # The ranks together read what one process reads in twice the steps.
    nats, num_bytes, num_tokens = nats_bytes_tokens(model, DistributedDataLoader(tmp_path, "val", B, T), 2 * steps,
                                                    gpt2_encoding)
    assert val.loss == pytest.approx(nats / num_tokens, rel=1e-5)
    assert val.bpb == pytest.approx(nats / math.log(2) / num_bytes, rel=1e-5)
    _, rank_1_bytes_per_token = rank_1
    assert rank_1_bytes_per_token.item() != pytest.approx(num_bytes / num_tokens, rel=1e-3)  # so averaging shows


def test_validation_stopped_early_returns_none(tmp_path, shared_data, gpt2_encoding):
    write_text_shards(tmp_path, (shared_data / "tinyshakespeare" / "input.txt").read_text()[:200_000], gpt2_encoding)
    loader = DistributedDataLoader(tmp_path, "val", 1, 16)
    assert validation_loss(GPT(PRESETS["tiny"]), loader, 40, CPU, torch.float32, should_stop=lambda: True) is None


def test_without_the_tokenizer_val_bpb_is_none_and_the_loss_still_comes(tmp_path, monkeypatch, capsys, gpt2_encoding):
    write_text_shards(tmp_path, "To be, or not to be, that is the question. " * 400, gpt2_encoding)

    def offline():
        raise ConnectionError("no network")

    monkeypatch.setattr(tokenizer, "gpt2_encoding", offline)  # (what tiktoken_tokenizer("gpt2") calls)
    token_byte_lengths.cache_clear()
    try:
        val = validation_loss(GPT(PRESETS["tiny"]), DistributedDataLoader(tmp_path, "val", 1, 16), 2, CPU,
                              torch.float32)
    finally:
        token_byte_lengths.cache_clear()  # the other tests' table, not this test's None
    assert val.bpb is None and 10 < val.loss < 12
    assert "val_bpb is left out" in capsys.readouterr().err


def test_targets_of_no_text_leave_val_bpb_out_with_a_note_and_the_loss_still_comes(tmp_path, capsys, gpt2_encoding):
    write_shard(tmp_path / "empty_val_000000.bin", np.full(200, gpt2_encoding.eot_token))  # empty documents
    validation.warn_once.cache_clear()
    val = validation_loss(GPT(PRESETS["tiny"]), DistributedDataLoader(tmp_path, "val", 2, 16), 3, CPU, torch.float32)
    assert val.bpb is None and 10 < val.loss < 12  # (not a ZeroDivisionError: no bytes to divide by)
    assert "val_bpb is left out: the validation's targets hold no text" in capsys.readouterr().err
