"""hellaswag.py (and tools/hellaswag.py, its command line): scoring against an independent Hugging Face computation,
rank splitting, stopping early on request, data loading, and one download per node that fails cleanly without
network."""

import hashlib
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hellaswag
import hf
import tools.hellaswag
from conftest import free_port, save_tiny_model
from errors import UserError
from model import GPT
from snapshot import read_model

ROOT = Path(__file__).resolve().parent.parent
VAL_FILE = Path("hellaswag") / "hellaswag_val.jsonl"
RENDER_EXAMPLE = hellaswag.render_example  # the real one, for the spies below


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A random tiny model. Its block_size of 32 is shorter than most examples, so evaluating it also exercises
    the left truncation."""
    path = save_tiny_model(tmp_path_factory.mktemp("ckpt") / "model.pt", block_size=32)
    return path


@pytest.mark.slow  # a few seconds: keeps `-m 'not slow'` under 90 s
def test_ending_scores_match_hugging_face(tmp_path, shared_data, gpt2_encoding):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf_model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=256, vocab_size=50257)).eval()
    with torch.no_grad():  # GPT-2's 0.02 init predicts nearly uniformly; larger weights make the choice non-trivial
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf_model.save_pretrained(tmp_path)
    ours = hf.from_pretrained(str(tmp_path))
    examples = hellaswag.load_examples(str(shared_data / VAL_FILE), limit=50)

    ref_preds, our_preds = [], []
    with torch.no_grad():
        for example in examples:
            # Reference: each ending on its own, no padding, log-probs straight from the HF logits.
            ctx = gpt2_encoding.encode_ordinary(example["ctx"])
            ref_losses = []
            for ending in example["endings"]:
                end = gpt2_encoding.encode_ordinary(" " + ending)
                logits = hf_model(torch.tensor([ctx + end])).logits[0, len(ctx) - 1: -1]  # the ones predicting `end`
                logprobs = torch.log_softmax(logits, dim=-1)[torch.arange(len(end)), end]
                ref_losses.append(-logprobs.mean())
            ref_losses = torch.stack(ref_losses)

            tokens, mask = hellaswag.render_example(example, gpt2_encoding, ours.config.block_size)
            _, our_losses = hellaswag.ending_losses(ours, tokens, mask)
            torch.testing.assert_close(our_losses, ref_losses, atol=1e-4, rtol=1e-5)
            ref_preds.append(int(ref_losses.argmin()))
            our_preds.append(int(our_losses.argmin()))

    assert our_preds == ref_preds
    assert len(set(ref_preds)) == 4  # the model does discriminate between endings
    ref_acc_norm = sum(p == ex["label"] for p, ex in zip(ref_preds, examples)) / len(examples)
    assert hellaswag.evaluate(ours, examples, "cpu") == ref_acc_norm


def test_long_rows_are_cut_from_the_left_keeping_the_ending(shared_data, gpt2_encoding):
    example = hellaswag.load_examples(str(shared_data / VAL_FILE), limit=1)[0]
    full, full_mask = hellaswag.render_example(example, gpt2_encoding, block_size=1024)
    cut, cut_mask = hellaswag.render_example(example, gpt2_encoding, block_size=12)
    ctx = gpt2_encoding.encode_ordinary(example["ctx"])
    assert full.shape[0] == cut.shape[0] == 4 and cut.shape[1] == 12
    for i, ending in enumerate(example["endings"]):
        row = ctx + gpt2_encoding.encode_ordinary(" " + ending)
        n_ending = len(row) - len(ctx)
        assert full[i, : len(row)].tolist() == row and not full[i, len(row):].any()  # right-padded with 0
        assert full_mask[i].tolist() == [len(ctx) <= t < len(row) for t in range(full.shape[1])]
        assert cut[i].tolist() == row[-12:]
        assert cut_mask[i].tolist() == [t >= 12 - n_ending for t in range(12)]


def _on_rank(rank: int, port: int, ckpt: Path, data_file: Path, out_dir: Path) -> None:
    """One of 2 gloo ranks (each its own node's local rank `rank`... as on one node: local rank = rank): evaluate
    25 examples, then load the data set through load_examples_distributed from a source that works and from one
    that does not, counting the downloads."""
    torch.set_num_threads(1)  # two processes share the cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    try:
        model = read_model(ckpt)
        results["acc"] = hellaswag.evaluate(model, hellaswag.load_examples(str(data_file), limit=25), "cpu",
                                            rank=rank, world_size=2)
        downloads, download = [], hellaswag.download
        hellaswag.download = lambda path: (downloads.append(path), download(path))
        hellaswag.CACHE_DIR, hellaswag.URL = out_dir / "cache", data_file.as_uri()
        results["examples"] = len(hellaswag.load_examples_distributed(None, 3, rank, torch.device("cpu")))
        hellaswag.CACHE_DIR, hellaswag.URL = out_dir / "empty_cache", (out_dir / "offline.jsonl").as_uri()
        try:
            hellaswag.load_examples_distributed(None, 3, rank, torch.device("cpu"))
        except UserError as e:
            results["offline_error"] = str(e)
        results["downloads"] = len(downloads)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, shared_data, tiny_ckpt) -> list[dict]:
    out = tmp_path_factory.mktemp("two_ranks")
    mp.spawn(_on_rank, args=(free_port(), tiny_ckpt, shared_data / VAL_FILE, out), nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_two_ranks_match_one_rank(two_ranks, shared_data, tiny_ckpt):
    # 25 examples: the ranks get 13 and 12, so an unequal split is covered.
    one_rank = hellaswag.evaluate(read_model(tiny_ckpt),
                                  hellaswag.load_examples(str(shared_data / VAL_FILE), limit=25), "cpu")
    assert [r["acc"] for r in two_ranks] == [one_rank, one_rank]


@pytest.mark.slow
def test_only_local_rank_0_downloads_and_without_network_every_rank_stops_with_one_paragraph(two_ranks):
    assert [r["downloads"] for r in two_ranks] == [2, 0]  # rank 0: the working source, then the offline one
    assert [r["examples"] for r in two_ranks] == [3, 3]  # rank 1 read what rank 0 downloaded
    rank0, rank1 = (r["offline_error"] for r in two_ranks)
    assert rank1 == rank0  # rank 1 did not try, but reports rank 0's reason
    assert rank0.startswith("rank 0 (local rank 0 of its node): could not download HellaSwag")
    assert "offline.jsonl" in rank0 and "seems to have no network" in rank0  # the reason: the URL that failed
    assert "--hellaswag_path" in rank0 and "--hellaswag_every 0" in rank0 and "\n" not in rank0


def test_without_network_the_download_is_a_user_error_naming_the_flags(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("Temporary failure in name resolution")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setattr(hellaswag, "CACHE_DIR", tmp_path / "cache")
    with pytest.raises(UserError, match=r"no network.*--hellaswag_path.*--hellaswag_every 0"):
        hellaswag.load_examples_distributed(None, 3, local_rank=0, device=torch.device("cpu"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


STOP_CHECK = "<should_stop called>"


def scored_by(rank: int, world_size: int, examples: list[dict], model: GPT, monkeypatch,
              should_stop=None) -> tuple[list[str], float | None]:
    """The contexts of the examples rank `rank` of world_size scores, in order, with STOP_CHECK wherever it called
    should_stop (the counts' all_reduce left out)."""
    events = []
    monkeypatch.setattr(hellaswag, "render_example", lambda example, *a: (events.append(example["ctx"]),
                                                                          RENDER_EXAMPLE(example, *a))[1])
    monkeypatch.setattr(hellaswag.dist, "all_reduce", lambda *args, **kwargs: None)
    spy = None if should_stop is None else lambda: (events.append(STOP_CHECK), should_stop())[1]
    acc = hellaswag.evaluate(model, examples, "cpu", rank=rank, world_size=world_size, should_stop=spy)
    return events, acc


def test_each_rank_scores_only_its_own_share_of_the_examples(shared_data, tiny_ckpt, monkeypatch):
    examples = hellaswag.load_examples(str(shared_data / VAL_FILE), limit=9)
    model = read_model(tiny_ckpt)
    rank0, _ = scored_by(0, 2, examples, model, monkeypatch)
    rank1, _ = scored_by(1, 2, examples, model, monkeypatch)
    assert rank0 == [e["ctx"] for e in examples[0::2]] and rank1 == [e["ctx"] for e in examples[1::2]]
    assert len(rank0) == 5 and len(rank1) == 4  # disjoint halves that together are all 9


def test_stop_checks_come_at_the_same_points_on_every_rank_and_a_stop_returns_none(shared_data, tiny_ckpt,
                                                                                    monkeypatch):
    every = hellaswag.STOP_CHECK_EVERY
    examples = hellaswag.load_examples(str(shared_data / VAL_FILE), limit=2 * every + 1)
    model = read_model(tiny_ckpt)
    for rank, share in ((0, every + 1), (1, every)):
        # Rank 1 has no example left when the check after `every` turns comes; it must still take part, or rank 0
        # would wait for it in the collective forever.
        events, acc = scored_by(rank, 2, examples, model, monkeypatch, should_stop=lambda: False)
        assert acc is not None and len(events) == share + 1
        assert [i for i, event in enumerate(events) if event == STOP_CHECK] == [every]  # after `every` examples
        events, acc = scored_by(rank, 2, examples, model, monkeypatch, should_stop=lambda: True)
        assert acc is None and events[-1] == STOP_CHECK and len(events) == every + 1  # stopped at the first check


def test_evaluate_restores_train_mode(shared_data, tiny_ckpt):
    model = read_model(tiny_ckpt).train()
    modes = []
    model.register_forward_hook(lambda module, args, output: modes.append(module.training))
    hellaswag.evaluate(model, hellaswag.load_examples(str(shared_data / VAL_FILE), limit=2), "cpu")
    assert modes == [False, False] and model.training


def test_load_examples_reads_a_local_file_and_honours_limit(shared_data):
    path = str(shared_data / VAL_FILE)
    first = hellaswag.load_examples(path, limit=7)
    assert len(first) == 7
    assert (first[0]["ind"], first[0]["label"], first[0]["ctx"]) == (24, 3, "A man is sitting on a roof. he")
    everything = hellaswag.load_examples(path)
    assert len(everything) == 10042 and everything[:7] == first


def test_missing_hellaswag_path_names_the_file(tmp_path, capsys):
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(UserError, match="nowhere.jsonl"):
        hellaswag.load_examples(str(missing))
    with pytest.raises(SystemExit):  # the CLI checks the data before loading any model
        tools.hellaswag.main(["--model", "gpt2", "--hellaswag_path", str(missing)])
    err = capsys.readouterr().err
    assert str(missing) in err and "--hellaswag_path" in err


GOOD_EXAMPLE = {"ind": 7, "ctx": "A man is sitting on a roof. he", "endings": ["a", "b", "c", "d"], "label": 3}


@pytest.mark.parametrize("line, problem", [
    (b'{"ctx": "A man", "endings": ', "not JSON (Expecting value at column 28)"),
    (b"\xff\xfe not text", "not UTF-8 text"),
    (json.dumps([1, 2]).encode(), "not a JSON object"),
    (json.dumps({k: v for k, v in GOOD_EXAMPLE.items() if k != "ctx"}).encode(), "no ctx"),
    (json.dumps({k: v for k, v in GOOD_EXAMPLE.items() if k != "label"}).encode(), "no label"),
    (json.dumps(GOOD_EXAMPLE | {"label": 4}).encode(), "label 4, not one of 0-3"),
    (json.dumps(GOOD_EXAMPLE | {"endings": ["a", "b", "c"]}).encode(), "3 endings, not 4"),
    (json.dumps(GOOD_EXAMPLE | {"endings": "abcd"}).encode(), "no endings"),
])
def test_a_line_that_is_no_hellaswag_example_is_an_error_naming_the_file_and_line(tmp_path, line, problem):
    path = tmp_path / "hellaswag.jsonl"
    path.write_bytes(json.dumps(GOOD_EXAMPLE).encode() + b"\n\n" + line + b"\n")
    with pytest.raises(UserError) as raised:
        hellaswag.load_examples(str(path))
    assert str(raised.value).startswith(f"{path}, line 3: {problem}")
    assert "--hellaswag_path" in str(raised.value) and "--hellaswag_every 0" in str(raised.value)
    assert hellaswag.load_examples(str(path), limit=1) == [GOOD_EXAMPLE]  # the lines before it are fine


def test_download_is_cached_and_checked(tmp_path, monkeypatch, shared_data):
    source = shared_data / VAL_FILE
    cache = tmp_path / "cache"
    monkeypatch.setattr(hellaswag, "CACHE_DIR", cache)
    monkeypatch.setattr(hellaswag, "URL", source.as_uri())  # urllib reads file:// URLs, so no network is needed
    assert len(hellaswag.load_examples(limit=3)) == 3
    assert [p.name for p in cache.iterdir()] == ["hellaswag_val.jsonl"]  # no temporary file left behind
    assert hashlib.sha256((cache / "hellaswag_val.jsonl").read_bytes()).hexdigest() == hellaswag.SHA256

    monkeypatch.setattr(hellaswag, "URL", (tmp_path / "gone.jsonl").as_uri())
    assert len(hellaswag.load_examples(limit=3)) == 3  # served from the cache, no second download

    (cache / "hellaswag_val.jsonl").unlink()
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"ctx": "not hellaswag"}\n')
    monkeypatch.setattr(hellaswag, "URL", wrong.as_uri())
    with pytest.raises(UserError, match="sha256"):
        hellaswag.load_examples()
    assert not any(cache.iterdir())


def test_cli_prints_the_accuracy_of_a_snapshot(shared_data, tiny_ckpt):
    data_file = shared_data / VAL_FILE
    result = subprocess.run([sys.executable, "-m", "tools.hellaswag", "--ckpt", str(tiny_ckpt), "--hellaswag_path",
                             str(data_file), "--limit", "8", "--device", "cpu"],
                            cwd=ROOT, capture_output=True, text=True, check=True)
    expected = hellaswag.evaluate(read_model(tiny_ckpt), hellaswag.load_examples(str(data_file), 8), "cpu")
    assert f"acc_norm {expected:.4f}" in result.stdout and "(8 examples)" in result.stdout
