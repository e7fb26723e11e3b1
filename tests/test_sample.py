import subprocess
import sys

import pytest
import torch

from conftest import ROOT, save_tiny_model
from rundir.snapshot import read_model
from tools.sample import main
from training.errors import run_entry_point
from training.tokenizer import generate_text

PROMPT = "Hello, I'm a language model,"


@pytest.fixture
def tiny_ckpt(tmp_path):
    return save_tiny_model(tmp_path / "model.pt")


def test_same_seed_gives_same_text_and_another_seed_differs(tiny_ckpt, gpt2_encoding):
    model = read_model(tiny_ckpt)
    first = generate_text(model, PROMPT, num_samples=3, max_new_tokens=8, top_k=50, seed=1)
    again = generate_text(model, PROMPT, num_samples=3, max_new_tokens=8, top_k=50, seed=1)
    other = generate_text(model, PROMPT, num_samples=3, max_new_tokens=8, top_k=50, seed=2)
    assert first == again
    assert first != other
    assert len(set(first)) == 3  # the samples of one call differ from each other
    for text in first + other:
        assert text.startswith(PROMPT)
        assert len(gpt2_encoding.encode(text)) > len(gpt2_encoding.encode(PROMPT))


def test_sampling_leaves_the_global_rng_alone(tiny_ckpt, gpt2_encoding):
    model = read_model(tiny_ckpt)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    generate_text(model, PROMPT, num_samples=2, max_new_tokens=4, seed=7)
    assert torch.equal(torch.rand(4), expected)  # periodic samples in training must not change the training run


@pytest.mark.slow  # over 3 s: keeps `-m 'not slow'` under 90 s
def test_cli_prints_what_the_function_returns(tiny_ckpt, gpt2_encoding):
    args = ["--num_samples", "2", "--max_new_tokens", "8", "--temperature", "0.8", "--top_k", "20", "--seed", "5"]
    result = subprocess.run([sys.executable, "-m", "tools.sample", "--snapshot", str(tiny_ckpt), "--device", "cpu",
                             *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    expected = generate_text(read_model(tiny_ckpt), PROMPT, num_samples=2, max_new_tokens=8,
                             temperature=0.8, top_k=20, seed=5)
    assert result.stdout == "".join(f"--- sample {i} ---\n{text}\n" for i, text in enumerate(expected))


@pytest.mark.parametrize("argv, message", [
    ([], "one of the arguments --snapshot --model is required"),
    (["--snapshot", "a.pt", "--model", "gpt2"], "not allowed with argument"),
    (["--snapshot", "does_not_exist.pt"], "does_not_exist.pt: no such file"),
])
def test_needs_exactly_one_existing_model_source(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_foreign_snapshot_is_refused_clearly(tmp_path, capsys):
    path = tmp_path / "other.pt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(SystemExit):
        main(["--snapshot", str(path)])
    assert "is not a snapshot of this codebase" in capsys.readouterr().err


@pytest.mark.slow  # a fresh Python: a few seconds
def test_a_model_directory_that_is_none_exits_2_with_one_paragraph(tmp_path):
    # hf.from_pretrained checks a directory's files first and raises a UserError, which the entry point reports.
    result = subprocess.run([sys.executable, "-m", "tools.sample", "--model", str(tmp_path), "--device", "cpu"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"error: {tmp_path} has no config.json, so it is not a Hugging Face model directory "
                             "(save_pretrained writes one). Pass a directory that transformers' save_pretrained wrote "
                             "for a GPT2LMHeadModel, or gpt2, gpt2-medium, gpt2-large or gpt2-xl (downloaded on first "
                             "use).\n")


@pytest.mark.parametrize("flags, message", [
    (["--num_samples", "-1"], "--num_samples -1: pass a number at least 1."),  # a traceback from torch before
    (["--max_new_tokens", "-1"], "--max_new_tokens -1: pass a number at least 0."),  # printed the prompt alone
    (["--temperature", "nan"], "--temperature nan: pass a finite number at least 0."),  # a traceback from torch
    (["--temperature", "-1"], "--temperature -1.0: pass a number at least 0."),  # sampled the least likely tokens
    (["--top_k", "-1"], "--top_k -1: pass a number at least 0."),  # a traceback from torch
    (["--top_p", "0"], "--top_p 0.0: pass a number above 0 and at most 1."),
    (["--device", "gpu"], "--device gpu: not a device torch knows; pass cuda, mps or cpu (or cuda:N)."),
])
def test_a_sampling_flag_outside_its_range_exits_2_naming_it(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:  # (the flags are checked before the snapshot is read)
        run_entry_point(lambda: main(["--snapshot", "never_read.pt", "--device", "cpu", *flags]))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"
