"""Zero-shot tasks scored as lm-evaluation-harness 0.4 scores them, so that the numbers are published tables' ones
(evaluate.py --tasks; in training --eval_tasks). The rules, eval_score and the data files: docs/evaluation.md."""

import hashlib
import json
import math
import re
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from training.distributed import any_rank
from training.errors import UserError
from training.files import atomic_write
from training.parsing import PARSE_ERRORS, parse_problem
from training.precision import autocast
from training.tokenizer import Tokenizer, tiktoken_tokenizer

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "data" / "evals"


# ----------------------------------------------------------------------------------------------------------------
# the tasks: each document as the harness's task YAML (and its utils.py) renders it

@dataclass(frozen=True)
class Doc:
    requests: tuple[tuple[str, str], ...]  # (context, continuation) pairs, one per choice (LAMBADA: one)
    gold: int  # the index of the right request
    choices: tuple[str, ...]  # what acc_norm divides by the length of (the harness's doc_to_choice)


def multiple_choice(context: str, choices: list[str], gold: int) -> Doc:
    return Doc(tuple((context, " " + choice) for choice in choices), gold, tuple(choices))


def hellaswag_text(text: str) -> str:
    """The harness's hellaswag preprocess: WikiHow's "[title]" and other bracketed artefacts removed."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag(row: dict) -> Doc:
    context = hellaswag_text(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
    return multiple_choice(context, [hellaswag_text(ending) for ending in row["endings"]], int(row["label"]))


def lambada(row: dict) -> Doc:
    *words, last = row["text"].split(" ")
    return Doc(((" ".join(words), " " + last),), 0, ())


def winogrande(row: dict) -> Doc:
    sentence = row["sentence"]
    blank = sentence.index("_")
    contexts = tuple(sentence[:blank] + row[option] for option in ("option1", "option2"))
    continuation = " " + sentence[blank + 1:].strip()
    return Doc(tuple((context, continuation) for context in contexts), {"1": 0, "2": 1}[row["answer"]], contexts)


def arc(row: dict) -> Doc:
    choices = row["choices"]
    return multiple_choice(f"Question: {row['question']}\nAnswer:", choices["text"],
                           choices["label"].index(row["answerKey"]))


def sciq(row: dict) -> Doc:
    choices = [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]]
    return multiple_choice(f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:", choices, 3)


def copa(row: dict) -> Doc:
    connector = {"cause": "because", "effect": "therefore"}[row["question"]]
    # The choices start with a space and the target delimiter adds another: the harness scores "  the sun rose."
    choices = [" " + choice[0].lower() + choice[1:] for choice in (row["choice1"], row["choice2"])]
    # Its gold is the right choice's text, looked up in the choices: the first of two equal ones.
    return multiple_choice(row["premise"].strip()[:-1] + f" {connector}", choices,
                           choices.index(choices[row["label"]]))


@dataclass(frozen=True)
class Url:
    url: str
    sha256: str


@dataclass(frozen=True)
class HubDataset:  # what the harness's task YAML loads: dataset_path and dataset_name (the split is the Task's)
    path: str
    name: str | None = None


@dataclass(frozen=True)
class Task:
    name: str
    split: str  # the split the harness scores, which the file holds
    source: Url | HubDataset
    fields: dict[str, type | tuple[type, ...]]  # what a line must hold
    to_doc: Callable[[dict], Doc]
    metrics: tuple[str, ...] = ("acc", "acc_norm")  # as the harness's metric_list


ARC_FIELDS = {"question": str, "choices": dict, "answerKey": str}
TASKS = {task.name: task for task in [
    Task("hellaswag", "validation",
         Url("https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl",
             "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"),
         {"activity_label": str, "ctx_a": str, "ctx_b": str, "endings": list, "label": (int, str)}, hellaswag),
    Task("lambada_openai", "test",
         Url("https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl",
             "4aa8d02cd17c719165fc8a7887fddd641f43fcafa4b1c806ca8abc31fabdb226"),
         {"text": str}, lambada, ("acc", "perplexity")),
    Task("piqa", "validation", HubDataset("baber/piqa"), {"goal": str, "sol1": str, "sol2": str, "label": int},
         lambda row: multiple_choice(f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], row["label"])),
    Task("winogrande", "validation", HubDataset("allenai/winogrande", "winogrande_xl"),
         {"sentence": str, "option1": str, "option2": str, "answer": str}, winogrande, ("acc",)),
    Task("arc_easy", "test", HubDataset("allenai/ai2_arc", "ARC-Easy"), ARC_FIELDS, arc),
    Task("arc_challenge", "test", HubDataset("allenai/ai2_arc", "ARC-Challenge"), ARC_FIELDS, arc),
    Task("openbookqa", "test", HubDataset("allenai/openbookqa", "main"),
         {"question_stem": str, "choices": dict, "answerKey": str},
         lambda row: multiple_choice(row["question_stem"], row["choices"]["text"],
                                     row["choices"]["label"].index(row["answerKey"].lstrip()))),
    Task("sciq", "test", HubDataset("allenai/sciq"), {"question": str, "support": str, "correct_answer": str,
                                                      "distractor1": str, "distractor2": str, "distractor3": str},
         sciq),
    Task("copa", "validation", HubDataset("aps/super_glue", "copa"),
         {"premise": str, "choice1": str, "choice2": str, "question": str, "label": int}, copa, ("acc",)),
    Task("boolq", "validation", HubDataset("aps/super_glue", "boolq"), {"passage": str, "question": str, "label": int},
         lambda row: multiple_choice(f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:", ["no", "yes"],
                                     row["label"]), ("acc",)),
]}


def parse_task_names(text: str, flag: str) -> list[str]:
    """"hellaswag,piqa" or "all" -> task names, checked."""
    names = list(TASKS) if text.strip() == "all" else [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TASKS]
    if unknown or not names:
        raise UserError(f"{flag} {text!r}: {'unknown task ' + ', '.join(unknown) if unknown else 'no task'}. Pass a "
                        f"comma-separated list of {', '.join(TASKS)}, or all.")
    return names


# ----------------------------------------------------------------------------------------------------------------
# the data files

def leave_out(name: str) -> str:
    return f"leave {name} out of --eval_tasks (evaluate.py: --tasks; --eval_every 0 turns them all off)"


def task_file(name: str, eval_dir: str | None) -> Path:
    return (DEFAULT_DIR if eval_dir is None else Path(eval_dir)) / f"{name}.jsonl"


def download(name: str, path: Path) -> None:
    """Write the task's file atomically (no half file after a crash or beside another node's); UserError on failure."""
    source = TASKS[name].source
    print(f"downloading {name} to {path}")
    try:
        if isinstance(source, Url):
            with urllib.request.urlopen(source.url, timeout=60) as response:
                data = response.read()
            if hashlib.sha256(data).hexdigest() != source.sha256:
                raise OSError(f"the file at {source.url} is not the expected one (sha256 mismatch)")
        else:
            import datasets
            rows = datasets.load_dataset(source.path, source.name, split=TASKS[name].split)
            data = b"".join(json.dumps(row).encode() + b"\n" for row in rows)
    except Exception as e:  # urllib and datasets raise many kinds: no network, no such dataset, HTTP errors
        where = source.url if isinstance(source, Url) else f"the Hugging Face dataset {source.path}"
        reason = (str(e).splitlines() or [""])[0]
        raise UserError(f"could not download {name} from {where} ({type(e).__name__}: {reason}). "
                        "On a node without network, run the same command on one that has (it downloads to "
                        f"{DEFAULT_DIR}), copy {path.name} over and pass its directory with --eval_dir; or "
                        f"{leave_out(name)}.") from e
    atomic_write(path, lambda f: f.write(data))


def load_docs(name: str, path: Path, limit: int | None = None) -> list[Doc]:
    """The task's documents in file order (the first `limit` if given), each line checked."""
    task = TASKS[name]
    the_file = f"{name}.jsonl (the harness's {task.split} split, one JSON document a line)"
    if not path.is_file():
        raise UserError(f"{name}: the data file {path} does not exist. Point --eval_dir at a directory holding "
                        f"{the_file}, leave --eval_dir out to download it to {DEFAULT_DIR}, or {leave_out(name)}.")
    docs = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if limit is not None and len(docs) == limit:
                break
            line = line.strip()
            if not line:
                continue
            try:
                docs.append(read_doc(line, task))
            except ValueError as e:
                fields = ", ".join(f"{key} ({kind_name(kind)})" for key, kind in task.fields.items())
                raise UserError(f"{path}, line {number}: {e}. A {name} document is a JSON object with {fields}, "
                                f"as in the harness's {task.split} split, one a line. Point --eval_dir at the "
                                f"directory of the right file, or leave --eval_dir out to download it, or "
                                f"{leave_out(name)}.") from None
    if not docs:
        raise UserError(f"{path} holds no {name} document. Point --eval_dir at a directory holding {the_file}, or "
                        f"{leave_out(name)}.")
    return docs


def read_doc(line: bytes, task: Task) -> Doc:
    """The line's document, or a ValueError saying what is wrong with it."""
    try:
        row = json.loads(line)
    except PARSE_ERRORS as e:
        raise ValueError(parse_problem(e)) from None
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    for key, kind in task.fields.items():
        if key not in row:
            raise ValueError(f"no field {key!r}")
        if not isinstance(row[key], kind) or isinstance(row[key], bool):
            raise ValueError(f"{key} is {type(row[key]).__name__}, not {kind_name(kind)}")
    try:
        doc = task.to_doc(row)
    except (KeyError, ValueError, IndexError, TypeError, AttributeError) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None
    if not 0 <= doc.gold < len(doc.requests):
        raise ValueError(f"the answer is choice {doc.gold}, but there are {len(doc.requests)}")
    return doc


def kind_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))


def load_tasks(names: list[str], eval_dir: str | None, limit: int | None,
               local_rank: int = 0, device: torch.device | str = "cpu") -> dict[str, list[Doc]]:
    """Each task's documents. A file missing from the default directory is downloaded first, by local rank 0 of
    each node; then all ranks agree on whether that worked, so that a failure is a UserError on every rank."""
    reason = None
    if eval_dir is None and local_rank == 0:
        try:
            for name in names:
                path = task_file(name, eval_dir)
                if not path.exists():
                    download(name, path)
        except UserError as e:
            reason = str(e)
    if any_rank(reason is not None, torch.device(device)):
        if not dist.is_initialized():
            raise UserError(reason)
        reasons = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, reason)  # only on failure: the reason is text, not a tensor
        rank, reason = next((r, text) for r, text in enumerate(reasons) if text is not None)
        raise UserError(f"rank {rank} (local rank 0 of its node): {reason}")
    return {name: load_docs(name, task_file(name, eval_dir), limit) for name in names}


# ----------------------------------------------------------------------------------------------------------------
# requests as tokens, in batches

@dataclass(frozen=True)
class Request:
    tokens: list[int]  # the model's input row
    targets: list[int]  # the continuation's tokens, predicted at the row's last len(targets) positions


def tokenize(encode: Callable[[str], tuple[int, ...]], eot: int, context: str, continuation: str,
             block_size: int) -> Request:
    """The harness's split of a request into tokens (its HFLM.loglikelihood, _encode_pair, _loglikelihood_tokens)."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation  # "Answer: " + "x" -> "Answer:" + " x"
    if context:
        context_tokens = encode(context)
        continuation_tokens = encode(context + continuation)[len(context_tokens):]
    else:  # EOT stands in for the empty context
        whole = encode(continuation)
        context_tokens, continuation_tokens = ((eot,), whole) if whole[0] != eot else (whole[:1], whole[1:])
    row = (context_tokens + continuation_tokens)[-(block_size + 1):][:-1]
    # A continuation longer than the context keeps its last block_size tokens (the harness stops at an assertion).
    return Request(list(row), list(continuation_tokens[-block_size:]))


class Suite:
    """The tasks' requests, tokenized (tokenizer None: GPT-2's), in batches of up to batch_tokens padded tokens, longest
    first. The batches depend on nothing else, so any number of ranks gives the same results, bit for bit."""

    def __init__(self, docs: dict[str, list[Doc]], block_size: int, batch_tokens: int,
                 tokenizer: Tokenizer | None = None):
        self.docs = docs
        tokenizer = tokenizer or tiktoken_tokenizer("gpt2")
        # allow_eot: "<|endoftext|>" in a text is the EOT token, as Hugging Face's tokenizer reads it.
        encode = lru_cache(maxsize=16)(lambda text: tuple(tokenizer.encode(text, allow_eot=True)))
        self.requests = [tokenize(encode, tokenizer.eot, context, continuation, block_size)
                         for task_docs in docs.values() for doc in task_docs for context, continuation in doc.requests]
        order = sorted(range(len(self.requests)), key=lambda i: -len(self.requests[i].tokens))
        self.batches: list[list[int]] = []
        while order:
            rows = max(1, batch_tokens // len(self.requests[order[0]].tokens))
            self.batches.append(order[:rows])
            order = order[rows:]


# ----------------------------------------------------------------------------------------------------------------
# scoring

# A stop check is a collective: every this many batches, so that SIGTERM during an evaluation is noticed in seconds.
STOP_CHECK_EVERY = 8
# Positions whose (vocabulary-wide) log-softmax is computed at once, so that memory stays bounded.
LOGIT_ROWS = 2048


def score_batch(model: torch.nn.Module, requests: list[Request], device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's summed log-likelihood of its targets (float32, as the harness's sum) and whether every target
    is the argmax; one forward pass over the right-padded rows, the LM head only at the target positions."""
    T = max(len(request.tokens) for request in requests)
    idx = torch.tensor([request.tokens + [0] * (T - len(request.tokens)) for request in requests])
    row = torch.tensor([i for i, request in enumerate(requests) for _ in request.targets], device=device)
    column = torch.tensor([len(request.tokens) - len(request.targets) + j
                           for request in requests for j in range(len(request.targets))], device=device)
    targets = torch.tensor([token for request in requests for token in request.targets], device=device)
    with autocast(device, dtype):
        hidden = model.hidden_states(idx.to(device))[row, column]  # (targets, n_embd)
        token_ll, hits = [], []
        for h, t in zip(hidden.split(LOGIT_ROWS), targets.split(LOGIT_ROWS)):
            logprobs = F.log_softmax(model.logits(h).float(), dim=-1)
            token_ll.append(logprobs.gather(1, t[:, None])[:, 0])
            hits.append(logprobs.argmax(dim=-1) == t)
    ll = torch.zeros(len(requests), device=device).index_add_(0, row, torch.cat(token_ll))
    misses = torch.zeros(len(requests), dtype=torch.long, device=device).index_add_(0, row, (~torch.cat(hits)).long())
    return ll, misses == 0


def evaluate(model: torch.nn.Module, suite: Suite, device: torch.device | str, dtype: torch.dtype = torch.float32,
             rank: int = 0, world_size: int = 1, progress: bool = False,
             should_stop: Callable[[], bool] | None = None) -> dict[str, float] | None:
    """{"<task>/<metric>": value, ..., "eval_score": the aggregate}, the same on every rank (see score)."""
    results = score(model, suite, device, dtype, rank, world_size, progress, should_stop)
    return None if results is None else metrics(suite.docs, results)


def score(model: torch.nn.Module, suite: Suite, device: torch.device | str, dtype: torch.dtype = torch.float32,
          rank: int = 0, world_size: int = 1, progress: bool = False,
          should_stop: Callable[[], bool] | None = None) -> list[tuple[float, float]] | None:
    """(log-likelihood, greedy 1/0) of every request, on every rank (rank r scores batches r, r + world_size, ...).
    should_stop, a collective, is called every STOP_CHECK_EVERY batches; True returns None at once."""
    device = torch.device(device)
    results = torch.zeros(len(suite.requests), 2, dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            # Every rank goes round the same number of times, so the stop checks happen at the same points.
            turns = math.ceil(len(suite.batches) / world_size)
            for turn in tqdm(range(turns), desc="evals", disable=not progress):
                if should_stop is not None and turn % STOP_CHECK_EVERY == 0 and turn > 0 and should_stop():
                    return None
                if turn * world_size + rank >= len(suite.batches):
                    continue
                batch = suite.batches[turn * world_size + rank]
                ll, greedy = score_batch(model, [suite.requests[i] for i in batch], device, dtype)
                results[batch] = torch.stack([ll.double(), greedy.double()], dim=1).cpu()
    finally:
        model.train(was_training)
    if world_size > 1:  # each request was scored on one rank, and is 0 on the others
        results = results.to(device)
        dist.all_reduce(results, op=dist.ReduceOp.SUM)
    return [tuple(result) for result in results.cpu().tolist()]


def metrics(docs: dict[str, list[Doc]], results: list[tuple[float, float]]) -> dict[str, float]:
    """Each task's metrics from its requests' (log-likelihood, greedy) results, in Suite.requests' order, and the
    aggregate: the mean of each task's accuracy centred on chance (docs/evaluation.md)."""
    out, centred = {}, []
    start = 0
    for name, task_docs in docs.items():
        task = TASKS[name]
        hits = {metric: 0.0 for metric in task.metrics}
        chance = 0.0
        for doc in task_docs:
            lls = np.array([ll for ll, _ in results[start: start + len(doc.requests)]])
            if "perplexity" in task.metrics:  # LAMBADA: one request
                hits["perplexity"] += lls[0]
                hits["acc"] += results[start][1]
            else:
                hits["acc"] += np.argmax(lls) == doc.gold
                if "acc_norm" in task.metrics:
                    hits["acc_norm"] += np.argmax(lls / np.array([float(len(c)) for c in doc.choices])) == doc.gold
                chance += 1 / len(doc.requests)
            start += len(doc.requests)
        n = len(task_docs)
        for metric, total in hits.items():
            out[f"{name}/{metric}"] = math.exp(-total / n) if metric == "perplexity" else float(total / n)
        main, chance = out[f"{name}/{'acc_norm' if 'acc_norm' in task.metrics else 'acc'}"], chance / n
        centred.append((main - chance) / (1 - chance))
    out["eval_score"] = sum(centred) / len(centred)
    return out
