"""--parallel fsdp: 2 sharded ranks train like 1 process and like 2 DDP ranks, reduce-scatter only on the last
micro-step, hold half the state each, and their sharded snapshots survive a killed rank, resume on 1 process,
load into a plain GPT and are skipped when cut off mid-write."""

import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from conftest import copy_run, make_shards
from dataloader import DistributedDataLoader
from helpers_train import (
    RandomBatches,
    TrainRun,
    launched,
    main_in_process,
    on_ranks,
    read_metrics,
    records_so_far,
    run_train,
    wait_until,
    worker_pids,
)
from model import GPT, GPTConfig
from rundir import store
from rundir.snapshot import list_snapshots, load_snapshot, read_model, snapshot_path
from training import parallel
from training.config import TrainConfig
from training.distributed import Distributed, teardown_distributed
from training.errors import UserError
from training.parallel import build_training_model
from training.step import train_step

pytestmark = pytest.mark.slow  # torchrun and spawned process groups

TASKS = Path("/proc/self/task")  # one directory per thread of this process, on Linux
LAST_STEP = 7
JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "128", "--max_steps", str(LAST_STEP + 1),
       "--warmup_steps", "2", "--max_lr", "3e-3", "--dtype", "fp32", "--val_every", "2", "--val_tokens", "128",
       "--snapshot_every", "2", "--keep_last", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, TrainRun]:
    """The same 8 steps of 128 tokens: 1 process × 4 micro-steps, and 2 ranks × 2 micro-steps under ddp and fsdp."""
    root = tmp_path_factory.mktemp("fsdp")
    # Learnable tokens (the steps really differ), of the bytes tokenizer: a model 257 ids wide, not 50,257.
    make_shards(root / "data", "train", [2000], vocab=16, tokenizer="bytes")
    make_shards(root / "data", "val", [500], seed=1, vocab=16, tokenizer="bytes")
    args = [*JOB, "--data_dir", str(root / "data")]
    main_in_process([*args, "--log_dir", str(root / "one")])  # (in this process: no interpreter to start)
    runs = {"one": TrainRun(None, read_metrics(root / "one")), "ddp": run_train(args, root / "ddp", nproc=2),
            "fsdp": run_train([*args, "--parallel", "fsdp"], root / "fsdp", nproc=2)}
    runs["root"] = root
    return runs


def by_step(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def test_fsdp_on_two_ranks_trains_like_one_process_and_like_ddp(runs):
    one, ddp, fsdp = (by_step(runs[k].records, "loss") for k in ("one", "ddp", "fsdp"))
    assert sorted(fsdp) == list(range(LAST_STEP + 1)) and fsdp[LAST_STEP] < fsdp[0] - 0.5
    for step in fsdp:
        assert fsdp[step] == pytest.approx(one[step], rel=1e-5) and fsdp[step] == pytest.approx(ddp[step], rel=1e-5)
    norms = [by_step(runs[k].records, "grad_norm") for k in ("ddp", "fsdp")]
    # The global norm over all shards. torch sums the sharded norm in another order than DDP's foreach norm (4e-6
    # apart on the first step); clipping to it then moves the weights apart by about as much.
    assert all(norms[1][s] == pytest.approx(norms[0][s], rel=1e-3) for s in fsdp)
    val_ddp, val_fsdp = (by_step(runs[k].records, "val_loss") for k in ("ddp", "fsdp"))
    assert sorted(val_fsdp) == [0, 2, 4, 6, 7]
    assert all(val_fsdp[s] == pytest.approx(val_ddp[s], rel=1e-5) for s in val_fsdp)


def test_fsdp_snapshots_are_directories_of_shards_that_load_into_a_plain_gpt(runs):
    root = runs["root"]
    assert list_snapshots(root / "fsdp") == [snapshot_path(root / "fsdp", s, sharded=True) for s in (7, 5, 3, 1)]
    path = snapshot_path(root / "fsdp", 3, sharded=True)
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    # Validation at step 4 runs on the weights the snapshot of step 3 holds; the logged number is the mean of the
    # two ranks' 2 micro-batches each, i.e. of the first 4 micro-batches of the val stream.
    model = read_model(path).eval()
    val = DistributedDataLoader(root / "data", "val", B=2, T=16)
    with torch.no_grad():
        loss = sum(model(*val.next_batch())[1].item() for _ in range(4)) / 4
    assert loss == pytest.approx(by_step(runs["fsdp"].records, "val_loss")[4], rel=1e-5)


def test_a_two_rank_fsdp_snapshot_continues_on_one_process_with_the_same_losses(runs, tmp_path):
    root = runs["root"]
    copy_run(root / "fsdp", tmp_path, 3)
    main_in_process([*JOB, "--data_dir", str(root / "data"), "--parallel", "fsdp", "--log_dir", str(tmp_path)])
    resumed, whole = by_step(read_metrics(tmp_path), "loss"), by_step(runs["fsdp"].records, "loss")
    assert sorted(resumed) == [4, 5, 6, 7]
    assert all(resumed[s] == pytest.approx(whole[s], rel=1e-5) for s in resumed)


def test_a_killed_fsdp_rank_is_restarted_by_torchrun_and_the_job_finishes_with_the_uninterrupted_losses(runs,
                                                                                                      tmp_path):
    args = [*JOB, "--data_dir", str(runs["root"] / "data"), "--parallel", "fsdp"]
    with launched(args, tmp_path, nproc=2, launcher_args=["--max-restarts", "1"]) as proc:
        wait_until(lambda: list_snapshots(tmp_path), proc, tmp_path, "the first snapshot")
        os.kill(worker_pids(proc)[1], signal.SIGKILL)
        wait_until(lambda: any(r.get("event") == "resume" for r in records_so_far(tmp_path)), proc, tmp_path,
                   "the restart")
        assert proc.wait(timeout=180) == 0, (tmp_path / "output.txt").read_text()[-4000:]
    finished, whole = by_step(read_metrics(tmp_path), "loss"), by_step(runs["fsdp"].records, "loss")
    assert sorted(finished) == list(range(LAST_STEP + 1))
    assert all(finished[s] == pytest.approx(whole[s], rel=1e-5) for s in whole)


def test_a_snapshot_cut_off_mid_write_is_skipped_and_a_ddp_run_says_why_it_cannot_resume_one(runs, tmp_path):
    root = runs["root"]
    copy_run(root / "fsdp", tmp_path, 3, 5)
    cut = snapshot_path(tmp_path, 5, sharded=True)
    (cut / ".metadata").unlink()  # torch.distributed.checkpoint writes it last
    newest = store.first_loadable(store.survey(tmp_path), "here")
    path, state = newest.path, newest.state
    assert path == snapshot_path(tmp_path, 3, sharded=True) and state["step"] == 3
    with pytest.raises(ValueError, match=r"snapshot_0000005 could not be read"):
        load_snapshot(cut)

    run = run_train([*JOB, "--data_dir", str(root / "data")], tmp_path, check=False)  # --parallel ddp
    assert run.proc.returncode == 2
    assert "was written with --parallel fsdp (this run: ddp)" in run.proc.stderr
    assert "--init_from" in run.proc.stderr and "Traceback" not in run.output


# ----------------------------------------------------------------------------------------------------------------
# in two spawned gloo processes: the reduce-scatters and the bytes each rank holds

CONFIG = GPTConfig(block_size=16, vocab_size=128, n_layer=2, n_head=2, n_embd=32)


class Batches:
    """Micro-batches for train_step; records the reduce-scatters so far before handing out each one."""

    def __init__(self, rank: int, count: list[int]):
        generator = torch.Generator().manual_seed(rank)
        self.batches = [torch.randint(0, CONFIG.vocab_size, (2, 17), generator=generator) for _ in range(3)]
        self.count, self.seen = count, []

    def next_batch(self):
        self.seen.append(self.count[0])
        tokens = self.batches.pop()
        return tokens[:, :-1], tokens[:, 1:]


def local_bytes(tensors) -> int:
    return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for t in tensors)


def fsdp_worker(rank: int, store: str, out_dir: str) -> None:
    """One FSDP step of 3 micro-steps as train_step takes it ("gated"), then one of a fresh model by a train_step
    that never turns the sync off ("control"), in the same process group (not a second pair of processes)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(minutes=2))
    try:
        count, reduce = [0], _fsdp_param_group.foreach_reduce

        def counting_reduce(*args, **kwargs):
            count[0] += 1
            return reduce(*args, **kwargs)

        _fsdp_param_group.foreach_reduce = counting_reduce
        results = {}
        for name in ("gated", "control"):
            if name == "control":
                parallel.set_gradient_sync = lambda model, sync: None
                from training import step as training
                training.set_gradient_sync = parallel.set_gradient_sync
            count[0] = 0
            torch.manual_seed(0)
            trainee = build_training_model(GPT(CONFIG), Distributed(rank, rank, 2, torch.device("cpu")),
                                           torch.float32, TrainConfig(), compile=False, parallel="fsdp")
            batches = Batches(rank, count)
            train_step(trainee.model, trainee.optimizer, trainee.scaler, batches, 3, 1e-3, 1.0, torch.device("cpu"),
                       torch.float32)
            params = list(trainee.raw.parameters())
            moments = [v for opt in trainee.optimizer for s in opt.state.values() for k, v in s.items() if k != "step"]
            full = sum(p.numel() for p in params) * 4
            results[name] = {"reduces_before_micro_step": batches.seen, "reduces": count[0],
                             "params": local_bytes(params) / full, "grads": local_bytes(p.grad for p in params) / full,
                             "optimizer": local_bytes(moments) / (2 * full)}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        teardown_distributed()


def spawn_fsdp(tmp_path) -> list[dict]:
    mp.spawn(fsdp_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_reduce_scatters_happen_only_after_the_last_micro_step_and_each_rank_holds_half(tmp_path):
    groups = CONFIG.n_layer + 1  # one per Block, one for the root (embeddings, tied output layer, last LayerNorm)
    ranks = spawn_fsdp(tmp_path)
    for rank in (r["gated"] for r in ranks):
        assert rank["reduces_before_micro_step"] == [0, 0, 0] and rank["reduces"] == groups
        for kind in ("params", "grads", "optimizer"):
            assert 0.45 < rank[kind] < 0.55, (kind, rank[kind])  # half, give or take the shards' padding
    assert ranks[0]["control"]["reduces_before_micro_step"] == [0, groups, 2 * groups]  # the test above can fail


def threads_after_teardown(rank: int) -> list[str]:
    """This process's threads by name, once an FSDP step is done and, as at the end of train_gpt2.main, the model is
    gone and teardown_distributed has run."""
    trainee = build_training_model(GPT(CONFIG), Distributed(rank, rank, 2, torch.device("cpu")), torch.float32,
                                   TrainConfig(), compile=False, parallel="fsdp")
    train_step(trainee.model, trainee.optimizer, trainee.scaler, RandomBatches(rank, CONFIG.vocab_size), 2, 1e-3, 1.0,
               torch.device("cpu"), torch.float32)
    del trainee
    teardown_distributed()
    return [(TASKS / task / "comm").read_text().strip() for task in os.listdir(TASKS)]


@pytest.mark.skipif(not TASKS.is_dir(), reason="reads thread names from Linux's /proc")
def test_teardown_after_fsdp_ends_the_gloo_threads_so_none_is_left_to_abort_the_exit(tmp_path):
    # destroy_process_group alone left 'pt_gloo_runloop' ×2 and 'gloo_tcp_loop' running (DTensor's caches hold the
    # group), and 1 finished 2-rank FSDP run in ~100 aborted at exit on them.
    for rank, names in enumerate(on_ranks(threads_after_teardown, tmp_path)):
        assert names and not [name for name in names if "gloo" in name], (rank, names)


def test_fsdp_refuses_fp16_with_a_clear_error():
    with pytest.raises(UserError, match="--parallel fsdp with fp16 is not supported"):
        build_training_model(GPT(CONFIG), Distributed(0, 0, 1, torch.device("cpu")), torch.float16, TrainConfig(),
                             compile=False, parallel="fsdp")


def test_the_tools_read_an_fsdp_snapshot(runs, tmp_path, capsys):
    from tools import export_hf, sample

    path = snapshot_path(runs["root"] / "fsdp", 7, sharded=True)
    sample.main(["--snapshot", str(path), "--num_samples", "1", "--max_new_tokens", "4", "--device", "cpu"])
    assert "--- sample 0 ---" in capsys.readouterr().out
    export_hf.main([str(path), str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_sigterm_to_one_fsdp_rank_snapshots_the_shards_and_the_resume_continues_exactly(runs, tmp_path):
    args = [*JOB, "--data_dir", str(runs["root"] / "data"), "--parallel", "fsdp"]
    with launched([*args, "--snapshot_every", "100"], tmp_path, nproc=2) as proc:
        wait_until(lambda: by_step(records_so_far(tmp_path), "loss").keys() >= {2}, proc, tmp_path, "step 2")
        os.kill(worker_pids(proc)[1], signal.SIGTERM)  # rank 0, which renames the snapshot, learns by agreeing
        assert proc.wait(timeout=120) == 0, (tmp_path / "output.txt").read_text()[-4000:]
    stopped = max(by_step(read_metrics(tmp_path), "loss"))
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, stopped, sharded=True)]
    run = run_train(args, tmp_path, nproc=2)
    resume = max(i for i, r in enumerate(run.records) if r.get("event") == "resume")
    resumed, whole = by_step(run.records[resume:], "loss"), by_step(runs["fsdp"].records, "loss")
    assert min(resumed) == stopped + 1 and max(resumed) == LAST_STEP
    assert all(resumed[s] == pytest.approx(whole[s], rel=1e-5) for s in resumed)


def test_a_compiled_fsdp_run_trains_like_the_eager_one(runs, tmp_path):
    run = run_train([*JOB, "--data_dir", str(runs["root"] / "data"), "--parallel", "fsdp", "--compile"], tmp_path,
                    nproc=2, timeout=400)
    compiled, eager = by_step(run.records, "loss"), by_step(runs["fsdp"].records, "loss")
    assert sorted(compiled) == sorted(eager)
    assert all(compiled[s] == pytest.approx(eager[s], rel=1e-4) for s in eager)  # inductor's kernels, fp32


def test_a_flipped_byte_in_a_shard_file_is_found_and_the_older_fsdp_snapshot_used(runs, tmp_path, capsys):
    copy_run(runs["root"] / "fsdp", tmp_path, 3, 5)
    shard = max(snapshot_path(tmp_path, 5, True).glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(data)
    newest = store.first_loadable(store.survey(tmp_path), "here")
    path, state = newest.path, newest.state
    assert path == snapshot_path(tmp_path, 3, sharded=True) and state["step"] == 3
    assert f"{shard} is missing or its bytes changed since it was written" in capsys.readouterr().err


def test_a_failed_fsdp_snapshot_write_removes_its_directory_and_training_goes_on(runs, tmp_path, monkeypatch,
                                                                                 capsys):
    from rundir import snapshot
    real_crc32, calls = snapshot.file_crc32, []

    def eio_the_first_time(path):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        return real_crc32(path)

    monkeypatch.setattr(snapshot, "file_crc32", eio_the_first_time)
    main_in_process([*JOB, "--data_dir", str(runs["root"] / "data"), "--parallel", "fsdp", "--log_dir", str(tmp_path)])
    assert "WARNING: the snapshot of step 1 could not be written" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob("snapshot_*[0-9]")) == [f"snapshot_000000{s}" for s in (3, 5, 7)]
    finished, whole = by_step(read_metrics(tmp_path), "loss"), by_step(runs["one"].records, "loss")
    assert all(finished[s] == pytest.approx(whole[s], rel=1e-5) for s in whole)
