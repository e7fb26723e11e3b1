"""--init_from: a run starts from pretrained weights (a Hugging Face directory standing in for the hub, or a snapshot
of ours), with a fresh optimizer, schedule and data position; once it has snapshots of its own it resumes from them.
A Hugging Face directory is checked first (hf.local_config): its config.json, and its weight file's names and shapes
against it, as OpenAI's files and save_pretrained's lay them out."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import copy_run, make_shards, perturb_
from dataloader import DistributedDataLoader
from helpers_train import main_in_process, read_metrics
from rundir.snapshot import list_snapshots, read_model, snapshot_path
from training import hf
from training.config import parse_args
from training.errors import UserError
from training.inputs import model_config

B, T = 2, 16
ARGS = ["--micro_batch_size", str(B), "--seq_len", str(T), "--total_batch_size", str(B * T), "--warmup_steps", "2",
        "--max_lr", "1e-3", "--dtype", "fp32", "--val_every", "3", "--val_tokens", "64", "--block_size", "32"]


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
    # The same, of the bytes tokenizer, for runs that need no GPT-2 weights: a model 257 ids wide, not 50,257.
    make_shards(root / "bytes", "train", [400], vocab=100, tokenizer="bytes")
    make_shards(root / "bytes", "val", [200], seed=1, vocab=100, tokenizer="bytes")
    return root, hf


def trained(args: list[str], log_dir: Path) -> tuple[list[dict], list[dict]]:
    """train_gpt2.main in this process (no interpreter to start): the train and the val records it logged."""
    main_in_process([*args, "--log_dir", str(log_dir)])
    records = read_metrics(log_dir)
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


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
def test_step_0_of_a_run_from_hugging_face_weights_has_the_hugging_face_models_loss(pretrained, tmp_path, capsys):
    root, hf = pretrained
    _, val = trained(["--data_dir", str(root / "data"), *ARGS, "--init_from", str(root / "hf"), "--max_steps", "1"],
                     tmp_path)
    logged = val[0]["val_loss"]
    assert logged == pytest.approx(hf_val_loss(hf, root / "data"), rel=1e-5)
    assert abs(logged - math.log(50257)) > 0.1  # not what any freshly initialised model would score
    assert read_metrics(tmp_path)[0] == {"event": "init", "step": 0, "init_from": str(root / "hf")}
    assert f"initialised from {root / 'hf'}" in capsys.readouterr().out
    assert read_model(snapshot_path(tmp_path, 0)).transformer.wpe.weight.shape == (32, 64)  # cropped


@pytest.mark.slow
def test_step_0_of_a_run_from_our_snapshot_has_that_models_loss(pretrained, tmp_path):
    root, _ = pretrained
    first_train, first_val = trained(["--data_dir", str(root / "bytes"), *ARGS, "--max_steps", "3"],
                                     tmp_path / "first")
    source = snapshot_path(tmp_path / "first", 2)
    second_train, second_val = trained(["--data_dir", str(root / "bytes"), *ARGS, "--init_from", str(source),
                                        "--max_steps", "1"], tmp_path / "second")
    model = read_model(source).eval()
    val = DistributedDataLoader(root / "bytes", "val", B, T)
    with torch.no_grad():
        expected = sum(model(*val.next_batch())[1].item() for _ in range(2)) / 2
    assert second_val[0]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert second_val[0]["val_loss"] < first_val[0]["val_loss"] - 0.01  # the trained weights, not fresh ones
    assert second_train[0]["lr"] == first_train[0]["lr"]  # the schedule starts over


@pytest.mark.slow
def test_a_restarted_finetune_resumes_from_its_own_snapshot_with_the_uninterrupted_losses(pretrained, tmp_path,
                                                                                           capsys):
    root, _ = pretrained
    args = ["--data_dir", str(root / "data"), *ARGS, "--init_from", str(root / "hf"), "--max_steps", "6",
            "--snapshot_every", "2", "--keep_last", "3"]
    whole, _ = trained(args, tmp_path / "whole")
    # The crash: the run got as far as the snapshot of step 3.
    copy_run(tmp_path / "whole", tmp_path / "crashed", 3)
    capsys.readouterr()
    again, _ = trained(args, tmp_path / "crashed")
    events = [r["event"] for r in read_metrics(tmp_path / "crashed") if "event" in r]
    assert events == ["resume", "timeline"]  # not re-initialised
    out = capsys.readouterr().out
    assert "resuming from" in out and "initialised from" not in out
    losses = {r["step"]: r["loss"] for r in again}
    assert sorted(losses) == [4, 5]
    for r in whole[4:]:
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


# ----------------------------------------------------------------------------------------------------------------
# a Hugging Face directory's files, checked before anything loads them

def hf_directory(path: Path, pretrained_dir: Path, weights: dict[str, torch.Tensor] | None = None,
                 weight_file: str = "model.safetensors", config: dict | bytes | None = None) -> Path:
    """A model directory: the pretrained one's config.json (or `config`: settings to change, or the file's bytes) and
    `weights` written as `weight_file` (safetensors or torch.save), or the pretrained one's weight file."""
    path.mkdir()
    hf_config = json.loads((pretrained_dir / "config.json").read_text())
    (path / "config.json").write_bytes(config if isinstance(config, bytes) else
                                       json.dumps(hf_config | (config or {})).encode())
    if weights is None:
        shutil.copy(pretrained_dir / "model.safetensors", path)
    elif weight_file.endswith(".safetensors"):
        save_file({name: tensor.contiguous() for name, tensor in weights.items()}, path / weight_file)
    else:
        torch.save(weights, path / weight_file)
    return path


def saved_weights(hf_model: GPT2LMHeadModel) -> dict[str, torch.Tensor]:
    """The weights as save_pretrained writes them: GPT2LMHeadModel's names, lm_head.weight (tied to wte) left out."""
    return {name: tensor.clone() for name, tensor in hf_model.state_dict().items() if name != "lm_head.weight"}


def openai_layout(hf_model: GPT2LMHeadModel) -> dict[str, torch.Tensor]:
    """The weights as OpenAI's files on the hub hold them: the transformer's names (no "transformer." prefix), with
    each block's causal-mask buffers, attn.bias and attn.masked_bias."""
    weights = {name.removeprefix("transformer."): tensor for name, tensor in saved_weights(hf_model).items()}
    n = hf_model.config.n_positions
    for i in range(hf_model.config.n_layer):
        weights[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        weights[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return weights


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(a.state_dict()[name], b.state_dict()[name]) for name in a.state_dict())


@pytest.mark.parametrize("layout", ["openai pytorch_model.bin", "openai model.safetensors", "sharded safetensors"])
def test_the_layouts_of_openais_files_and_of_save_pretrained_all_load(pretrained, tmp_path, layout):
    root, hf_model = pretrained
    if layout == "sharded safetensors":  # model.safetensors.index.json and two shards, as a large model's
        hf_model.save_pretrained(tmp_path / "hf", max_shard_size="5MB")
        assert len(list((tmp_path / "hf").glob("model-*-of-00002.safetensors"))) == 2
    else:
        hf_directory(tmp_path / "hf", root / "hf", openai_layout(hf_model), layout.split()[1])
    assert model_config(parse_args(["--init_from", str(tmp_path / "hf")])).n_embd == 64
    torch.manual_seed(0)  # (the rows that pad the vocabulary to a multiple of 128 keep their random init)
    loaded = hf.from_pretrained(str(tmp_path / "hf"))
    torch.manual_seed(0)
    assert_same_weights(loaded, hf.from_pretrained(str(root / "hf")))


@pytest.mark.parametrize("case, message", [
    ("none of GPT-2's names", r"model\.safetensors does not hold the GPT-2 weights its config\.json describes "
     r"\(n_layer 2, n_head 2, n_embd 64, n_positions 64, vocab_size 50257\): 28 of its 28 weights missing: "
     r"transformer\.wte\.weight, transformer\.wpe\.weight, transformer\.h\.0\.ln_1\.weight and 25 more; 2 tensors it "
     r"does not have: decoder\.out\.weight, encoder\.embed\.weight\. .* random numbers"),
    ("none of GPT-2's names, in pytorch_model.bin", r"pytorch_model\.bin does not hold the GPT-2 weights .*: 28 of its "
     r"28 weights missing: .*; 2 tensors it does not have: encoder\.embed\.weight, decoder\.out\.weight\."),
    ("one weight missing", r"model\.safetensors does not hold .*: 1 of its 28 weights missing: "
     r"transformer\.ln_f\.bias\. "),
    ("one more", r"model\.safetensors does not hold .*: 1 tensors it does not have: "
     r"transformer\.h\.2\.ln_1\.weight\. "),
    ("another shape", r"model\.safetensors does not hold .* n_positions 128, .*: 1 of another shape: "
     r"transformer\.wpe\.weight \[64, 64\], not \[128, 64\]\. "),
])
def test_a_weight_file_that_does_not_hold_gpt2s_weights_is_refused_naming_it_and_the_first_few(pretrained, tmp_path,
                                                                                              case, message):
    # transformers loads any of these with a warning, starting what the file lacks from random numbers: a run
    # printed "initialised from" and trained from scratch.
    root, hf_model = pretrained
    weights, config = saved_weights(hf_model), None
    if case.startswith("none of GPT-2's names"):
        weights = {"encoder.embed.weight": torch.zeros(8, 4), "decoder.out.weight": torch.zeros(4, 8)}
    elif case == "one weight missing":
        del weights["transformer.ln_f.bias"]
    elif case == "one more":
        weights["transformer.h.2.ln_1.weight"] = torch.ones(64)
    else:
        config = {"n_positions": 128}
    directory = hf_directory(tmp_path / "hf", root / "hf", weights,
                             "pytorch_model.bin" if case.endswith("pytorch_model.bin") else "model.safetensors", config)
    for load in (lambda: model_config(parse_args(["--init_from", str(directory)])),  # train_gpt2.py, at its plan
                 lambda: hf.from_pretrained(str(directory))):  # tools.sample, tools.evaluate --model
        with pytest.raises(UserError, match=message) as raised:
            load()
        assert str(directory) in str(raised.value) and "\n" not in str(raised.value)


def test_a_pickled_payload_in_pytorch_model_bin_is_refused_unrun_and_without_torchs_advice(pretrained, tmp_path):
    root, hf_model = pretrained
    ran = tmp_path / "the payload ran"

    class Payload:
        def __reduce__(self):  # unpickling calls open(ran, "w"): a file appears if the payload runs
            return open, (str(ran), "w")

    directory = hf_directory(tmp_path / "hf", root / "hf", saved_weights(hf_model) | {"extra": Payload()},
                             "pytorch_model.bin")
    for load in (lambda: model_config(parse_args(["--init_from", str(directory)])),
                 lambda: hf.from_pretrained(str(directory))):
        with pytest.raises(UserError) as raised:
            load()
        message = str(raised.value)
        assert message.startswith(f"{directory / 'pytorch_model.bin'} was refused: its pickle holds the global "
                                  "io.open, which is not plain data, and unpickling it could run code, so it will not "
                                  "be loaded. Get these weights as model.safetensors")
        assert "weights_only" not in message and "\n" not in message
    assert not ran.exists()


@pytest.mark.parametrize("weight_file, content, message", [
    ("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header",
     r"model\.safetensors could not be read as a safetensors file \(.*\); it is truncated, corrupt or not one"),
    ("pytorch_model.bin", b"not a torch file" * 10, r"pytorch_model\.bin could not be read as a PyTorch weight file: "
     r"it is truncated, corrupt or not a torch file\. Pass a directory that transformers' save_pretrained wrote"),
    ("pytorch_model.bin", b"", r"pytorch_model\.bin could not be read as a PyTorch weight file: it is truncated"),
    ("model.safetensors.index.json", json.dumps({"weight_map": {"wte.weight": "../elsewhere.safetensors"}}).encode(),
     r"index\.json names shard files outside its directory \(\.\./elsewhere\.safetensors\)"),
    ("model.safetensors.index.json", b'{"weight_map": ',
     r"index\.json is not valid JSON \(column 16: Expecting value\)"),
    ("model.safetensors.index.json", b"[]", r"index\.json has no weight_map of tensor names to shard files"),
    (None, b"", r"holds no weight file \(model\.safetensors, model\.safetensors\.index\.json, pytorch_model\.bin, "
     r"pytorch_model\.bin\.index\.json\); save_pretrained writes model\.safetensors beside config\.json"),
])
def test_a_weight_file_that_cannot_be_read_is_a_clear_error(pretrained, tmp_path, weight_file, content, message):
    root, _ = pretrained
    directory = hf_directory(tmp_path / "hf", root / "hf", {}, "unused.bin")
    (directory / "unused.bin").unlink()
    if weight_file:
        (directory / weight_file).write_bytes(content)
    with pytest.raises(UserError, match=message):
        model_config(parse_args(["--init_from", str(directory)]))


NESTED = b'{"model_type": "gpt2", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("config, message", [
    (b'{"model_type": "gpt2",', r"config\.json is not valid JSON \(column 23: Expecting property name enclosed in "
     r"double quotes\)\. Pass a directory that transformers' save_pretrained wrote"),
    (b'{"model_type": "gpt2\xff"}', r"config\.json is not UTF-8 text \(byte 0xff at offset 20\)"),
    (NESTED, r"config\.json is nested too deeply to be read"),
    (b"[1, 2]", r"config\.json: a JSON list, not an object of settings"),
    ({"model_type": "llama"}, r"config\.json: model_type 'llama'; only GPT-2 \(model_type 'gpt2'\) weights fit"),
    ({"n_positions": None}, r"config\.json: n_positions None, not a whole number of 1 or more"),
    ({"n_layer": "2"}, r"config\.json: n_layer '2', not a whole number of 1 or more"),
    ({"n_head": 0}, r"config\.json: n_head 0, not a whole number of 1 or more"),
    ({"n_head": 3}, r"config\.json: n_embd 64 is not a multiple of n_head 3"),
    ({"activation_function": "relu"}, r"config\.json: activation_function 'relu', where this GPT-2 has 'gelu_new' or "
     r"'gelu_pytorch_tanh'"),
    ({"tie_word_embeddings": False}, r"config\.json: tie_word_embeddings False, where this GPT-2 has True"),
])
def test_a_config_json_our_gpt2_cannot_be_is_refused_naming_it(pretrained, tmp_path, config, message):
    root, _ = pretrained
    directory = hf_directory(tmp_path / "hf", root / "hf", config=config)
    with pytest.raises(UserError, match=message) as raised:
        model_config(parse_args(["--init_from", str(directory)]))
    assert str(directory / "config.json") in str(raised.value)


def test_a_config_json_without_n_positions_is_refused(pretrained, tmp_path):
    root, _ = pretrained
    hf_config = json.loads((root / "hf" / "config.json").read_text())
    del hf_config["n_positions"]  # transformers' GPT2Config would take 1024, and the weights hold 64 positions
    directory = hf_directory(tmp_path / "hf", root / "hf", config=json.dumps(hf_config).encode())
    with pytest.raises(UserError, match=r"config\.json: no n_positions \(save_pretrained writes it\)"):
        hf.from_pretrained(str(directory))
