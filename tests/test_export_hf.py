
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from conftest import save_tiny_model
from data.bpe import train_bpe
from model import GPT, PRESETS
from rundir.snapshot import read_model
from tools.export_hf import main
from training.errors import UserError
from training.tokenizer import HFTokenizer, TokenizerSpec, bytes_spec, gpt2_spec, read_tokenizer


@pytest.fixture
def perturbed_ckpt(tmp_path):
    """Random weights with every tensor moved far from its init, so a transposed, swapped or dropped tensor
    changes the logits."""
    return save_tiny_model(tmp_path / "model.pt", perturb=0.1)


def test_transformers_loads_the_export_with_our_logits_and_tokenizer(perturbed_ckpt, shared_data, tmp_path):
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    out = tmp_path / "hf"
    main([str(perturbed_ckpt), str(out), "--tokenizer_dir", str(shared_data / "gpt2_tokenizer")])
    assert (out / "model.safetensors").is_file()

    hf_model = GPT2LMHeadModel.from_pretrained(out).eval()
    assert (hf_model.config.n_positions, hf_model.config.n_layer, hf_model.config.n_head) == (64, 2, 2)
    assert hf_model.config.activation_function == "gelu_new"
    ours = read_model(perturbed_ckpt)
    idx = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, _ = ours(idx)
        got = hf_model(idx).logits
    assert got.shape == expected.shape == (2, 64, 50257)
    assert expected.std() > 0.5  # far from the near-uniform logits of a fresh init, so the check has teeth
    assert (got - expected).abs().max().item() <= 1e-4

    tokenizer = GPT2TokenizerFast.from_pretrained(out)
    assert tokenizer("Hello world").input_ids == [15496, 995]
    assert tokenizer.eos_token_id == 50256
    assert tokenizer.model_max_length == 64


def test_without_tokenizer_dir_says_how_to_add_it(perturbed_ckpt, tmp_path, capsys):
    main([str(perturbed_ckpt), str(tmp_path / "hf")])
    assert "tokenizer was NOT included" in capsys.readouterr().out
    assert (tmp_path / "hf" / "config.json").is_file()
    assert not (tmp_path / "hf" / "vocab.json").exists()


def test_missing_or_foreign_snapshot_is_refused_clearly(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nope.pt"), str(tmp_path / "hf")])
    assert "nope.pt: no such file" in capsys.readouterr().err

    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(SystemExit):
        main([str(foreign), str(tmp_path / "hf")])
    assert "is not a snapshot of this codebase" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_an_out_dir_that_is_a_file_is_refused_clearly(perturbed_ckpt, tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(UserError, match=f"^{tmp_path / 'taken'} is a file; pass a directory"):
        main([str(perturbed_ckpt), str(tmp_path / "taken")])
    assert (tmp_path / "taken").read_text() == "a file"


def test_an_out_dir_that_is_no_export_of_this_version_is_refused_and_left_as_it_was(perturbed_ckpt, tmp_path):
    out = tmp_path / "hf"
    main([str(perturbed_ckpt), str(out)])
    record = json.loads((out / "export_hf.json").read_text())
    assert record["version"] == 2 and record["files"] == ["config.json", "generation_config.json", "model.safetensors"]
    assert record["tokenizer"] == gpt2_spec().to_dict()
    (out / "README.md").write_text("my notes")
    with pytest.raises(UserError, match=rf"^{out} is an earlier export, and also holds what it did not write: "
                                        rf"README.md. The export replaces {out} whole"):
        main([str(perturbed_ckpt), str(out)])
    (out / "README.md").unlink()
    (out / "export_hf.json").write_text(json.dumps(record | {"version": 1}))
    with pytest.raises(UserError, match=rf"^{out / 'export_hf.json'} has version 1, and this code reads export "
                                        rf"records of version 2 only, so {out} is no export this tool reads"):
        main([str(perturbed_ckpt), str(out)])
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "export_hf.json", "generation_config.json",
                                                           "model.safetensors"]


def test_an_export_through_a_symbolic_link_replaces_the_directory_it_names(perturbed_ckpt, tmp_path):
    main([str(perturbed_ckpt), str(tmp_path / "real")])
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "config.json").write_text("{}")  # so that the new export shows
    main([str(perturbed_ckpt), str(tmp_path / "link")])
    assert (tmp_path / "link").readlink() == tmp_path / "real"
    assert json.loads((tmp_path / "real" / "config.json").read_text())["n_layer"] == 2
    assert sorted(path.name for path in tmp_path.iterdir()) == ["link", "model.pt", "real"]  # nothing left beside


def export_with(spec: TokenizerSpec, tmp_path) -> Path:
    """A tiny model of spec's vocabulary saved with spec as its tokenizer's record, and exported."""
    model = GPT(replace(PRESETS["tiny"], vocab_size=spec.vocab_size))
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "tokenizer": spec.to_dict()},
               tmp_path / "model.pt")
    main([str(tmp_path / "model.pt"), str(tmp_path / "hf")])
    return tmp_path / "hf"


def test_an_export_is_read_with_its_snapshots_tokenizer_and_other_directories_with_gpt2s(tmp_path):
    bpe = train_bpe(["the cat sat on the mat, and the dog sat on the log"] * 20, 300)
    spec = HFTokenizer(bpe.to_str(), "tiny_bpe").spec
    out = export_with(spec, tmp_path)
    assert read_tokenizer(out) == spec and read_tokenizer(tmp_path / "model.pt") == spec
    assert spec.vocab_size < 300 and (out / "tokenizer.json").read_text() == spec.definition
    (out / "tokenizer.json").write_text(spec.definition.replace('"cat"', '"cot"'))  # the record no longer fits it
    with pytest.raises(ValueError, match=rf"^{out / 'export_hf.json'}: its tokenizer record is malformed: the "
                                         r"definition's sha256 is not the one recorded"):
        read_tokenizer(out)
    (out / "export_hf.json").unlink()  # a Hugging Face directory that is no export of ours: OpenAI's GPT-2
    assert read_tokenizer(out) == gpt2_spec() == read_tokenizer("gpt2")


def test_an_export_record_without_a_tokenizer_is_refused_naming_it(tmp_path):
    out = export_with(bytes_spec(), tmp_path)
    assert read_tokenizer(out) == bytes_spec()
    record = json.loads((out / "export_hf.json").read_text())
    (out / "export_hf.json").write_text(json.dumps(record | {"tokenizer": None}))
    with pytest.raises(UserError, match=rf"^{out / 'export_hf.json'} lists no files or no tokenizer, so {out} is no "
                                        r"export this tool reads. Export its snapshot again"):
        read_tokenizer(out)
