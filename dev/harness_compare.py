"""evals.py against EleutherAI's lm-evaluation-harness 0.4.13 on the same weights and documents: every task's metrics
and every request's log-likelihood, side by side. The proof behind the README's "the harness's numbers".

    python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install -r requirements.txt "lm_eval[hf]==0.4.13"
    python -m tools.export_hf logs/quickstart/snapshot_0000149.pt /tmp/hf --tokenizer_dir ../shared/data/gpt2_tokenizer
    TIKTOKEN_CACHE_DIR=../shared/data/gpt2_tokenizer/tiktoken_cache /tmp/lmeval/bin/python -m dev.harness_compare \\
        --model /tmp/hf --eval_dir ../shared/data/evals tests/data/evals \\
        --hellaswag_path ../shared/data/hellaswag/hellaswag_val.jsonl --limit 500

The harness runs offline on the local files: each task is a YAML of its own that includes the installed harness's
task YAML and points dataset_path json at the file (as ../shared/data/README.md describes). Our side reads the same
Hugging Face directory with hf.from_pretrained. Both run in float32 on the CPU. Exit status 1 if a metric differs
by more than --tolerance (perplexity: its logarithm, i.e. relatively) or a request's text differs.
"""

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

from evaluation import tasks as evals
from training import hf


def task_files(eval_dirs: list[Path], hellaswag_path: Path | None) -> dict[str, Path]:
    """Each task whose file is found: hellaswag at --hellaswag_path, the others in the first --eval_dir holding it."""
    files = {"hellaswag": hellaswag_path} if hellaswag_path else {}
    for name in evals.TASKS:
        found = [d / f"{name}.jsonl" for d in eval_dirs if (d / f"{name}.jsonl").is_file()]
        if found and name not in files:
            files[name] = found[0]
    return files


# Where each task's YAML is in the installed harness.
HARNESS_YAML = {"hellaswag": "hellaswag/hellaswag.yaml", "lambada_openai": "lambada/lambada_openai.yaml",
                "piqa": "piqa/piqa.yaml", "winogrande": "winogrande/default.yaml", "arc_easy": "arc/arc_easy.yaml",
                "arc_challenge": "arc/arc_challenge.yaml", "openbookqa": "openbookqa/openbookqa.yaml",
                "sciq": "sciq/sciq.yaml", "copa": "super_glue/copa/default.yaml",
                "boolq": "super_glue/boolq/default.yaml"}


def write_task_yamls(files: dict[str, Path], directory: Path) -> None:
    import lm_eval
    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    for name, file in files.items():
        split = "test" if evals.TASKS[name].split == "test" else "validation"
        # training/fewshot splits off: zero-shot still builds few-shot docs from them otherwise (KeyError: 'train').
        (directory / f"{name}.yaml").write_text(
            f"include: {tasks_dir / HARNESS_YAML[name]}\ntask: {name}\ndataset_path: json\ndataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n    {split}: {file.resolve()}\ntraining_split: null\n"
            f"fewshot_split: null\nvalidation_split: {'validation' if split == 'validation' else 'null'}\n"
            f"test_split: {'test' if split == 'test' else 'null'}\n")


def run_harness(model_dir: Path, files: dict[str, Path], limit: int | None, batch_size: int) -> tuple[dict, dict]:
    """The harness's metrics {task: {metric: value}} and its requests {task: [(context, continuation,
    log-likelihood, greedy), ...]}, in document order."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    with tempfile.TemporaryDirectory() as directory:
        write_task_yamls(files, Path(directory))
        out = simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32", tasks=list(files),
                              num_fewshot=0, batch_size=batch_size, device="cpu", limit=limit, log_samples=True,
                              bootstrap_iters=0,
                              task_manager=TaskManager(include_path=directory, include_defaults=False))
    metrics = {name: {key.split(",")[0]: value for key, value in out["results"][name].items()
                      if key.endswith(",none") and "stderr" not in key} for name in files}
    requests = {}
    for name in files:
        samples = sorted(out["samples"][name], key=lambda sample: sample["doc_id"])
        requests[name] = [(*arguments[:2], *response) for sample in samples
                          for arguments, response in zip(sample["arguments"], sample["filtered_resps"], strict=True)]
    return metrics, requests


def run_ours(model_dir: Path, files: dict[str, Path], limit: int | None) -> tuple[dict, dict]:
    model = hf.from_pretrained(str(model_dir))
    docs = {name: evals.load_docs(name, file, limit) for name, file in files.items()}
    suite = evals.Suite(docs, model.config.block_size, batch_tokens=16384)
    results = evals.score(model, suite, "cpu", progress=True)
    flat = evals.metrics(docs, results)
    metrics = {name: {key.split("/")[1]: value for key, value in flat.items() if key.startswith(name + "/")}
               for name in files}
    requests, start = {}, 0
    for name, task_docs in docs.items():
        pairs = [pair for doc in task_docs for pair in doc.requests]
        requests[name] = [(*pair, *result) for pair, result in zip(pairs, results[start: start + len(pairs)])]
        start += len(pairs)
    return metrics | {"eval_score": flat["eval_score"]}, requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face GPT-2 directory (export_hf.py's)")
    parser.add_argument("--eval_dir", type=Path, nargs="+", default=[], help="directories of <task>.jsonl files")
    parser.add_argument("--hellaswag_path", type=Path, help="hellaswag_val.jsonl")
    parser.add_argument("--limit", type=int, help="the first N documents of each task, as the harness's --limit")
    parser.add_argument("--batch_size", type=int, default=16, help="the harness's batch size")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    files = task_files(args.eval_dir, args.hellaswag_path)
    print("tasks: " + ", ".join(f"{name} ({file})" for name, file in files.items()))

    start = time.perf_counter()
    ours, our_requests = run_ours(args.model, files, args.limit)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    theirs, their_requests = run_harness(args.model, files, args.limit, args.batch_size)
    theirs_s = time.perf_counter() - start

    print(f"\n{'task':<16}{'metric':<12}{'evals.py':>14}{'harness':>14}{'difference':>12}  requests: how many, "
          "max |Δ log-likelihood|, greedy flags that differ, texts that differ")
    worst, texts_differ = 0.0, 0
    for name in files:
        pairs = list(zip(our_requests[name], their_requests[name], strict=True))
        ll_diff = max(abs(ours_[2] - theirs_[2]) for ours_, theirs_ in pairs)
        greedy_diff = sum(ours_[3] != theirs_[3] for ours_, theirs_ in pairs)
        text_diff = sum(ours_[:2] != theirs_[:2] for ours_, theirs_ in pairs)
        texts_differ += text_diff
        for i, (metric, value) in enumerate(ours[name].items()):
            other = theirs[name][metric]
            diff = abs(math.log(value) - math.log(other)) if metric == "perplexity" else abs(value - other)
            worst = max(worst, diff)
            requests = f"  {len(pairs)}, {ll_diff:.2e}, {greedy_diff}, {text_diff}" if i == 0 else ""
            print(f"{name:<16}{metric:<12}{value:>14.6f}{other:>14.6f}{diff:>12.2e}{requests}")
    print(f"\neval_score (ours) {ours['eval_score']:.6f}; largest difference {worst:.2e} (tolerance "
          f"{args.tolerance:g}; perplexity compared as its log); requests whose texts differ: {texts_differ}; "
          f"evals.py {ours_s:.1f} s, harness {theirs_s:.1f} s")
    sys.exit(0 if worst <= args.tolerance and not texts_differ else 1)


if __name__ == "__main__":
    main()
