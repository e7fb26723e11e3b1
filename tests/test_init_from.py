"""--init_from: a run starts from pretrained weights (a Hugging Face directory standing in for the hub, or a snapshot
of ours), with a fresh optimizer, schedule and data position; once it has snapshots of its own it resumes from them."""

import math
import shutil

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from config import model_config, parse_args
from conftest import make_shards, perturb_
from dataloader import DistributedDataLoader
from errors import UserError
from helpers_train import run_train
from snapshot import list_snapshots, read_model, snapshot_path

B, T = 2, 16
ARGS = ["--micro_batch_size", str(B), "--seq_len", str(T), "--total_batch_size", str(B * T), "--warmup_steps", "2",
        "--max_lr", "1e-3", "--dtype", "fp32", "--val_every", "3", "--val_steps", "2", "--block_size", "32"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny random GPT-2 saved by transformers, the shape of our `tiny` preset (which the test runs name), with 64
    positions that the runs crop to 32; and some shards."""
    root = tmp_path_factory.mktemp("init_from")
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=64, n_embd=64, n_layer=2, n_head=2)).eval()
    perturb_(hf, 0.05)  # non-trivial biases and gains, so a weight that did not load would show
    hf.save_pretrained(root / "hf")
    # Tokens from a 100-word vocabulary: learnable, so a few steps move the loss visibly.
    make_shards(root / "data", "train", [400], vocab=100)
    make_shards(root / "data", "val", [200], seed=1, vocab=100)
    return root, hf


def hf_val_loss(hf: GPT2LMHeadModel, data) -> float:
    """The Hugging Face model's own loss on the run's first 2 validation micro-batches."""
    val = DistributedDataLoader(data, "val", B, T)
    losses = []
    with torch.no_grad():
        for _ in range(2):
            x, y = val.next_batch()
            logits = hf(x).logits
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
    return (sum(losses) / 2).item()


@pytest.mark.slow  # a few seconds: keeps `-m 'not slow'` under 90 s
def test_step_0_of_a_run_from_hugging_face_weights_has_the_hugging_face_models_loss(pretrained, tmp_path):
    root, hf = pretrained
    run = run_train(["--data_dir", str(root / "data"), *ARGS, "--init_from", str(root / "hf"), "--max_steps", "1"],
                    tmp_path)
    logged = run.val[0]["val_loss"]
    assert logged == pytest.approx(hf_val_loss(hf, root / "data"), rel=1e-5)
    assert abs(logged - math.log(50257)) > 0.1  # not what any freshly initialised model would score
    assert run.records[0] == {"event": "init", "step": 0, "init_from": str(root / "hf")}
    assert f"initialised from {root / 'hf'}" in run.proc.stdout
    assert read_model(snapshot_path(tmp_path, 0)).transformer.wpe.weight.shape == (32, 64)  # cropped


@pytest.mark.slow
def test_step_0_of_a_run_from_our_snapshot_has_that_models_loss(pretrained, tmp_path):
    root, _ = pretrained
    first = run_train(["--data_dir", str(root / "data"), *ARGS, "--max_steps", "3"], tmp_path / "first")
    source = snapshot_path(tmp_path / "first", 2)
    second = run_train(["--data_dir", str(root / "data"), *ARGS, "--init_from", str(source), "--max_steps", "1"],
                       tmp_path / "second")
    model = read_model(source).eval()
    val = DistributedDataLoader(root / "data", "val", B, T)
    with torch.no_grad():
        expected = sum(model(*val.next_batch())[1].item() for _ in range(2)) / 2
    assert second.val[0]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert second.val[0]["val_loss"] < first.val[0]["val_loss"] - 0.01  # the trained weights, not fresh ones
    assert second.train[0]["lr"] == first.train[0]["lr"]  # the schedule starts over


@pytest.mark.slow
def test_a_restarted_finetune_resumes_from_its_own_snapshot_with_the_uninterrupted_losses(pretrained, tmp_path):
    root, _ = pretrained
    args = ["--data_dir", str(root / "data"), *ARGS, "--init_from", str(root / "hf"), "--max_steps", "6",
            "--ckpt_every", "2", "--keep_last", "3"]
    whole = run_train(args, tmp_path / "whole")
    # The crash: the run got as far as the snapshot of step 3.
    (tmp_path / "crashed").mkdir()
    shutil.copy(snapshot_path(tmp_path / "whole", 3), tmp_path / "crashed")
    again = run_train(args, tmp_path / "crashed")
    assert [r.get("event") for r in again.records if "event" in r] == ["resume"]  # not re-initialised from hf
    assert "resuming from" in again.proc.stdout and "initialised from" not in again.proc.stdout
    losses = {r["step"]: r["loss"] for r in again.train}
    assert sorted(losses) == [4, 5]
    for r in whole.train[4:]:
        assert losses[r["step"]] == pytest.approx(r["loss"], rel=1e-6)
    assert list_snapshots(tmp_path / "crashed")[0] == snapshot_path(tmp_path / "crashed", 5)


def test_shape_flags_must_agree_with_the_pretrained_weights(pretrained):
    root, _ = pretrained
    with pytest.raises(UserError, match=r"--n_layer 3 \(the weights have 2\)"):
        model_config(parse_args(["--init_from", str(root / "hf"), "--n_layer", "3"]))
    with pytest.raises(UserError, match=r"--n_head 12 \(the weights have 2\)"):
        model_config(parse_args(["--init_from", str(root / "hf"), "--model", "gpt2"]))
    with pytest.raises(UserError, match="--block_size 128 is longer than the 64 positions"):
        model_config(parse_args(["--init_from", str(root / "hf"), "--block_size", "128"]))
    assert model_config(parse_args(["--init_from", str(root / "hf"), "--block_size", "32"])).block_size == 32


def test_a_missing_or_foreign_init_from_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no such file or directory"):
        model_config(parse_args(["--init_from", str(tmp_path / "nowhere")]))
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    with pytest.raises(UserError, match="is not a snapshot of this codebase"):
        model_config(parse_args(["--init_from", str(tmp_path / "foreign.pt")]))
    (tmp_path / "not_hf").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        model_config(parse_args(["--init_from", str(tmp_path / "not_hf")]))
