"""evals.py: each task's prompts as the harness's task YAMLs write them, the context/continuation split and the
batched scoring against Hugging Face's tokenizer and model one request at a time, the metrics' arithmetic and tie
rule, 2 ranks against 1, stopping on request, and the data files (bad ones, downloads). The comparison with the
harness itself is tests/test_evals_harness.py (and dev/harness_compare.py)."""

import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evaluation import tasks as evals
from helpers_train import on_ranks
from model import GPT
from training.errors import UserError

FIXTURES = Path(__file__).resolve().parent / "data" / "evals"  # hand-made arc_easy, arc_challenge, sciq documents
SHARED_TASKS = ["hellaswag", "lambada_openai", "piqa", "winogrande", "openbookqa", "copa", "boolq"]


def shared_files(shared_data: Path) -> tuple[Path, Path]:
    return shared_data / "evals", shared_data / "hellaswag" / "hellaswag_val.jsonl"


def load_mixed_docs(shared_data: Path, limit: int) -> dict[str, list[evals.Doc]]:
    """The first `limit` documents of every task: the real files for 7 tasks, the fixtures for ARC and SciQ."""
    eval_dir, hellaswag_path = shared_files(shared_data)
    files = {name: evals.task_file(name, str(eval_dir)) for name in SHARED_TASKS} | {"hellaswag": hellaswag_path}
    docs = {name: evals.load_docs(name, path, limit) for name, path in files.items()}
    return docs | {name: evals.load_docs(name, FIXTURES / f"{name}.jsonl", limit)
                   for name in ("arc_easy", "arc_challenge", "sciq")}


# ----------------------------------------------------------------------------------------------------------------
# prompts: what the harness's YAMLs (and utils.py) render, zero-shot, with its target delimiter " "

ROWS = {
    "hellaswag": ({"activity_label": "Home and Garden",
                   "ctx_a": "[header] How to grow basil [title] Pick a sunny spot.",
                   "ctx_b": "MAKE sure  the soil drains", "endings": ["well. [step] Water daily.", " badly  "],
                   "label": "1"},
                  [("Home and Garden: How to grow basil. Pick a sunny spot. Make sure the soil drains",
                    " well. Water daily."),
                   ("Home and Garden: How to grow basil. Pick a sunny spot. Make sure the soil drains", " badly")],
                  1, ("well. Water daily.", "badly")),
    "lambada_openai": ({"text": "He opened the door and saw his old friend Tom"},
                       [("He opened the door and saw his old friend", " Tom")], 0, ()),
    "piqa": ({"goal": "Open a jar", "sol1": "Twist the lid.", "sol2": "Shake it.", "label": 0},
             [("Question: Open a jar\nAnswer:", " Twist the lid."), ("Question: Open a jar\nAnswer:", " Shake it.")],
             0, ("Twist the lid.", "Shake it.")),
    "winogrande": ({"sentence": "The cup broke the vase because _ was hard.", "option1": "the cup",
                    "option2": "the vase", "answer": "1"},
                   [("The cup broke the vase because the cup", " was hard."),
                    ("The cup broke the vase because the vase", " was hard.")],
                   0, ("The cup broke the vase because the cup", "The cup broke the vase because the vase")),
    "arc_easy": ({"question": "Which is a metal?", "choices": {"text": ["wood", "iron", "glass"],
                                                               "label": ["1", "2", "3"]}, "answerKey": "2"},
                 [("Question: Which is a metal?\nAnswer:", " wood"), ("Question: Which is a metal?\nAnswer:", " iron"),
                  ("Question: Which is a metal?\nAnswer:", " glass")], 1, ("wood", "iron", "glass")),
    "openbookqa": ({"id": "1", "question_stem": "The sun is a", "choices": {"text": ["star", "planet"],
                                                                             "label": ["A", "B"]}, "answerKey": " A"},
                   [("The sun is a", " star"), ("The sun is a", " planet")], 0, ("star", "planet")),
    "sciq": ({"question": "What melts ice?", "distractor1": "cold", "distractor2": "salt water", "distractor3": "dark",
              "correct_answer": "heat", "support": "\n Heat melts ice."},
             [("Heat melts ice.\nQuestion: What melts ice?\nAnswer:", " " + choice)
              for choice in ("cold", "salt water", "dark", "heat")], 3, ("cold", "salt water", "dark", "heat")),
    "copa": ({"premise": "The man turned on the faucet.", "choice1": "The toilet filled.", "choice2": "Water flowed.",
              "question": "effect", "idx": 0, "label": 1},
             [("The man turned on the faucet therefore", "  the toilet filled."),
              ("The man turned on the faucet therefore", "  water flowed.")], 1,
             (" the toilet filled.", " water flowed.")),
    "boolq": ({"question": "is the sky blue", "passage": "Sky -- The sky looks blue.", "idx": 0, "label": 1},
              [("Sky -- The sky looks blue.\nQuestion: is the sky blue?\nAnswer:", " no"),
               ("Sky -- The sky looks blue.\nQuestion: is the sky blue?\nAnswer:", " yes")], 1, ("no", "yes")),
}


@pytest.mark.parametrize("name", ROWS)
def test_each_task_renders_the_harness_prompt_choices_and_gold(name):
    row, requests, gold, choices = ROWS[name]
    doc = evals.TASKS[name].to_doc(row)
    assert doc == evals.Doc(tuple(requests), gold, choices)


def test_copa_cause_and_arc_challenge_use_their_own_words():
    copa = evals.copa({"premise": "The girl cried.", "choice1": "She fell.", "choice2": "She sang.",
                       "question": "cause", "label": 0})
    assert copa.requests[0] == ("The girl cried because", "  she fell.")
    assert evals.TASKS["arc_challenge"].to_doc == evals.TASKS["arc_easy"].to_doc  # the harness's include


# ----------------------------------------------------------------------------------------------------------------
# tokens, and the batched scoring, against Hugging Face's tokenizer and model

@pytest.fixture(scope="module")
def hf_model(tmp_path_factory, shared_data):
    """A random Hugging Face GPT-2 (block 64, weights moved far from init so that choices differ), its tokenizer
    from the offline GPT-2 files, and the same weights as our GPT."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from tools.export_hf import write_tokenizer
    from training.hf import from_pretrained
    directory = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=50257)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(directory)
    write_tokenizer(shared_data / "gpt2_tokenizer", directory, 64)
    return hf, AutoTokenizer.from_pretrained(directory), from_pretrained(str(directory))


def reference_request(tokenizer, context: str, continuation: str, block_size: int) -> tuple[list[int], list[int]]:
    """The harness's split, spelled out with Hugging Face's tokenizer."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if context:
        context_tokens = tokenizer.encode(context)
        continuation_tokens = tokenizer.encode(context + continuation)[len(context_tokens):]
    else:
        context_tokens, continuation_tokens = [50256], tokenizer.encode(continuation)
    return (context_tokens + continuation_tokens)[-(block_size + 1):][:-1], continuation_tokens


def test_context_continuation_split_moves_trailing_whitespace_uses_eot_and_cuts_from_the_left(hf_model,
                                                                                               gpt2_encoding):
    _, tokenizer, _ = hf_model

    def ours(context, continuation, block_size=64):
        request = evals.tokenize(lambda text: tuple(gpt2_encoding.encode(text, allowed_special="all")),
                                 gpt2_encoding.eot_token, context, continuation, block_size)
        return request.tokens, request.targets

    cases = [("Question: why?\nAnswer:", " because"), ("The answer is ", "42"), ("ends with a newline\n", "Next"),
             ("", " alone"), ("a <|endoftext|> inside", " text"), ("one two three four five six seven", " eight nine")]
    for context, continuation in cases:
        assert ours(context, continuation) == reference_request(tokenizer, context, continuation, 64)
    # "is " + "42": the space moves, so the continuation is " 42" (one token), not "42" after a dangling " ".
    assert ours("The answer is ", "42")[1] == tokenizer.encode(" 42")
    assert ours("", " alone")[0] == [50256]
    assert ours("a <|endoftext|> inside", "x")[0][:3] == [64, 220, 50256]  # "a", " ", EOT: as HF reads it
    tokens, targets = ours("one two three four five six seven", " eight nine", block_size=4)
    assert targets == tokenizer.encode(" eight nine") and tokens == tokenizer.encode(" five six seven eight")
    tokens, targets = ours("one", " two three four five six", block_size=3)  # longer than the context: its tail
    assert targets == tokenizer.encode(" four five six") and tokens == tokenizer.encode(" three four five")


@pytest.mark.slow  # ~4 s: 150 requests through Hugging Face one at a time
def test_log_likelihoods_greedy_flags_and_metrics_match_hugging_face_one_request_at_a_time(hf_model, shared_data):
    hf, tokenizer, ours = hf_model
    docs = load_mixed_docs(shared_data, limit=4)
    suite = evals.Suite(docs, block_size=64, batch_tokens=300)  # several batches, rows of different lengths in each
    assert len(suite.batches) > 5
    results = evals.score(ours, suite, "cpu")

    reference = []
    with torch.no_grad():
        for task_docs in docs.values():
            for doc in task_docs:
                for context, continuation in doc.requests:
                    row, targets = reference_request(tokenizer, context, continuation, 64)
                    logprobs = F.log_softmax(hf(torch.tensor([row])).logits[0, -len(targets):], dim=-1)
                    targets = torch.tensor(targets)
                    reference.append((logprobs[torch.arange(len(targets)), targets].sum().item(),
                                      float((logprobs.argmax(dim=-1) == targets).all())))
    assert len(results) == len(reference) == sum(len(d.requests) for task_docs in docs.values() for d in task_docs)
    np.testing.assert_allclose([r[0] for r in results], [r[0] for r in reference], atol=2e-4, rtol=1e-6)
    assert [r[1] for r in results] == [r[1] for r in reference]

    expected, start = {}, 0
    for name, task_docs in docs.items():
        correct, correct_norm = 0, 0
        for doc in task_docs:
            lls = np.array([ll for ll, _ in reference[start: start + len(doc.requests)]])
            start += len(doc.requests)
            correct += np.argmax(lls) == doc.gold
            correct_norm += np.argmax(lls / [len(c) for c in doc.choices]) == doc.gold if doc.choices else 0
        expected[name] = (correct / len(task_docs), correct_norm / len(task_docs))
    got = evals.metrics(docs, results)
    for name in ("hellaswag", "piqa", "arc_easy", "arc_challenge", "openbookqa", "sciq"):
        assert (got[f"{name}/acc"], got[f"{name}/acc_norm"]) == expected[name]
    for name in ("winogrande", "copa", "boolq"):
        assert got[f"{name}/acc"] == expected[name][0] and f"{name}/acc_norm" not in got
    lambada = reference[sum(len(d.requests) for d in docs["hellaswag"]):][:4]
    assert got["lambada_openai/perplexity"] == pytest.approx(math.exp(-np.mean([ll for ll, _ in lambada])), rel=1e-5)
    assert len({ll for ll, _ in reference}) > 100  # the model tells the requests apart


class NextTokenModel(torch.nn.Module):
    """A fake GPT whose every position predicts `its token + 1` with logit 10 (all others 0): exact log-likelihoods
    (10 - log(e^10 + V - 1) for the predicted token, -log(e^10 + V - 1) for any other) and greedy flags by design."""
    V = 50257

    def hidden_states(self, idx):
        return F.one_hot((idx + 1) % self.V, self.V).float()

    def logits(self, x):
        return 10 * x


def test_batched_scoring_sums_the_continuation_positions_of_padded_rows_and_flags_greedy_ones():
    hit, miss = 10 - math.log(math.exp(10) + NextTokenModel.V - 1), -math.log(math.exp(10) + NextTokenModel.V - 1)
    requests = [evals.Request([5, 6, 7], [7, 8]),  # 6->7, 7->8: both greedy
                evals.Request([1, 2, 3, 4, 5, 6], [9]),  # 6 predicts 7, not 9
                evals.Request([3], [4]),  # the shortest row: padded to 6
                evals.Request([1, 2, 9, 10], [2, 9, 11])]  # 2->3 (miss), 9->10 (miss), 10->11 (hit)
    ll, greedy = evals.score_batch(NextTokenModel(), requests, torch.device("cpu"), torch.float32)
    # Each target's log-probability is exact but for fp32's log-softmax: its sum of V exponentials, added in any
    # order, is off by at most (V - 1)·2^-24 of itself (each addition rounds by at most half an ulp of a partial sum,
    # which is at most the whole), so its log by as much, absolutely: 3.0e-3 for V = 50,257 (the kernel's order
    # decides how much: AVX2's 8 lanes were 3e-5 off, AVX-512's 16 nearer); 1e-5 more for exp's and log's own
    # roundings (ulps of numbers up to 11). A wrong position is 10 off.
    bound = torch.tensor([len(r.targets) for r in requests]) * ((NextTokenModel.V - 1) * 2**-24 + 1e-5)
    exact = torch.tensor([2 * hit, miss, hit, 2 * miss + hit])
    assert ((ll - exact).abs() <= bound).all(), (ll - exact).tolist()
    assert greedy.tolist() == [True, False, True, False]


def test_metrics_arithmetic_ties_go_to_the_first_choice_and_the_score_is_centred_on_chance():
    docs = {"piqa": [evals.Doc((("q", " a"), ("q", " bb")), 0, ("a", "bb")),
                     evals.Doc((("q", " a"), ("q", " bb")), 1, ("a", "bb")),
                     evals.Doc((("q", " aaaa"), ("q", " b")), 1, ("aaaa", "b"))],
            "lambada_openai": [evals.Doc((("x", " y"),), 0, ()), evals.Doc((("x", " z"),), 0, ())]}
    results = [(-2.0, 0), (-2.0, 0),  # a tie: choice 0, right for the first doc, wrong for the second
               (-3.0, 0), (-3.0, 0),
               (-4.0, 0), (-2.0, 0),  # acc: choice 1; acc_norm: -4/4 = -1 > -2/1, choice 0
               (-1.0, 1), (-3.0, 0)]  # LAMBADA: greedy once; mean log-likelihood -2
    got = evals.metrics(docs, results)
    assert got["piqa/acc"] == pytest.approx(2 / 3) and got["piqa/acc_norm"] == pytest.approx(1 / 3)
    assert got["lambada_openai/acc"] == 0.5 and got["lambada_openai/perplexity"] == pytest.approx(math.exp(2))
    # piqa: acc_norm 1/3 against chance 1/2 -> -1/3; LAMBADA: acc 1/2 against chance 0 -> 1/2
    assert got["eval_score"] == pytest.approx((-1 / 3 + 1 / 2) / 2)


def test_chance_is_the_mean_of_one_over_each_documents_choices(shared_data):
    docs = {"arc_easy": evals.load_docs("arc_easy", FIXTURES / "arc_easy.jsonl")}  # 4, 4, 3, 5 and 4 choices
    all_right = [(0.0 if i == doc.gold else -1.0, 0) for doc in docs["arc_easy"] for i in range(len(doc.requests))]
    assert evals.metrics(docs, all_right)["eval_score"] == 1.0
    chance = np.mean([1 / 4, 1 / 4, 1 / 3, 1 / 5, 1 / 4])
    none_right = [(0.0 if i != doc.gold else -1.0, 0) for doc in docs["arc_easy"] for i in range(len(doc.requests))]
    assert evals.metrics(docs, none_right)["eval_score"] == pytest.approx(-chance / (1 - chance))


def test_the_batching_does_not_change_the_numbers(shared_data):
    from conftest import perturb_
    from model import PRESETS
    torch.manual_seed(0)
    model = perturb_(GPT(PRESETS["tiny"]), 0.2)
    docs = load_mixed_docs(shared_data, limit=2)
    one_by_one = evals.score(model, evals.Suite(docs, 64, batch_tokens=1), "cpu")
    batched = evals.Suite(docs, 64, batch_tokens=4096)
    assert len(batched.batches) < 5
    np.testing.assert_allclose(evals.score(model, batched, "cpu"), one_by_one, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# ranks and stopping

def evaluate_and_download(rank: int, shared_data: str, out_dir: str) -> dict:
    """On one of 2 gloo ranks (local ranks 0 and 1 of one node): the suite on 2 ranks, then the default directory's
    files fetched from a source that works and from one that does not, counting the downloads."""
    from conftest import perturb_
    from model import PRESETS
    shared_data, out_dir = Path(shared_data), Path(out_dir)
    torch.manual_seed(0)
    model = perturb_(GPT(PRESETS["tiny"]), 0.2)
    suite = evals.Suite(load_mixed_docs(shared_data, limit=5), 64, batch_tokens=512)
    results = {"metrics": evals.evaluate(model, suite, "cpu", rank=rank, world_size=2)}
    downloads, download = [], evals.download
    evals.download = lambda name, path: (downloads.append(name), download(name, path))
    source = shared_data / "evals" / "copa.jsonl"
    evals.DEFAULT_DIR = out_dir / "cache"
    copa = evals.TASKS["copa"]
    sha256 = hashlib.sha256(source.read_bytes()).hexdigest()
    evals.TASKS["copa"] = replace(copa, source=evals.Url(source.as_uri(), sha256))
    results["docs"] = len(evals.load_tasks(["copa"], None, 3, rank)["copa"])
    evals.DEFAULT_DIR = out_dir / "empty_cache"
    evals.TASKS["copa"] = replace(copa, source=evals.Url((out_dir / "offline.jsonl").as_uri(), "0" * 64))
    try:
        evals.load_tasks(["copa"], None, 3, rank)
    except UserError as e:
        results["offline_error"] = str(e)
    return results | {"downloads": len(downloads)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, shared_data) -> list[dict]:
    out = tmp_path_factory.mktemp("two_ranks")
    return on_ranks(evaluate_and_download, out / "ranks", str(shared_data), str(out))


@pytest.mark.slow
def test_two_ranks_give_the_one_process_numbers_bit_for_bit(two_ranks, shared_data):
    from conftest import perturb_
    from model import PRESETS
    torch.manual_seed(0)
    suite = evals.Suite(load_mixed_docs(shared_data, limit=5), 64, batch_tokens=512)
    assert len(suite.batches) % 2 == 1  # one rank scores one batch more than the other
    one = evals.evaluate(perturb_(GPT(PRESETS["tiny"]), 0.2), suite, "cpu")
    assert [r["metrics"] for r in two_ranks] == [one, one]


@pytest.mark.slow
def test_only_local_rank_0_downloads_and_a_failure_stops_every_rank_with_its_reason(two_ranks):
    assert [r["downloads"] for r in two_ranks] == [2, 0]  # rank 0: the working source, then the offline one
    assert [r["docs"] for r in two_ranks] == [3, 3]  # rank 1 read what rank 0 downloaded
    rank0, rank1 = (r["offline_error"] for r in two_ranks)
    assert rank1 == rank0  # rank 1 did not try, but reports rank 0's reason
    assert rank0.startswith("rank 0 (local rank 0 of its node): could not download copa from file:")
    assert "offline.jsonl" in rank0 and "--eval_dir" in rank0 and "\n" not in rank0


def test_a_stop_request_ends_the_evaluation_within_a_few_batches_and_restores_train_mode(shared_data):
    from model import PRESETS
    model = GPT(PRESETS["tiny"]).train()
    suite = evals.Suite(load_mixed_docs(shared_data, limit=3), 64, batch_tokens=64)
    assert len(suite.batches) > 3 * evals.STOP_CHECK_EVERY
    checks = []
    assert evals.evaluate(model, suite, "cpu", should_stop=lambda: checks.append(1) or len(checks) == 2) is None
    assert len(checks) == 2 and model.training


# ----------------------------------------------------------------------------------------------------------------
# the data files

def test_limit_takes_the_first_documents_in_file_order(shared_data):
    eval_dir, _ = shared_files(shared_data)
    everything = evals.load_docs("piqa", eval_dir / "piqa.jsonl")
    assert len(everything) == 1838
    assert evals.load_docs("piqa", eval_dir / "piqa.jsonl", limit=7) == everything[:7]


def test_task_names_all_and_unknown():
    assert evals.parse_task_names("all", "--tasks") == list(evals.TASKS)
    assert evals.parse_task_names(" piqa, boolq ", "--tasks") == ["piqa", "boolq"]
    with pytest.raises(UserError, match=r"--tasks 'piqa,hellaswagg': unknown task hellaswagg\. Pass a comma-sep"):
        evals.parse_task_names("piqa,hellaswagg", "--tasks")


GOOD_PIQA = {"goal": "g", "sol1": "a", "sol2": "b", "label": 1}


@pytest.mark.parametrize("task, line, problem", [
    ("piqa", "{not json", "not valid JSON (column 2: Expecting property name enclosed in double quotes)"),
    ("piqa", b'{"goal": "caf\xe9"}', "not UTF-8 text (byte 0xe9 at offset 13)"),
    ("piqa", "[" * 100_000 + "]" * 100_000, "nested too deeply to be read"),  # json's RecursionError
    ("piqa", json.dumps(GOOD_PIQA)[:-1] + ', "n": ' + "9" * 5001 + "}",  # past Python's limit for parsing an int
     "not readable (Exceeds the limit (4300 digits) for integer string conversion: value has 5001 digits)"),
    ("piqa", "[1, 2]", "not a JSON object"),
    ("piqa", json.dumps({"goal": "g", "sol1": "a", "label": 0}), "no field 'sol2'"),
    ("piqa", json.dumps(GOOD_PIQA | {"label": "1"}), "label is str, not int"),
    ("piqa", json.dumps(GOOD_PIQA | {"label": 2}), "the answer is choice 2, but there are 2"),
    ("winogrande", json.dumps({"sentence": "no blank", "option1": "a", "option2": "b", "answer": "1"}),
     "ValueError: substring not found"),
    ("arc_easy", json.dumps({"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "E"}),
     "ValueError: 'E' is not in list"),
])
def test_a_line_that_is_no_document_of_the_task_names_the_file_line_and_fix(tmp_path, task, line, problem):
    path = tmp_path / f"{task}.jsonl"
    good = json.dumps(GOOD_PIQA) if task == "piqa" else (FIXTURES / "arc_easy.jsonl").read_text().splitlines()[0]
    path.write_bytes((good + "\n" if task != "winogrande" else "").encode() + (line if isinstance(line, bytes)
                                                                             else line.encode()) + b"\n")
    with pytest.raises(UserError) as raised:
        evals.load_docs(task, path)
    message = str(raised.value)
    number = 1 if task == "winogrande" else 2
    assert message.startswith(f"{path}, line {number}: {problem}")
    assert f". A {task} document is a JSON object" in message
    assert "--eval_dir" in message and f"leave {task} out of --eval_tasks (evaluate.py: --tasks" in message
    assert "\n" not in message


def test_a_missing_or_empty_file_names_it_and_the_fix(tmp_path):
    with pytest.raises(UserError, match=rf"piqa: the data file {tmp_path}/piqa.jsonl does not exist\. Point "
                                        "--eval_dir at a directory holding piqa.jsonl"):
        evals.load_tasks(["piqa"], str(tmp_path), None)
    (tmp_path / "copa.jsonl").write_text("\n")
    with pytest.raises(UserError, match=r"copa.jsonl holds no copa document"):
        evals.load_docs("copa", tmp_path / "copa.jsonl")


def test_missing_files_of_the_default_directory_are_downloaded_once_and_a_failure_is_one_paragraph(
        tmp_path, monkeypatch):
    import datasets
    lambada = tmp_path / "source" / "lambada_test.jsonl"
    lambada.parent.mkdir()
    lambada.write_text('{"text": "a b c"}\n{"text": "d e"}\n')
    monkeypatch.setattr(evals, "DEFAULT_DIR", tmp_path / "evals")
    task = evals.TASKS["lambada_openai"]
    sha256 = hashlib.sha256(lambada.read_bytes()).hexdigest()
    monkeypatch.setitem(evals.TASKS, "lambada_openai", replace(task, source=evals.Url(lambada.as_uri(), sha256)))
    loads = []
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name, split: loads.append((path, name, split)) or
                        [GOOD_PIQA, GOOD_PIQA | {"label": 0}])
    docs = evals.load_tasks(["lambada_openai", "piqa"], None, None)
    assert [len(docs["lambada_openai"]), len(docs["piqa"])] == [2, 2] and loads == [("baber/piqa", None, "validation")]
    assert sorted(p.name for p in (tmp_path / "evals").iterdir()) == ["lambada_openai.jsonl", "piqa.jsonl"]
    assert evals.load_tasks(["piqa"], None, 1)["piqa"] == docs["piqa"][:1] and len(loads) == 1  # cached

    (tmp_path / "evals" / "lambada_openai.jsonl").unlink()
    monkeypatch.setitem(evals.TASKS, "lambada_openai", replace(task, source=evals.Url(lambada.as_uri(), "0" * 64)))
    with pytest.raises(UserError, match=r"could not download lambada_openai from file:.*sha256 mismatch.*--eval_dir"):
        evals.load_tasks(["lambada_openai"], None, None)
    assert not (tmp_path / "evals" / "lambada_openai.jsonl").exists()  # nothing half-written is left

    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: (_ for _ in ()).throw(
        ConnectionError("no network")))
    with pytest.raises(UserError, match=r"could not download copa from the Hugging Face dataset aps/super_glue "
                                        r"\(ConnectionError: no network\)\. On a node without network"):
        evals.load_tasks(["copa"], None, None)
