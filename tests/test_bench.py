"""tools/bench.py, and the speed options it measures: the benchmark's JSON, and torch.compile in a real training run."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, make_shards
from helpers_train import run_train, train_env
from model import GPT, PRESETS

RUN_KEYS = {"name", "dtype", "compile", "ms_per_step", "optimizer_ms", "tokens_per_sec", "tflops", "peak_tflops",
            "mfu", "peak_source", "peak_memory_mib", "warmup_peak_memory_mib", "data_wait", "loss", "losses",
            "warmup_seconds", "attention_choice", "attention_kernels"}
REPORT_KEYS = {"device", "world_size", "model", "n_layer", "n_head", "n_embd", "parameters", "micro_batch_size",
               "seq_len", "grad_accum_steps", "tokens_per_step", "flops_per_token", "runs", "speedup", "memory",
               "load_average", "cpu_count"}


@pytest.mark.slow  # a few seconds: keeps `-m 'not slow'` under 90 s
def test_bench_compare_prints_one_json_object_with_the_documented_keys():
    command = [sys.executable, "-m", "tools.bench", "--model", "tiny", "--device", "cpu", "--micro_batch_size",
               "2", "--seq_len", "16", "--steps", "2", "--warmup", "0", "--compare", "--dtype", "fp32", "--json"]
    proc = subprocess.run(command, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # the whole of stdout is the one object

    assert set(report) == REPORT_KEYS
    assert report["tokens_per_step"] == 2 * 16 and report["world_size"] == 1
    assert report["flops_per_token"] == GPT(PRESETS["tiny"]).flops_per_token(16)
    baseline, configured = report["runs"]
    assert baseline["dtype"] == "fp32" and not baseline["compile"]
    for run in report["runs"]:
        assert set(run) == RUN_KEYS
        assert run["tokens_per_sec"] == pytest.approx(32 / (run["ms_per_step"] / 1000))
        assert run["tflops"] == pytest.approx(report["flops_per_token"] * run["tokens_per_sec"] / 1e12)
        assert run["mfu"] == pytest.approx(run["tflops"] / run["peak_tflops"])
        assert 0 < run["mfu"] and 0 <= run["data_wait"] < 1 and run["peak_memory_mib"] > 0
        assert 0 < run["optimizer_ms"] < run["ms_per_step"]
        assert 10.0 < run["loss"] < 11.5  # about ln(50257) = 10.8 for an untrained model
    assert report["speedup"] == pytest.approx(configured["tokens_per_sec"] / baseline["tokens_per_sec"])


@pytest.mark.slow  # a few seconds
def test_bench_times_ours_against_the_full_logits_loss_and_generation_with_and_without_the_cache():
    command = [sys.executable, "-m", "tools.bench", "--model", "tiny", "--device", "cpu", "--micro_batch_size",
               "2", "--seq_len", "16", "--steps", "2", "--warmup", "0", "--vs_full_logits", "--rounds", "2",
               "--generation", "--new_tokens", "8", "--dtype", "fp32", "--json"]
    proc = subprocess.run(command, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    full_logits, generation = report["full_logits"], report["generation"]
    rounds = full_logits["rounds"]
    assert [[run["name"] for run in pair] for pair in rounds] == [["fp32 eager, full logits", "fp32 eager"]] * 2
    ratios = [ours["tokens_per_sec"] / theirs["tokens_per_sec"] for theirs, ours in rounds]
    assert full_logits["speed_ratio"] == pytest.approx(sum(ratios) / 2)  # the median of two
    assert full_logits["memory_ratio"] is None  # a CPU's peak resident memory never goes down
    assert full_logits["loss_ms"]["ours"] > 0 and full_logits["loss_ms"]["full_logits"] > 0
    # Timed apart from the step, the loss can take longer than the whole step on a busy CPU (1.46 was seen): a share,
    # not a bound.
    assert full_logits["loss_share"] > 0
    assert all(len(run["losses"]) == 2 for pair in rounds for run in pair)
    assert set(generation["tokens_per_sec"]) == {"with_cache", "without_cache"} and generation["same_tokens"]
    assert generation["speedup"] == pytest.approx(generation["tokens_per_sec"]["with_cache"]
                                                  / generation["tokens_per_sec"]["without_cache"])


def test_the_full_logits_baseline_is_cross_entropy_over_every_padded_column():
    from tools.bench.step import FullLogitsGPT

    torch.manual_seed(0)
    config = PRESETS["tiny"]
    baseline = FullLogitsGPT(config)
    idx = torch.randint(0, config.vocab_size, (2, 8))
    _, loss = baseline(idx, idx)
    hidden = {}
    baseline.transformer.ln_f.register_forward_hook(lambda module, args, out: hidden.setdefault("x", out))
    baseline(idx)
    logits = hidden["x"] @ baseline.lm_head.weight.t()  # 50,304 columns, as build-nanogpt's padded vocabulary
    assert logits.shape[-1] == config.padded_vocab_size
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()))


@pytest.mark.slow
def test_compiled_training_with_validation_and_sampling_matches_eager(tmp_path, gpt2_encoding):
    # The one torch.compile run of the suite (~1 min on 2 cores: inductor compiles the training and the
    # no-grad validation graphs). Sampling uses the uncompiled module; it must still run in the same process.
    # In fp32, within 1e-4 (inductor's kernels add in other orders than eager's, as in test_fsdp.py): bf16's roundings
    # needed 0.02, and its matmuls are emulated, slowly, on CPUs without bf16 arithmetic.
    make_shards(tmp_path / "data", "train", [4000])
    make_shards(tmp_path / "data", "val", [2000], seed=1)
    args = ["--data_dir", str(tmp_path / "data"), "--micro_batch_size", "2", "--seq_len", "16",
            "--total_batch_size", "64", "--max_steps", "4", "--warmup_steps", "2", "--val_every", "2",
            "--val_tokens", "64", "--sample_every", "2", "--dtype", "fp32", "--snapshot_every", "0"]
    eager = run_train(args, tmp_path / "eager")
    compiled = run_train([*args, "--compile"], tmp_path / "compiled", timeout=400)

    for run in (eager, compiled):
        assert [r["step"] for r in run.train] == [0, 1, 2, 3]
        assert [r["step"] for r in run.val] == [0, 2, 3]
        assert run.output.count("sample 2:") == 4  # four samples at step 2 (and at the last step)
    assert [r["loss"] for r in compiled.train] == pytest.approx([r["loss"] for r in eager.train], rel=1e-4)
    assert [r["val_loss"] for r in compiled.val] == pytest.approx([r["val_loss"] for r in eager.val], rel=1e-4)


@pytest.mark.slow  # over 3 s on two busy cores: keeps `-m 'not slow'` within a minute
def test_a_configuration_that_runs_out_of_memory_is_reported_and_the_rest_still_measured(monkeypatch, capsys):
    """On an 80 GB GPU the fp32 baseline at the CUDA defaults (B=64, T=1024) needs ~87 GiB."""
    from tools.bench import __main__ as bench
    from tools.bench import step as bench_step
    from training.distributed import Distributed

    real_time_config = bench_step.time_config

    def baseline_out_of_memory(work, data_dir, dtype, compile, plain, steps, warmup, full_logits=False):
        if plain:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.28 GiB")
        return real_time_config(work, data_dir, dtype, compile, plain, steps, warmup, full_logits)

    monkeypatch.setattr(bench_step, "time_config", baseline_out_of_memory)
    args = bench.parse_args(["--model", "tiny", "--device", "cpu", "--micro_batch_size", "2", "--seq_len", "16",
                             "--steps", "1", "--warmup", "0", "--compare", "--dtype", "fp32"])
    report = bench.benchmark(args, Distributed(0, 0, 1, torch.device("cpu")))
    baseline, configured = report["runs"]
    assert baseline["skipped"] == "out of memory at B=2, T=16: lower --micro_batch_size to measure it"
    assert configured["tokens_per_sec"] > 0 and report["speedup"] is None
    assert "going on with the rest" in capsys.readouterr().err
    assert "skipped: out of memory" in bench.format_report(report, args)


@pytest.mark.slow  # about 10 s: the activations of 1-, 2- and 6-layer models, three ways each
def test_the_memory_plans_numbers_agree_with_the_budget_memory_py_measures_on_the_whole_model():
    """bench.py --plan extrapolates the activations from 1- and 2-layer models; memory.py measures the whole one."""
    from model import GPTConfig
    from tools.bench import memory as bench_memory
    from training.memory import GiB, fixed_bytes, largest_micro_batch, measure_activation_bytes_per_sequence
    from training.recompute import ACTIVATION_CHECKPOINTING

    # The loss and the embedding count, too; a vocabulary of 8,192, not 50,257: the activations per sequence are the
    # same (the loss's chunk is fixed), and bf16's matmuls, which the plan measures in, are emulated on many CPUs.
    config = GPTConfig(block_size=128, vocab_size=8192, n_layer=6, n_head=4, n_embd=128)
    plan = bench_memory.memory_plan([0.25], torch.device("cpu"), {"six": config}, seq_len=128,
                                    total_batch_size=128 * 128)
    for mode in ACTIVATION_CHECKPOINTING:
        measured = measure_activation_bytes_per_sequence(config, 128, torch.bfloat16, activation_checkpointing=mode)
        planned = plan["activation_bytes_per_sequence"]["six"][mode]
        assert planned == pytest.approx(measured, rel=0.1)
        for cards in bench_memory.PLAN_CARDS:
            for parallel in ("ddp", "fsdp"):
                fixed = fixed_bytes(config, cards, parallel, torch.bfloat16)
                size = plan["micro_batch"]["0.25"]["six"][cards][f"{parallel} {mode}"]
                assert fixed + size * planned == pytest.approx(fixed + size * measured, rel=0.1)
                assert size == largest_micro_batch(GiB // 4, fixed, measured, 128 // cards).size
    table = bench_memory.format_plan(plan).splitlines()
    assert "| model | cards | ddp | ddp + blocks | ddp + selective | fsdp | fsdp + blocks | fsdp + selective |" in table
    sizes = plan["micro_batch"]["0.25"]["six"][1]
    assert f"| six | 1 | {sizes['ddp none']} | {sizes['ddp blocks']} |" in "\n".join(table)
    assert sizes["ddp blocks"] > sizes["ddp none"]  # (so the table says something)
