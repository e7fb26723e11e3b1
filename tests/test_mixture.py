"""--data_mix and --anneal_mix: the mixture's chunks, its resume, its checks at the door, and whole runs (1 process
against 2 torchrun ranks, and a run SIGKILLed and resumed against an uninterrupted one)."""

import os
import signal
import subprocess
from dataclasses import replace
from functools import cached_property
from pathlib import Path

import numpy as np
import pytest
import torch
from test_resume import newest_snapshot_step

import train_gpt2
from conftest import make_document_shards, make_shards
from dataloader import DistributedDataLoader
from evaluation.validation import Validation, validation_record
from helpers_train import launched, read_metrics, records_so_far, run_train, train_command, train_env, wait_until
from training.config import TrainConfig, parse_args
from training.errors import UserError
from training.inputs import check_inputs, resolve_plan
from training.mixture import MixtureLoader, source_names
from training.run_logger import wandb_key

B, T = 2, 8


def source(directory: Path, rank: int = 0, world_size: int = 1, grad_accum_steps: int = 2, **kwargs):
    return DistributedDataLoader(directory, "train", B, T, rank, world_size, grad_accum_steps, seed=5, **kwargs)


def mixture(dirs, weights, rank=0, world_size=1, grad_accum_steps=2, anneal=None, anneal_step=None, **kwargs):
    sources = [source(d, rank, world_size, grad_accum_steps, **kwargs) for d in dirs]
    return MixtureLoader(sources, weights, anneal, anneal_step, seed=5)


def steps_of(loader, steps: int, micro_steps: int) -> list[torch.Tensor]:
    """Each micro-step's x, read ahead a step at a time as the training loop does."""
    batches = []
    for _ in range(steps):
        loader.read_ahead()
        batches += [loader.next_batch()[0] for _ in range(micro_steps)]
    return batches


@pytest.fixture
def two_sources(tmp_path) -> list[Path]:
    # 23 and 12 chunks: 5 and 3 steps' of 4 chunks, the 3 left over skipped
    make_shards(tmp_path / "a", "train", [23 * B * T + 1, 12 * B * T + 1], seed=0)
    make_shards(tmp_path / "b", "train", [4 * 4 * B * T + 1], seed=1)
    return [tmp_path / "a", tmp_path / "b"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_mixture_of_one_source_reads_the_plain_loaders_batches(two_sources, world_size):
    """Past shard and epoch boundaries, shuffled: the same chunks in the same order on every rank."""
    for rank in range(world_size):
        plain = source(two_sources[0], rank, world_size, 4 // world_size, shuffle=True)
        mixed = mixture(two_sources[:1], (1.0,), rank, world_size, 4 // world_size, shuffle=True)
        for a, b in zip(steps_of(plain, 20, 4 // world_size), steps_of(mixed, 20, 4 // world_size), strict=True):
            assert torch.equal(a, b)
        assert plain.epoch == mixed.sources[0].epoch == 2


@pytest.mark.parametrize("align_bos", [False, True])
def test_two_ranks_read_the_one_rank_mixtures_chunks_and_agree_on_its_position(two_sources, tmp_path, align_bos):
    if align_bos:  # documents, packed per source
        two_sources = [tmp_path / "docs_a", tmp_path / "docs_b"]
        make_document_shards(two_sources[0], "train", T + 1, [300, 200])
        make_document_shards(two_sources[1], "train", T + 1, [400], seed=1)
    one = mixture(two_sources, (0.7, 0.3), grad_accum_steps=4, shuffle=True, align_bos=align_bos)
    ranks = [mixture(two_sources, (0.7, 0.3), r, 2, 2, shuffle=True, align_bos=align_bos) for r in range(2)]
    one_batches = steps_of(one, 12, 4)
    rank_batches = [steps_of(rank, 12, 2) for rank in ranks]
    interleaved = [batch for pair in zip(*rank_batches) for batch in pair]  # micro-step m: rank 0's, then rank 1's
    assert all(torch.equal(a, b) for a, b in zip(one_batches, interleaved, strict=True))
    assert one.state_dict() == ranks[0].state_dict() == ranks[1].state_dict()
    assert one.tokens_by_source(12) == ranks[1].tokens_by_source(12)
    assert sum(one.tokens_by_source(12).values()) == 12 * 4 * B * T


def test_the_draws_follow_the_weights_and_switch_to_the_anneal_mix_at_its_step(two_sources):
    loader = mixture(two_sources, (0.75, 0.25), anneal=(0.0, 1.0), anneal_step=300)
    steps_of(loader, 300, 2)
    a, b = loader.tokens_by_source(300).values()
    assert a + b == 300 * 2 * B * T and abs(a / (a + b) - 0.75) < 0.03  # 600 draws: 3 standard deviations is 0.053
    steps_of(loader, 10, 2)
    assert loader.tokens_by_source(310) == {str(two_sources[0]): a, str(two_sources[1]): b + 10 * 2 * B * T}


def test_a_mixture_resumes_from_its_state_at_the_next_batch_even_read_ahead(two_sources):
    uninterrupted = steps_of(mixture(two_sources, (0.5, 0.5), shuffle=True), 14, 2)
    first = mixture(two_sources, (0.5, 0.5), shuffle=True)
    steps_of(first, 9, 2)
    first.read_ahead()  # (a snapshot between read_ahead and the step resumes at the step)
    resumed = mixture(two_sources, (0.5, 0.5), shuffle=True)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(steps_of(resumed, 5, 2), uninterrupted[18:], strict=True))


def test_a_state_of_other_sources_or_of_a_plain_run_is_refused_naming_them(two_sources):
    state = mixture(two_sources, (0.5, 0.5)).state_dict()
    with pytest.raises(UserError, match=r"trained on .*a, .*b, this one on the --data_mix sources .*b, .*a\. Name"):
        mixture(two_sources[::-1], (0.5, 0.5)).load_state_dict(state)
    with pytest.raises(UserError, match=r"trained on a --data_mix, this one on --data_dir .*a\. Pass its --data_mix"):
        source(two_sources[0]).load_state_dict(state)
    with pytest.raises(UserError, match=r"the --data_mix sources"):
        mixture(two_sources, (0.5, 0.5)).load_state_dict(source(two_sources[0]).state_dict())


def test_validation_keys_name_each_source_and_average_them():
    assert source_names(("x/enwiki", "y/enwiki", "z/shakespeare")) == {
        "x/enwiki": "x/enwiki", "y/enwiki": "y/enwiki", "z/shakespeare": "shakespeare"}
    assert validation_record({"a": Validation(2.0, 1.0)}) == {"val_loss": 2.0, "val_bpb": 1.0}
    assert validation_record({"a": Validation(2.0, 1.0), "b": Validation(4.0, None)}) == {
        "val_loss": 3.0, "val/a/loss": 2.0, "val/a/bpb": 1.0, "val/b/loss": 4.0}
    assert [wandb_key(k) for k in ("val_loss", "val/a/bpb", "hellaswag/acc")] == ["val/loss", "val/a/bpb",
                                                                                   "eval/hellaswag/acc"]


# ----------------------------------------------------------------------------------------------------------------
# the door: each bad input a UserError naming it, before any side effect

@pytest.fixture
def door(tmp_path, two_sources):
    for directory in two_sources:
        make_shards(directory, "val", [200], seed=2)
    make_shards(tmp_path / "bytes", "train", [1000], vocab=200, tokenizer="bytes")
    (tmp_path / "empty").mkdir()
    return tmp_path


@pytest.mark.parametrize("flags, message", [
    (["--data_mix", "{a}=0,{b}=1"], r"'{a}=0' is not DIR=WEIGHT with a positive number as its weight"),
    (["--data_mix", "{a}=x"], r"'{a}=x' is not DIR=WEIGHT"),
    (["--data_mix", "{a},{b}=1"], r"'{a}' is not DIR=WEIGHT"),
    (["--data_mix", "{a}=1,{b}=inf"], r"'{b}=inf' is not DIR=WEIGHT"),
    (["--data_mix", "{a}=1,{a}=2"], r"names {a} twice"),
    (["--data_mix", "{a}=1", "--data_dir", "{b}"], r"--data_mix '{a}=1' and --data_dir {b} both name the training"),
    (["--data_mix", "{a}=1", "--anneal_mix", "{b}=1"], r"this run has --lr_schedule cosine\. Pass --lr_schedule wsd"),
    (["--data_mix", "{a}=1", "--anneal_from", "3"], r"--anneal_from 3: there is no --anneal_mix to start then"),
    (["--data_mix", "{a}=1,{root}/missing=1"], r"data directory {root}/missing does not exist"),
    (["--data_mix", "{a}=1,{root}/empty=1"], r"no train shards .* in {root}/empty"),
    (["--data_mix", "{a}=1,{root}/bytes=1"], r"--data_mix: {a} holds shards of the tokenizer gpt2 .*, {root}/bytes of"),
    (["--data_mix", "{a}=1,{b}=1", "--total_batch_size", "4096"], r"test_train_000000.bin: shard has .* tokens, fewer"),
])
def test_a_bad_mixture_is_refused_at_the_door_naming_it_and_the_fix(door, flags, message):
    names = {"a": door / "a", "b": door / "b", "root": door}
    flags = [flag.format(**names) for flag in flags]
    with pytest.raises(UserError, match=message.format(**names)):
        check_inputs(parse_args(["--model", "tiny", "--device", "cpu", "--micro_batch_size", str(B), "--seq_len",
                                 str(T), "--total_batch_size", str(4 * B * T), "--eval_every", "0", *flags]))


def test_a_source_read_past_4_epochs_is_warned_of_at_the_start(door, capsys):
    cfg = parse_args(["--model", "tiny", "--micro_batch_size", str(B), "--seq_len", str(T), "--total_batch_size",
                      str(4 * B * T), "--max_steps", "40", "--data_mix", f"{door / 'a'}=3,{door / 'b'}=1"])
    plan = resolve_plan(cfg, world_size=1)
    train_gpt2.log_epochs(cfg, plan, mixture([door / "a", door / "b"], plan.weights, grad_accum_steps=4))
    out, err = capsys.readouterr()
    # a: 40 steps · 64 tokens · 3/4 over its 35 · 16 + 2 tokens; b: 40 · 64 / 4 over 4 · 64 + 1
    assert f"data: {door / 'a'}: 562 tokens, read 3.42 times by step 40\n" in out
    assert f"data: {door / 'b'}: 257 tokens, read 2.49 times" in out
    assert err == ""
    train_gpt2.log_epochs(replace(cfg, max_steps=60), plan, mixture([door / "a", door / "b"], plan.weights,
                                                                    grad_accum_steps=4))
    assert f"WARNING: {door / 'a'} is read 5.1 times: past about 4 epochs" in capsys.readouterr().err


def test_the_command_lines_data_flag_replaces_the_recipes_and_both_in_one_place_are_refused(tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('data_dir = "data/x"\nmax_steps = 7\n')
    cfg = parse_args(["--config", str(recipe), "--data_mix", "data/a=1,data/b=3"])
    assert (cfg.data_dir, cfg.data_mix, cfg.max_steps) == (TrainConfig.data_dir, "data/a=1,data/b=3", 7)
    assert cfg.mixture()[:2] == (("data/a", "data/b"), (0.25, 0.75))
    recipe.write_text('data_mix = "data/a=1"\n')
    replaced = parse_args(["--config", str(recipe), "--data_dir", "data/y"])
    assert (replaced.data_dir, replaced.data_mix) == ("data/y", "")
    recipe.write_text('data_mix = "data/a=1"\ndata_dir = "data/x"\n')
    with pytest.raises(UserError, match=r"--data_mix 'data/a=1' and --data_dir data/x both name the training data"):
        parse_args(["--config", str(recipe)])


@pytest.mark.slow  # over 3 s on two busy cores: keeps `-m 'not slow'` within a minute
def test_a_bad_mixture_exits_2_with_one_paragraph_and_writes_nothing(door):
    log_dir = door / "logs"
    proc = subprocess.run(train_command(["--data_mix", f"{door / 'a'}=1,{door / 'a'}=1", "--log_dir", str(log_dir)]),
                          env=train_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"names {door / 'a'} twice" in proc.stderr and not log_dir.exists()


# ----------------------------------------------------------------------------------------------------------------
# whole runs

LAST_STEP = 11
JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--max_steps", str(LAST_STEP + 1),
       "--warmup_steps", "3", "--val_every", "4", "--val_tokens", "64", "--dtype", "fp32", "--lr_schedule", "wsd",
       "--warmdown_frac", "0.25", "--align_bos"]


class Job:
    """A 12-step run on a mixture of two sources, annealed into a third from wsd's decay (step 9) on: one process
    (snapshots 3, 7, 11), and 2 torchrun ranks on first use. Source a's two shards of documents hold one step's
    chunks each, so it crosses shard and epoch boundaries."""

    def __init__(self, root: Path):
        self.root, dirs = root, [root / name for name in ("a", "b", "c")]
        for i, directory in enumerate(dirs):
            make_document_shards(directory, "train", 17, [130, 130] if i == 0 else [600], seed=i, vocab=200)
            make_shards(directory, "val", [200], seed=10 + i, vocab=200)
        self.args = [*JOB, "--data_mix", f"{dirs[0]}=2,{dirs[1]}=1", "--anneal_mix", f"{dirs[1]}=1,{dirs[2]}=3"]
        self.one_rank = run_train([*self.args, "--snapshot_every", "4", "--keep_last", "3"], root / "one")

    @cached_property
    def two_ranks(self):
        return run_train([*self.args, "--snapshot_every", "0"], self.root / "two", nproc=2)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Job:
    return Job(tmp_path_factory.mktemp("mixture"))


def steps(records: list[dict], key: str) -> dict[int, object]:
    return {r["step"]: r[key] for r in records if key in r}  # (a step logged again after a resume: its later line)


@pytest.mark.slow
def test_a_mixture_run_logs_its_sources_tokens_epochs_anneal_and_validations(job):
    run, root = job.one_rank, job.root
    assert f"data: {root / 'a'}: 260 tokens, read 1.48 times by step 12" in run.proc.stdout
    anneal = [r for r in run.records if r.get("event") == "anneal"]
    assert anneal == [{"event": "anneal", "step": 9, "data_mix": {str(root / "a"): 0.0, str(root / "b"): 0.25,
                                                                 str(root / "c"): 0.75}}]
    tokens = steps(run.records, "tokens_by_source")
    assert all(sum(tokens[s].values()) == 64 * (s + 1) for s in range(LAST_STEP + 1))
    assert tokens[8][str(root / "c")] == 0 and tokens[LAST_STEP][str(root / "a")] == tokens[8][str(root / "a")]
    assert steps(run.records, "epoch_by_source")[LAST_STEP][str(root / "a")] >= 1
    for name in "abc":
        assert set(steps(run.records, f"val/{name}/loss")) == {0, 4, 8, 11}
    val = [r for r in run.records if "val_loss" in r][-1]
    assert val["val_loss"] == pytest.approx(np.mean([val[f"val/{name}/loss"] for name in "abc"]))


@pytest.mark.slow
def test_two_ranks_train_the_mixture_like_one_process(job):
    one, two = job.one_rank.records, job.two_ranks.records
    assert steps(one, "tokens_by_source") == steps(two, "tokens_by_source")
    for key in ("loss", "val_loss", "val/c/bpb"):
        a, b = steps(one, key), steps(two, key)
        assert a and a.keys() == b.keys() and all(b[s] == pytest.approx(a[s], rel=1e-4) for s in a)


@pytest.mark.slow
def test_a_sigkilled_mixture_run_resumes_exactly(job, tmp_path):
    with launched([*job.args, "--snapshot_every", "3"], tmp_path, nproc=None) as proc:  # one plain process
        wait_until(lambda: newest_snapshot_step(tmp_path) >= 5, proc, tmp_path, "the snapshot of step 5")
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    killed_at = max(steps(records_so_far(tmp_path), "loss"))
    run = run_train(job.args, tmp_path)
    resume = [r for r in run.records if r.get("event") == "resume"]
    assert len(resume) == 1 and resume[0]["step"] in (6, 9) and resume[0]["step"] <= killed_at + 1
    reference = job.one_rank.records
    assert steps(run.records, "tokens_by_source") == steps(reference, "tokens_by_source")
    for key in ("loss", "val_loss"):
        got, expected = steps(read_metrics(tmp_path), key), steps(reference, key)
        assert got.keys() == expected.keys() and all(got[s] == pytest.approx(expected[s], rel=1e-6) for s in got)
