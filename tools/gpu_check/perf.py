"""gpu_check.py's perf stage (not a command; `--stage perf`, run on its own): issue 52's goal table in one process
and one budget (9 minutes on an H100 or H200), every row against build-nanogpt's full-logits step measured in the
same process. The rows, in the order they run (the most wanted first; a row that would not fit in the time left is
reported as not run, and the later ones that fit still run):

  vs_full_logits  ours against the full-logits baseline: GPT-2 124M, B=64 × 8 micro-steps (524,288 tokens a step),
                  T=1024, bf16, compiled, alternating: tokens/s, peak memory, MFU; and the attention kernel the
                  compiled step runs, named from a profile of it
  fp8_speed       the step with --fp8_head against the baseline
  fp8_val_loss    two short runs from the same seed on the same tokens, with and without --fp8_head: their val loss
  attention       the step with cuDNN's attention kernel put first: the kernel that ran, its tokens/s, and its losses
                  step by step against the default kernel's
  loss_memory     the loss alone (one micro-batch's final hidden states), compiled: its peak memory, loss and
                  gradients against eager's; and what Inductor's code for its chunk loop holds at once (written to
                  OUT/perf_inductor_inline_*.py; the candidate loops are dev/loss_schedules.py's)
  muon            the step with --optimizer muon against AdamW's
  modern          --arch modern's step against gpt2's, and where the kernels' time differs (by kind of kernel)
  compile_mode    the step compiled in max-autotune-no-cudagraphs, in a subprocess stopped at the stage's end

The data are --data_dir's shards (real text for the short runs: data/enwiki, say), else learnable random tokens.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from model import PRESETS
from tools.bench.loss import compare_with_full_logits
from tools.bench.loss_memory import buffers_alive, generated_code, loss_function, loss_inputs, measure_loss
from tools.bench.short_run import short_run
from tools.bench.step import Workload, make_workload, release_memory, time_config_or_skip
from tools.gpu_check.bench import bench_vs_full_logits
from tools.gpu_check.report import Report, Result, first_line, run_logged
from tools.gpu_check.scale import PerfGoal, Scale
from tools.gpu_check.train import write_synthetic_shards
from training.distributed import Distributed
from training.fp8 import fp8_head_problem
from training.memory import MiB
from training.precision import pick_dtype

STAGE = "perf"
WORKLOAD_OPTIONS = ("attention", "compile_mode")  # Workload's own fields, not TrainConfig's


@dataclass
class Perf:
    """What the rows share: the report, the scale, ours at the goal's shape, and the runs later rows compare with."""
    report: Report
    scale: Scale
    dist_env: Distributed
    data_dir: str
    flags: dict  # ours: the TrainConfig flags of the goal's step
    deadline: float  # time.perf_counter() at the end of the stage's budget
    details: dict = field(default_factory=dict)  # the raw numbers, for report.json
    compile_seconds: float = 0.0  # what compiling the step's graph anew takes: the scale's, then the first row's
    baseline: dict | None = None  # the full-logits baseline: tokens_per_sec and peak_memory_mib, medians of the rounds
    ours: dict | None = None  # ours, the last round's run

    @property
    def dtype(self) -> torch.dtype:
        return pick_dtype(self.scale.dtype, self.dist_env.device)

    @property
    def goal(self) -> PerfGoal | None:
        return self.scale.perf.goal

    def check(self, name: str, check: Callable[..., Result], *args) -> None:
        self.report.check(STAGE, f"{self.scale.model}: {name}", check, *args)

    def workload(self, grad_accum_steps: int | None = None, **changes) -> Workload:
        """Ours (the goal's step, the device kernels' times profiled), with these flags or Workload options changed."""
        options = {name: changes.pop(name) for name in WORKLOAD_OPTIONS if name in changes}
        return make_workload(self.dist_env, grad_accum_steps or self.scale.perf.step[1], kernel_table=True,
                             **options, **self.flags | changes)

    def time(self, work: Workload) -> dict:
        _, _, steps, warmup, _ = self.scale.perf.step
        return time_config_or_skip(work, self.data_dir, self.dtype, self.scale.compile, False, steps, warmup)


def perf_stage(report: Report, scale: Scale, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    device = torch.device(scale.device, 0) if scale.device == "cuda" else torch.device("cpu")
    micro_batch, _, _, _, _ = scale.perf.step
    short_batch, short_steps, _, _, val_tokens = scale.perf.short_run
    data_dir = args.data_dir
    if data_dir is None:  # learnable tokens, so that the losses fall and the short runs' val losses mean something
        data_dir = str(report.out / "perf_data")
        write_synthetic_shards(Path(data_dir), max(4 * 524_288, short_steps * short_batch * scale.seq_len) + 1,
                               val_tokens + scale.seq_len + 1)
    flags = {"model": scale.model, "seq_len": scale.seq_len, "micro_batch_size": micro_batch, "dtype": scale.dtype,
             "device": scale.device, "compile": scale.compile, "data_dir": data_dir}
    # The stage compiles GPT.forward in a dozen configurations (FP8, kernels, modern, new models), more
    # than torch.compile's default of 8 per function, past which it runs the function eagerly with only a warning.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    perf = Perf(report, scale, Distributed(0, 0, 1, device), data_dir, flags, started + scale.perf.seconds,
                compile_seconds=scale.perf.compile_seconds)
    report.details["perf"] = perf.details
    perf.details["row_seconds"] = row_seconds = {}
    for name, (title, row) in ROWS.items():
        compilations, seconds = scale.perf.row_costs.get(name, (0, 0))
        left, needs = perf.deadline - time.perf_counter(), compilations * perf.compile_seconds + seconds
        if needs > left:
            perf.check(title, out_of_time, left, needs, scale.perf.seconds)
            continue
        row_started = time.perf_counter()
        try:
            row(perf, title)
        except Exception as e:  # a row's own error is its FAIL (a check inside it may have reported it already)
            perf.check(title, lambda e=e: (f"{type(e).__name__}: {first_line(str(e))}", "no error", False))
        row_seconds[name] = round(time.perf_counter() - row_started, 1)
    perf.check("what each row took", rows_took, row_seconds, perf.compile_seconds)


def rows_took(row_seconds: dict[str, float], compile_seconds: float) -> Result:
    """Each row's seconds, for the next lease's budget (GPU_ROW_COSTS)."""
    return (", ".join(f"{name} {seconds:,.0f} s" for name, seconds in row_seconds.items())
            + f"; a compilation of the step {compile_seconds:,.0f} s", "reported", True)


def out_of_time(left: float, needs: float, budget: int) -> Result:
    return f"not run: {max(left, 0):,.0f} s of the stage's {budget} s left, and it takes about {needs:,.0f} s", "", None


# ----------------------------------------------------------------------------------------------------------------
# the rows

def vs_full_logits(perf: Perf, title: str) -> None:
    micro_batch, grad_accum_steps, steps, warmup, rounds = perf.scale.perf.step
    comparison = compare_with_full_logits(perf.workload(), perf.data_dir, perf.dtype, perf.scale.compile, steps,
                                          warmup, rounds, loss_alone=False) | {"micro_batch_size": micro_batch,
                                                                               "grad_accum_steps": grad_accum_steps}
    perf.details["vs_full_logits"] = comparison
    pairs = [(theirs, ours) for theirs, ours in comparison["rounds"] if "skipped" not in theirs | ours]
    if perf.scale.compile and pairs:  # the first round compiled both graphs anew (later ones are in Inductor's cache)
        perf.compile_seconds = max(run["warmup_seconds"] for run in pairs[0])
    if pairs:
        perf.baseline = {key: statistics.median(theirs[key] for theirs, _ in pairs)
                         for key in ("tokens_per_sec", "peak_memory_mib")}
        perf.ours = pairs[-1][1]
    goal = perf.goal
    perf.check(title, bench_vs_full_logits, comparison, (goal.speed, goal.memory, goal.mfu) if goal else None)
    perf.check("the attention kernel the compiled step runs", kernel_named, perf.ours)


def kernel_named(run: dict | None) -> Result:
    if run is None:
        return "not run: ours was not measured", "", None
    kernels = run["attention_kernels"]
    return (f"{', '.join(kernels) if kernels else 'none seen'} ({run['attention_choice']}; from the aten ops of a "
            "profiled warm-up step)", "one kernel, named", kernels is not None and len(kernels) == 1)


def fp8_speed(perf: Perf, title: str) -> None:
    problem = fp8_head_problem(perf.dist_env.device, perf.dtype)
    if problem:
        perf.check(title, lambda: (f"not run: --fp8_head: {problem}", "", None))
        return
    perf.details["fp8_head"] = run = perf.time(perf.workload(fp8_head=True))
    perf.check(title, against_baseline, run, perf.baseline, perf.ours, perf.goal.fp8_speed if perf.goal else None)


def against_baseline(run: dict, baseline: dict | None, ours: dict | None, floor: float | None) -> Result:
    """A variant of ours against the full-logits baseline (and ours): at least floor times its tokens/s."""
    if "skipped" in run:
        return run["skipped"], "fits and runs", False
    figure = (f"{run['tokens_per_sec']:,.0f} tokens/s, MFU {run['mfu']:.1%}, peak memory "
              f"{run['peak_memory_mib'] / 1024:,.1f} GiB")
    if baseline is None:
        return figure + " (no baseline measured)", "the baseline measured", floor is None
    ratio = run["tokens_per_sec"] / baseline["tokens_per_sec"]
    figure += f": {ratio:.3f}× the full-logits baseline's tokens/s, " + (
        f"{run['tokens_per_sec'] / ours['tokens_per_sec']:.3f}× ours" if ours else "ours not measured") + (
        f"; {run['peak_memory_mib'] / baseline['peak_memory_mib']:.2f}× the baseline's peak memory")
    if floor is None:
        return figure, "runs (not judged on a CPU)", True
    return figure, f"≥ {floor}× the baseline's tokens/s", ratio >= floor


def fp8_val_loss(perf: Perf, title: str) -> None:
    micro_batch, steps, max_lr, warmup_steps, val_tokens = perf.scale.perf.short_run
    problem = fp8_head_problem(perf.dist_env.device, perf.dtype)
    work = perf.workload(grad_accum_steps=1, micro_batch_size=micro_batch, max_steps=steps, max_lr=max_lr,
                         warmup_steps=warmup_steps, val_tokens=val_tokens)
    runs = {"bf16": short_run(work, perf.data_dir, perf.dtype, perf.scale.compile)}
    if problem is None:  # (the same seed, data order and schedule: only the output layer's matmuls differ)
        work = replace(work, cfg=replace(work.cfg, fp8_head=True))
        runs["fp8"] = short_run(work, perf.data_dir, perf.dtype, perf.scale.compile)
    perf.details["short_runs"] = runs
    perf.check(title, short_runs_compared, runs, problem, perf.goal)


def short_runs_compared(runs: dict, problem: str | None, goal: PerfGoal | None) -> Result:
    bf16 = runs["bf16"]
    trained = f"after {len(bf16['losses'])} steps of {bf16['tokens']:,} tokens"
    if "fp8" not in runs:
        return (f"bf16's val loss {bf16['val_loss']:.4f} {trained}; --fp8_head not run: {problem}", "", None)
    fp8 = runs["fp8"]
    difference = fp8["val_loss"] - bf16["val_loss"]
    figure = (f"val loss {fp8['val_loss']:.4f} with --fp8_head, {bf16['val_loss']:.4f} without ({difference:+.4f}), "
              f"{trained}, the same seed and tokens; training took {fp8['train_seconds']:.1f} s against "
              f"{bf16['train_seconds']:.1f} s (compilation included)")
    finite = all(math.isfinite(run["val_loss"]) for run in (fp8, bf16))
    if goal is None:
        return figure, "finite (not judged on a CPU)", finite
    return figure, f"within {goal.fp8_val_loss} of bf16's", finite and abs(difference) <= goal.fp8_val_loss


def attention(perf: Perf, title: str) -> None:
    perf.details["attention_cudnn"] = run = perf.time(perf.workload(attention="cudnn"))
    perf.check(title, kernel_against_default, run, perf.ours, perf.goal)


def kernel_against_default(run: dict, ours: dict | None, goal: PerfGoal | None) -> Result:
    """Another attention kernel's step against the default kernel's: the same losses within the tolerance (the
    same seed, data and steps); its speed is the finding, not judged."""
    if "skipped" in run:
        return run["skipped"], "fits and runs", False
    ran = ", ".join(run["attention_kernels"] or ["not profiled"])
    figure = f"ran {ran} ({run['attention_choice']}): {run['tokens_per_sec']:,.0f} tokens/s"
    if ours is None:
        return figure + " (the default's step not measured)", "the default's step measured", None
    difference = max(abs(a - b) for a, b in zip(run["losses"], ours["losses"]))
    tolerance = goal.kernel_losses if goal else PerfGoal.kernel_losses
    figure += (f", {run['tokens_per_sec'] / ours['tokens_per_sec']:.3f}× the default's "
               f"({', '.join(ours['attention_kernels'] or ['not profiled'])}); losses within {difference:.4f} of its, "
               f"over {len(run['losses'])} steps")
    return figure, f"losses within {tolerance} of the default kernel's step by step (the speed is the finding)", \
        difference <= tolerance


def loss_memory(perf: Perf, title: str) -> None:
    """The loss alone, eager and compiled: the same numbers, and what the compiled code holds at its peak."""
    device, dtype = perf.dist_env.device, perf.dtype
    config = PRESETS[perf.scale.model]
    tokens, chunk_tokens = perf.scale.perf.loss_memory
    inputs = loss_inputs(tokens, config.n_embd, config.padded_vocab_size, config.vocab_size, device)
    eager = measure_loss(loss_function(config.vocab_size, chunk_tokens, compile=False), inputs, dtype)
    loss_fn = loss_function(config.vocab_size, chunk_tokens, compile=True)
    codes = generated_code(loss_fn, *inputs, dtype)  # compiled here, with its code kept
    for i, code in enumerate(codes):
        (perf.report.out / f"perf_inductor_inline_{i}.py").write_text(code)
    compiled = measure_loss(loss_fn, inputs, dtype)
    perf.check(title, compiled_against_eager, compiled, eager)
    # (kept without the gradients, which would sit in the device's memory under the later rows' peaks)
    perf.details["loss_memory"] = {name: run | {"grads": None} for name, run in (("eager", eager),
                                                                                 ("compiled", compiled))}
    perf.check("Inductor's code of the inline loss", code_holds, codes, (chunk_tokens, config.padded_vocab_size),
               (config.padded_vocab_size, config.n_embd))
    del inputs, eager, compiled
    release_memory(device)


# Compiled against eager, the loss alone: Inductor fuses the gradient's expression in fp32 where eager rounds each op,
# and sums in other orders (bf16 keeps 8 bits: a relative 4e-3 a rounding); the peak within allocator noise of eager's.
LOSS_TOLERANCE, GRAD_TOLERANCE, PEAK_TOLERANCE = 1e-3, 2e-2, 1.05


def compiled_against_eager(measured: dict, eager: dict) -> Result:
    loss_error = abs(measured["loss"] - eager["loss"]) / abs(eager["loss"])
    grad_error = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                     for a, b in zip(measured["grads"], eager["grads"]))
    figure = (f"loss {loss_error:.1e} and gradients {grad_error:.1e} (relative) from eager's; {measured['ms']:,.1f} ms "
              f"a call against eager's {eager['ms']:,.1f}")
    numbers = loss_error <= LOSS_TOLERANCE and grad_error <= GRAD_TOLERANCE
    bound = f"loss within {LOSS_TOLERANCE:g}, gradients within {GRAD_TOLERANCE:g} of eager's"
    if measured["peak_bytes"] is None:
        return figure + " (peak memory: CUDA only)", bound, numbers
    ratio = measured["peak_bytes"] / eager["peak_bytes"]
    figure += (f"; peak {measured['peak_bytes'] / MiB:,.0f} MiB above the inputs, {ratio:.2f}× eager's "
               f"{eager['peak_bytes'] / MiB:,.0f}")
    return figure, bound + f"; peak ≤ {PEAK_TOLERANCE}× eager's", numbers and ratio <= PEAK_TOLERANCE


def code_holds(codes: list[str], logits_shape: tuple[int, int], product_shape: tuple[int, int]) -> Result:
    """How many chunks' logits (and weight-gradient products) the inline loop's generated code holds at once."""
    alive = [buffers_alive(code) for code in codes]
    logits = max((n for live in alive for (shape, _), n in live.most_alive.items() if shape == logits_shape),
                 default=0)
    products = {dtype: max(n for live in alive for (shape, d), n in live.most_alive.items()
                           if shape == product_shape and d == dtype)
                for dtype in sorted({d for live in alive for (shape, d) in live.most_alive if shape == product_shape})}
    figure = (f"at most {logits} buffers of a chunk's logits {logits_shape} alive at once; of the weight's shape "
              f"{product_shape} (its gradient's products, the fp32 sum, the cast weight): "
              + ", ".join(f"{n} in {dtype}" for dtype, n in products.items())
              + f"; the peak of its own buffers {max(live.peak_bytes for live in alive) / MiB:,.0f} MiB "
              f"({len(codes)} graphs)")
    return figure, "one chunk's at a time: its logits, and their gradient if not in place (≤ 2)", logits <= 2


def muon(perf: Perf, title: str) -> None:
    perf.details["muon"] = run = perf.time(perf.workload(optimizer="muon"))
    perf.check(title, muon_against_adamw, run, perf.ours, perf.goal)


def unmeasured(run: dict, ours: dict | None, alone: Callable[[], str], baseline: str) -> Result | None:
    """The row of a variant that did not run, or whose baseline (ours) was not measured; None when both ran."""
    if "skipped" in run:
        return run["skipped"], "fits and runs", False
    if ours is None:
        return f"{alone()} ({baseline} not measured)", f"{baseline} measured", None
    return None


def judged(figure: str, goal: PerfGoal | None, bound_and_verdict: Callable[[PerfGoal], tuple[str, bool]]) -> Result:
    """The row with its figure, judged against the goal on a GPU; on a CPU, which has none, it passes by running."""
    if goal is None:
        return figure, "runs (not judged on a CPU)", True
    return figure, *bound_and_verdict(goal)


def muon_against_adamw(run: dict, ours: dict | None, goal: PerfGoal | None) -> Result:
    if result := unmeasured(run, ours, lambda: f"{run['tokens_per_sec']:,.0f} tokens/s", "AdamW's step"):
        return result
    ratio = run["tokens_per_sec"] / ours["tokens_per_sec"]
    figure = (f"{run['tokens_per_sec']:,.0f} against {ours['tokens_per_sec']:,.0f} tokens/s: {ratio:.3f}×; the "
              f"optimizer's step {run['optimizer_ms']:,.1f} ms against {ours['optimizer_ms']:,.1f}")
    return judged(figure, goal, lambda goal: (f"≥ {goal.muon}× AdamW's tokens/s", ratio >= goal.muon))


def modern(perf: Perf, title: str) -> None:
    perf.details["modern"] = run = perf.time(perf.workload(arch="modern"))
    perf.check(title, modern_against_gpt2, run, perf.ours, perf.goal)
    perf.check("--arch modern's kernels against gpt2's", kernels_compared, run, perf.ours)


def modern_against_gpt2(run: dict, ours: dict | None, goal: PerfGoal | None) -> Result:
    if result := unmeasured(run, ours, lambda: f"{run['ms_per_step']:,.1f} ms/step", "gpt2's step"):
        return result
    ratio = run["ms_per_step"] / ours["ms_per_step"]
    figure = (f"{run['ms_per_step']:,.1f} against {ours['ms_per_step']:,.1f} ms/step: {ratio:.3f}×, MFU "
              f"{run['mfu']:.1%}, peak memory {run['peak_memory_mib'] / 1024:,.1f} GiB")
    return judged(figure, goal, lambda goal: (f"≤ {goal.modern}× gpt2's step", ratio <= goal.modern))


# A CUDA kernel's kind, from its name: attention's kernels (flash, cuDNN's, the memory-efficient one), the matmuls
# (cuBLAS's and CUTLASS's), Inductor's generated Triton kernels, and the rest (copies, the optimizer's, NCCL).
KERNEL_KINDS = (("attention", ("flash", "fmha", "sdpa", "attention", "cudnn")),
                ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "matmul", "sm90_", "sm80_")),
                ("Inductor's", ("triton",)))


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, markers in KERNEL_KINDS if any(m in lower for m in markers)), "other")


def kernels_compared(run: dict, ours: dict | None) -> Result:
    """Where modern's step spends its kernels' time against gpt2's (one profiled warm-up step each)."""
    if "skipped" in run or ours is None or "kernel_ms" not in run or "kernel_ms" not in ours:
        return "not run: needs both steps' CUDA kernel times", "", None
    kinds = {}
    for name, table in (("modern", run["kernel_ms"]), ("gpt2", ours["kernel_ms"])):
        kinds[name] = {}
        for kernel, ms in table.items():
            kinds[name][kernel_kind(kernel)] = kinds[name].get(kernel_kind(kernel), 0.0) + ms
    grown = sorted(((ms - ours["kernel_ms"].get(kernel, 0.0), kernel) for kernel, ms in run["kernel_ms"].items()),
                   reverse=True)[:3]
    figure = ("ms of kernels a step, modern against gpt2: " + ", ".join(
        f"{kind} {kinds['modern'].get(kind, 0.0):,.1f} vs {kinds['gpt2'].get(kind, 0.0):,.1f}"
        for kind in [kind for kind, _ in KERNEL_KINDS] + ["other"])
        + "; grown most: " + ", ".join(f"{kernel[:60]} {extra:+,.1f}" for extra, kernel in grown))
    return figure, "named (where the extra time goes)", True


def compile_mode(perf: Perf, title: str) -> None:
    micro_batch, grad_accum_steps, steps, warmup, _ = perf.scale.perf.step
    mode = perf.scale.perf.compile_mode
    command = [sys.executable, "-m", "tools.bench", "--model", perf.scale.model, "--seq_len", str(perf.scale.seq_len),
               "--micro_batch_size", str(micro_batch), "--grad_accum_steps", str(grad_accum_steps), "--dtype",
               perf.scale.dtype, "--device", perf.scale.device, "--steps", str(steps), "--warmup", str(warmup),
               "--data_dir", perf.data_dir, "--json"] + (["--compile", "--compile_mode", mode] if perf.scale.compile
                                                         else [])
    seconds = max(1.0, perf.deadline - time.perf_counter())
    returncode, output = run_logged(command, os.environ | {"PYTHONUNBUFFERED": "1"}, seconds,
                                    perf.report.out / "perf_compile_mode.txt")
    perf.check(f"{title} {mode}", compile_mode_against_default, returncode, output, seconds, perf.ours)


def compile_mode_against_default(returncode: int, output: str, seconds: float, ours: dict | None) -> Result:
    if returncode == -9:
        return f"not run to the end: stopped at the stage's end, after {seconds:,.0f} s", "", None
    report = next((json.loads(line) for line in output.splitlines() if line.startswith("{")), None)
    if returncode != 0 or report is None:
        return f"exit status {returncode}: {output.strip().splitlines()[-1][:200] if output.strip() else ''}", \
            "runs", False
    run = report["runs"][-1]
    figure = f"{run['tokens_per_sec']:,.0f} tokens/s, peak memory {run['peak_memory_mib'] / 1024:,.1f} GiB"
    if ours is not None:
        figure += f": {run['tokens_per_sec'] / ours['tokens_per_sec']:.3f}× the default mode's (another process)"
    return figure, "runs within the stage's time (the speed is the finding)", True


ROWS: dict[str, tuple[str, Callable[[Perf, str], None]]] = {
    "vs_full_logits": ("ours against the full-logits loss, issue 52's goal", vs_full_logits),
    "fp8_speed": ("--fp8_head against the full-logits loss", fp8_speed),
    "fp8_val_loss": ("--fp8_head's val loss after a short run", fp8_val_loss),
    "attention": ("cuDNN's attention kernel first, against the default", attention),
    "loss_memory": ("the loss alone compiled", loss_memory),
    "muon": ("--optimizer muon against adamw", muon),
    "modern": ("--arch modern against gpt2", modern),
    "compile_mode": ("compile mode", compile_mode),
}
