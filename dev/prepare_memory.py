"""Peak memory and tokens/s of data.prepare on large JSON-lines files made of copies of enwiki's documents, for the
writers of several commits (each's data/ package from `git archive`, run beside this checkout's dataloader and
training/) on a number of processes each. The figures are in docs/data.md, "Writing shards".

    TIKTOKEN_CACHE_DIR=../shared/data/gpt2_tokenizer/tiktoken_cache \\
        python -m dev.prepare_memory --copies 22 --runs main:1 HEAD:1 HEAD:2   # 1.0 GB: before, after on 1 and 2

Memory: /usr/bin/time -v's maximum resident set of the largest process, and the peak, over samples every 0.1 s, of
the summed resident sets (VmRSS in /proc/PID/status) of the process and all its descendants (the tokenizer workers).
The workers are forked, so a page they share with the main process counts once for each of them: the sum is an upper
bound. Its proportional set sizes (Pss in /proc/PID/smaps_rollup: a shared page split among its sharers) are summed
too, which is what the processes hold together. Inputs and shards go to --work_dir and are deleted after each run.
"""

import argparse
import gzip
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def process_tree(pid: int) -> list[int]:
    pids = [pid]
    for parent in pids:  # (grows as it goes: breadth first)
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                pids += map(int, children.read_text().split())
            except OSError:  # the process ended meanwhile
                pass
    return pids


def kilobytes(path: str, field: str) -> int:
    try:
        return int(re.search(rf"^{field}:\s+(\d+) kB", Path(path).read_text(), re.M).group(1))
    except (OSError, AttributeError):  # ended meanwhile
        return 0


def oom_killers_first_choice() -> None:
    """Out of memory (the earlier writer on a large input), the kernel kills the measured run, not a neighbour."""
    Path("/proc/self/oom_score_adj").write_text("1000")


def measure(command: list[str], cwd: Path, log: Path) -> dict:
    """Run command under /usr/bin/time -v, sampling its process tree's memory; its figures, in MB and tokens/s."""
    with open(log, "w") as output:
        process = subprocess.Popen(["/usr/bin/time", "-v", *command], cwd=cwd, stdout=output, stderr=output,
                                   env=os.environ | {"PYTHONPATH": str(ROOT)},  # (dataloader, training)
                                   preexec_fn=oom_killers_first_choice)
        peak_rss = peak_pss = 0
        start = time.time()
        while process.poll() is None:
            pids = process_tree(process.pid)[1:]  # (not time's own)
            peak_rss = max(peak_rss, sum(kilobytes(f"/proc/{pid}/status", "VmRSS") for pid in pids))
            peak_pss = max(peak_pss, sum(kilobytes(f"/proc/{pid}/smaps_rollup", "Pss") for pid in pids))
            time.sleep(0.1)
    text = log.read_text()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}); see {log}")
    summary = re.search(r"tokens ([\d,]+), ([\d.]+) s, ([\d,]+) tokens/s", text)
    return {"largest process (time -v)": int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)),
            "all processes, RSS": peak_rss, "all processes, PSS": peak_pss,
            "tokens": int(summary.group(1).replace(",", "")), "tokens/s": int(summary.group(3).replace(",", "")),
            "wall s": time.time() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, nargs="+", default=[22], help="copies of enwiki's 45.8 MB per input")
    parser.add_argument("--runs", nargs="+", default=["main:1", "HEAD:1", "HEAD:2"],
                        help="COMMIT:PROCESSES each, in this order (--num_proc is passed where PROCESSES > 1)")
    parser.add_argument("--enwiki", type=Path, default=ROOT.parent / "shared" / "data" / "enwiki" / "enwiki.jsonl.gz")
    parser.add_argument("--work_dir", type=Path, default=Path("/tmp/prepare_memory"))
    args = parser.parse_args()
    runs = [(commit, int(processes)) for commit, processes in (run.rsplit(":", 1) for run in args.runs)]
    for commit in {commit for commit, _ in runs}:  # its data/ first on sys.path: the working directory
        tree = args.work_dir / commit
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", commit, "data"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    with gzip.open(args.enwiki) as f:
        documents = f.read()
    print("| writer | input | processes | largest process | all processes, RSS | all processes, PSS | tokens | "
          "tokens/s | wall |\n|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for copies in args.copies:
        corpus = args.work_dir / f"enwiki_x{copies}.jsonl"
        with open(corpus, "wb") as f:
            for _ in range(copies):
                f.write(documents)
        size = f"{corpus.stat().st_size / 1e9:.2f} GB ({copies} × enwiki)"
        for commit, processes in runs:
            out = args.work_dir / "out"
            shutil.rmtree(out, ignore_errors=True)
            flags = ["--num_proc", str(processes)] if processes > 1 else []
            figures = measure([sys.executable, "-m", "data.prepare", "--input", str(corpus), "--output_dir", str(out),
                               *flags], args.work_dir / commit, args.work_dir / f"{commit}_{copies}_{processes}.log")
            shutil.rmtree(out)
            mb = [f"{figures[key] / 1024:,.0f} MB" for key in
                  ("largest process (time -v)", "all processes, RSS", "all processes, PSS")]
            print(f"| {commit} | {size} | {processes} | {' | '.join(mb)} | {figures['tokens']:,} | "
                  f"{figures['tokens/s'] / 1e6:.2f} M | {figures['wall s']:.0f} s |", flush=True)
        corpus.unlink()


if __name__ == "__main__":
    main()
