"""Every part of the pipeline follows the run's tokenizer (issue 56): snapshots record the data's, a resume or an
--init_from across tokenizers stops naming both, the samples, zero-shot tasks, tools.sample and tools.evaluate read
and write text with it, bits per byte count its bytes, and tools.export_hf writes it so that transformers gives our
ids and our logits and our tools read the export as its snapshot (issue 61). On bytes-tokenized text and on a small
byte-level BPE trained on it."""

import contextlib
import io
import json
import math
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import tiktoken
import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from conftest import ROOT, SHARED_DATA, perturb_
from data import prepare, train_tokenizer
from data.tokenizer_flag import load_tokenizer
from dataloader import DistributedDataLoader, read_data_tokenizer
from evaluation import tasks as evals
from helpers_train import main_in_process, read_metrics, run_train, train_env
from model import GPT, PRESETS
from rundir.snapshot import read_model
from tools import evaluate, export_hf, sample
from training.config import parse_args
from training.errors import UserError
from training.inputs import resolve_plan
from training.tokenizer import (
    ByteTokenizer,
    TiktokenTokenizer,
    TokenizerSpec,
    bytes_spec,
    generate_text,
    gpt2_spec,
    tokenizer_from_spec,
)

PROMPT = "Hello, I'm a language model,"  # what a run samples from
# An emoji with a skin tone, CJK, a combining accent, the delimiter, control and Latin-1 characters, runs of spaces
TEXT = "Héllo 👋🏽 世界! e\u0301 <|endoftext|> naïve\x00\x7f\u00ff\ttabs\n\n  end  "
# 3 steps of 2 × 32 tokens; validation, copa (4 documents) and samples before steps 0 and 2; snapshots after 1 and 2
RUN = ["--micro_batch_size", "2", "--seq_len", "32", "--total_batch_size", "64", "--max_steps", "3", "--dtype",
       "fp32", "--val_every", "2", "--val_tokens", "128", "--eval_every", "2", "--eval_tasks", "copa", "--eval_limit",
       "4", "--eval_dir", str(SHARED_DATA / "evals"), "--sample_every", "2", "--snapshot_every", "2", "--keep_last",
       "5"]
KINDS = ["bytes", "bpe"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shared_data) -> Path:
    root = tmp_path_factory.mktemp("pipeline")
    (root / "corpus.txt").write_text((shared_data / "tinyshakespeare" / "input.txt").read_text()[:60_000])
    return root


@pytest.fixture(scope="module")
def bpe(corpus) -> Path:
    """A 400-token byte-level BPE trained on the corpus (data/train_tokenizer.py)."""
    train_tokenizer.main(["--input", str(corpus / "corpus.txt"), "--vocab_size", "400", "--output",
                          str(corpus / "bpe")])
    return corpus / "bpe"


@pytest.fixture(scope="module")
def runs(corpus, bpe) -> dict[str, tuple[Path, str]]:
    """For bytes and the BPE: the corpus's shards, and a 3-step run on them (its directory and what it printed)."""
    done = {}
    for kind, tokenizer in (("bytes", "bytes"), ("bpe", str(bpe))):
        prepare.main(["--input", str(corpus / "corpus.txt"), "--tokenizer", tokenizer, "--output_dir",
                      str(corpus / kind / "data")])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            main_in_process([*RUN, "--data_dir", str(corpus / kind / "data"), "--log_dir", str(corpus / kind)])
        done[kind] = corpus / kind, printed.getvalue()
    return done


def tokenizer_of_run(run: Path):
    return tokenizer_from_spec(read_data_tokenizer(run / "data"))


@pytest.mark.slow  # two tiny training runs (module-scoped: the tests below share them)
@pytest.mark.parametrize("kind", KINDS)
def test_a_run_records_its_datas_tokenizer_and_samples_and_scores_with_it(runs, kind):
    run, printed = runs[kind]
    spec = read_data_tokenizer(run / "data")
    assert spec.kind == {"bytes": "bytes", "bpe": "hf"}[kind] and spec.vocab_size == {"bytes": 257, "bpe": 400}[kind]
    saved = torch.load(run / "snapshot_0000002.pt", weights_only=True)
    assert saved["tokenizer"] == spec.to_dict()
    assert saved["model_config"]["vocab_size"] == spec.vocab_size
    # The samples before step 2 are of the weights after step 1, decoded with the data's tokenizer.
    expected = generate_text(read_model(run / "snapshot_0000001.pt"), PROMPT, num_samples=4, max_new_tokens=32,
                             temperature=1.0, top_k=50, seed=42, tokenizer=tokenizer_of_run(run))
    assert [line for line in printed.splitlines() if line.startswith("sample 2: ")] == \
        [f"sample 2: {text!r}" for text in expected]
    logged = [r for r in read_metrics(run) if "copa/acc" in r]
    assert [r["step"] for r in logged] == [0, 2]


def mismatch(its: Path | TokenizerSpec, data: Path) -> str:
    """What the error says of weights trained with `its` tokenizer (a run's data's) and the data in `data`."""
    its = its if isinstance(its, TokenizerSpec) else read_data_tokenizer(its)
    return (f"was trained with the tokenizer {its.describe()}, but the data in {data} was written with "
            f"{read_data_tokenizer(data).describe()}: the same token id is other text under each.")


@pytest.mark.slow  # a fresh Python each, which stops before step 0
@pytest.mark.parametrize("flag, data, its", [("--resume", "bpe", "bytes"), ("--init_from", "bytes", "bpe")])
def test_a_resume_or_init_from_across_tokenizers_exits_2_naming_both(runs, tmp_path, flag, data, its):
    data_dir, snapshot = runs[data][0] / "data", runs[its][0] / "snapshot_0000002.pt"
    result = run_train([*RUN, "--data_dir", str(data_dir), flag, str(snapshot)], tmp_path, check=False).proc
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"error: {'--init_from ' * (flag == '--init_from')}{snapshot} "
                                    f"{mismatch(runs[its][0] / 'data', data_dir)}") and \
        result.stderr.count("\n") == 1, result.stderr
    assert not list(tmp_path.glob("snapshot_*"))


@pytest.mark.slow  # the runs
def test_init_from_openais_gpt2_on_other_data_is_refused_before_any_download(runs):
    with pytest.raises(UserError) as refused:
        resolve_plan(parse_args(["--init_from", "gpt2", "--data_dir", str(runs["bytes"][0] / "data")]), 1)
    assert str(refused.value).startswith(f"--init_from gpt2 {mismatch(gpt2_spec(), runs['bytes'][0] / 'data')}")


@pytest.mark.slow  # the runs
@pytest.mark.parametrize("kind", KINDS)
def test_tools_sample_prints_text_decoded_with_the_snapshots_tokenizer(runs, kind, capsys):
    snapshot = runs[kind][0] / "snapshot_0000002.pt"
    capsys.readouterr()
    sample.main(["--snapshot", str(snapshot), "--num_samples", "2", "--max_new_tokens", "12", "--seed", "3",
                 "--device", "cpu", "--prompt", TEXT])
    expected = generate_text(read_model(snapshot), TEXT, num_samples=2, max_new_tokens=12, seed=3,
                             tokenizer=tokenizer_of_run(runs[kind][0]))
    assert capsys.readouterr().out == "".join(f"--- sample {i} ---\n{text}\n" for i, text in enumerate(expected))


@pytest.mark.slow  # the runs
@pytest.mark.parametrize("kind", KINDS)
def test_an_export_samples_scores_and_initialises_a_run_as_its_snapshot_does(runs, kind, tmp_path, capsys):
    run, other = runs[kind][0], runs[KINDS[1 - KINDS.index(kind)]][0]
    snapshot, export_dir = run / "snapshot_0000002.pt", tmp_path / "hf"
    export_hf.main([str(snapshot), str(export_dir)])
    printed = {}
    for flag, source in (("--snapshot", snapshot), ("--model", export_dir)):
        capsys.readouterr()
        sample.main([flag, str(source), "--num_samples", "2", "--max_new_tokens", "12", "--seed", "3", "--device",
                     "cpu", "--prompt", TEXT])
        printed[f"sample {flag}"] = capsys.readouterr().out
        evaluate.main([flag, str(source), "--data_dir", str(run / "data"), "--micro_batch_size", "2", "--seq_len",
                       "32", "--val_tokens", "128", "--dtype", "fp32", "--tasks", "copa", "--limit", "4",
                       "--eval_dir", str(SHARED_DATA / "evals"), "--json", "--device", "cpu"])
        printed[f"evaluate {flag}"] = json.loads(capsys.readouterr().out)
    expected = generate_text(read_model(snapshot), TEXT, num_samples=2, max_new_tokens=12, seed=3,
                             tokenizer=tokenizer_of_run(run))
    assert printed["sample --model"] == printed["sample --snapshot"] == \
        "".join(f"--- sample {i} ---\n{text}\n" for i, text in enumerate(expected))
    scores = {flag: {key: printed[f"evaluate {flag}"][key] for key in ("val_loss", "val_bpb", "copa/acc")}
              for flag in ("--snapshot", "--model")}
    assert scores["--model"] == scores["--snapshot"]
    plan = resolve_plan(parse_args([*RUN, "--init_from", str(export_dir), "--data_dir", str(run / "data")]), 1)
    assert plan.model_config.vocab_size == read_data_tokenizer(run / "data").vocab_size
    with pytest.raises(UserError) as refused:
        resolve_plan(parse_args([*RUN, "--init_from", str(export_dir), "--data_dir", str(other / "data")]), 1)
    assert str(refused.value).startswith(f"--init_from {export_dir} {mismatch(run / 'data', other / 'data')}")


def bytes_of_targets(kind: str, run: Path, steps: int) -> tuple[int, int]:
    """By hand, apart from validation.py: the UTF-8 bytes of the first `steps` val micro-batches' targets (the
    delimiter none), and their number. A BPE token's bytes are its spelling in the byte-level alphabet."""
    spelt = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab = {}
    if kind == "bpe":
        definition = json.loads((run.parent / "bpe" / "tokenizer.json").read_text())
        special = {token["id"] for token in definition["added_tokens"]}
        vocab = {i: len(token) for token, i in definition["model"]["vocab"].items() if i not in special}
        assert len(vocab) == 399 and all(set(token) <= spelt.keys() for token in definition["model"]["vocab"])
    loader = DistributedDataLoader(run / "data", "val", 2, 32)
    num_bytes = num_tokens = 0
    for _ in range(steps):
        targets = loader.next_batch()[1].flatten().tolist()
        num_bytes += sum((token < 256 if kind == "bytes" else vocab.get(token, 0)) for token in targets)
        num_tokens += len(targets)
    return num_bytes, num_tokens


@pytest.mark.slow  # the runs
@pytest.mark.parametrize("kind", KINDS)
def test_tools_evaluate_gives_the_runs_numbers_and_the_bits_per_byte_of_its_tokenizers_bytes(runs, kind, capsys):
    run = runs[kind][0]
    capsys.readouterr()
    evaluate.main(["--snapshot", str(run / "snapshot_0000001.pt"), "--tasks", "copa", "--json", "--device", "cpu"])
    result = json.loads(capsys.readouterr().out)
    logged = {key: r[key] for r in read_metrics(run) if r.get("step") == 2 for key in r}
    assert result["val_loss"] == logged["val_loss"] and result["val_bpb"] == logged["val_bpb"]
    assert result["copa/acc"] == logged["copa/acc"]  # the tasks read with the run's tokenizer, as in training
    num_bytes, num_tokens = bytes_of_targets(kind, run, steps=2)  # --val_tokens 128 = 2 micro-batches of 2 × 32
    assert result["val_bpb"] == pytest.approx(result["val_loss"] / math.log(2) * num_tokens / num_bytes, rel=1e-6)
    low, high = {"bytes": (0.98, 1.0), "bpe": (1.4, 2.4)}[kind]  # a byte a token (but the delimiter); ~1.8
    assert low <= num_bytes / num_tokens <= high


def export(tokenizer, tmp_path: Path) -> tuple[GPT, Path]:
    """A tiny model of the tokenizer's vocabulary, its weights moved far from their init, saved with the tokenizer's
    record as a snapshot's model and exported."""
    model = perturb_(GPT(replace(PRESETS["tiny"], vocab_size=tokenizer.vocab_size)), 0.1)
    path = tmp_path / "model.pt"
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config),
                "tokenizer": tokenizer.spec.to_dict()}, path)
    export_hf.main([str(path), str(tmp_path / "hf")])
    return model.eval(), tmp_path / "hf"


@pytest.mark.slow  # transformers
@pytest.mark.parametrize("kind", KINDS)
def test_export_hf_round_trips_through_transformers_with_our_ids_and_our_logits(bpe, kind, tmp_path):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    ours = ByteTokenizer() if kind == "bytes" else load_tokenizer(str(bpe))
    model, out = export(ours, tmp_path)
    theirs = AutoTokenizer.from_pretrained(out)
    ids = theirs(TEXT).input_ids
    assert ids == ours.encode(TEXT, allow_eot=True) and ours.eot in ids
    assert theirs.decode(ids) == TEXT
    assert theirs.eos_token_id == theirs.bos_token_id == ours.eot
    hf_model = GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf_model.config.vocab_size == ours.vocab_size
    assert hf_model.config.eos_token_id == hf_model.config.bos_token_id == ours.eot
    idx = torch.tensor([ids[:64]])
    with torch.no_grad():
        expected, _ = model(idx)
        got = hf_model(idx).logits
    assert got.shape == expected.shape == (1, min(64, len(ids)), ours.vocab_size)
    assert expected.std() > 0.5  # far from a fresh init's near-uniform logits, so the check has teeth
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.slow  # converts GPT-2's 50,000 merges: seconds
def test_a_tiktoken_encoding_exports_with_its_special_tokens_at_their_ids(gpt2_encoding, tmp_path):
    from transformers import AutoTokenizer

    # GPT-2's merges with special tokens past a gap, as in cl100k_base; only <|endoftext|> is special to us
    gapped = tiktoken.Encoding(name="gapped", pat_str=gpt2_encoding._pat_str,
                               mergeable_ranks=gpt2_encoding._mergeable_ranks,
                               special_tokens={"<|endoftext|>": 50300, "<|fim_prefix|>": 50280})
    ours = TiktokenTokenizer(gapped)
    export_hf.write_own_tokenizer(export_hf.hf_tokenizer_json(ours), tmp_path, 64)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    text = TEXT + " <|fim_prefix|> is text"
    assert theirs(text).input_ids == ours.encode(text, allow_eot=True)
    assert 50300 in ours.encode(text, allow_eot=True) and 50280 not in ours.encode(text, allow_eot=True)
    assert theirs.decode([50280]) == "<|fim_prefix|>" and theirs.eos_token_id == 50300


def test_the_zero_shot_tasks_are_tokenized_with_the_given_tokenizer(shared_data):
    docs = {"copa": evals.load_docs("copa", shared_data / "evals" / "copa.jsonl", 3)}
    suite = evals.Suite(docs, 64, 512, ByteTokenizer())
    pairs = [pair for doc in docs["copa"] for pair in doc.requests]
    assert len(suite.requests) == len(pairs) == 6
    for request, (context, continuation) in zip(suite.requests, pairs):
        whole = list((context + continuation).encode())
        assert request.tokens + request.targets[-1:] == whole[-65:]
        assert bytes(request.targets).decode() == (context[len(context.rstrip()):] + continuation)


@pytest.mark.slow  # a fresh Python
def test_a_snapshot_whose_tokenizer_is_not_to_be_had_here_is_one_clear_error(tmp_path):
    # A run on cl100k_base's data, sampled on a node without network whose tiktoken cache lacks that encoding.
    model = GPT(PRESETS["tiny"])
    record = bytes_spec().to_dict() | {"kind": "tiktoken", "name": "cl100k_base", "sha256": "ab" * 32,
                                       "vocab_size": 100277, "eot": 100257}
    path = tmp_path / "model.pt"
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "tokenizer": record}, path)
    (tmp_path / "empty_cache").mkdir()
    offline = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache"), "HTTPS_PROXY": "http://127.0.0.1:9",
               "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}  # (a closed port: no network)
    result = subprocess.run([sys.executable, "-m", "tools.sample", "--snapshot", str(path), "--device", "cpu"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=train_env(offline))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: {path} was trained with the tokenizer cl100k_base (tiktoken, 100,277 "
                                    "ids, sha256 abababab…), which reads and writes its text: the tiktoken encoding "
                                    "'cl100k_base' could not be loaded (")
    assert "TIKTOKEN_CACHE_DIR" in result.stderr and result.stderr.count("\n") == 1
    assert result.stdout == ""
