"""tools/evaluate.py: the numbers a training run logged for a snapshot (val loss and zero-shot tasks), the same on 2
ranks as on 1, OpenAI-style weights from a Hugging Face directory against Hugging Face's own
loss, and clear errors."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import ROOT, SHARED_DATA, make_shards, perturb_
from dataloader import DistributedDataLoader, write_shard
from helpers_train import main_in_process, read_metrics, train_env
from tools.evaluate import main
from training.errors import run_entry_point

HELLASWAG = SHARED_DATA / "hellaswag" / "hellaswag_val.jsonl"
# Validation and 2 tasks of 8 documents before every step, a snapshot after steps 1 and 3: a few seconds.
JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--max_steps", "4",
       "--warmup_steps", "1", "--val_every", "1", "--val_tokens", "128", "--dtype", "fp32", "--snapshot_every", "2",
       "--keep_last", "5", "--eval_every", "1", "--eval_tasks", "hellaswag,piqa", "--eval_limit", "8"]
TASK_KEYS = ["hellaswag/acc", "hellaswag/acc_norm", "piqa/acc", "piqa/acc_norm", "eval_score"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, gpt2_encoding):
    root = tmp_path_factory.mktemp("evaluate")
    make_shards(root / "data", "train", [400], seed=0)
    make_shards(root / "data", "val", [300], seed=1)
    (root / "other_vocabulary").mkdir()
    write_shard(root / "other_vocabulary" / "test_val_000000.bin", np.full(300, 50257))  # GPT-2's ids end at 50256
    (root / "evals").mkdir()  # the tasks' files, HellaSwag's as --eval_dir names it
    (root / "evals" / "hellaswag.jsonl").symlink_to(HELLASWAG)
    (root / "evals" / "piqa.jsonl").symlink_to(SHARED_DATA / "evals" / "piqa.jsonl")
    main_in_process([*JOB, "--data_dir", str(root / "data"), "--log_dir", str(root / "logs"), "--eval_dir",
                     str(root / "evals")])
    return root


def evaluate_json(argv: list[str], capsys) -> dict:
    capsys.readouterr()
    main([*argv, "--json", "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def logged(log_dir, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(log_dir) if key in r}


def test_a_snapshot_gets_the_val_loss_and_task_scores_its_run_logged_after_that_step(trained, capsys):
    result = evaluate_json(["--snapshot", str(trained / "logs" / "snapshot_0000001.pt"), "--tasks", "piqa,hellaswag"],
                           capsys)
    # snapshot_1 holds the weights after step 1; the run validated them before step 2's update.
    assert result["step"] == 1
    assert result["val_loss"] == logged(trained / "logs", "val_loss")[2]
    assert result["val_bpb"] == logged(trained / "logs", "val_bpb")[2] and result["val_bpb"] > 0
    assert result["val_loss"] != logged(trained / "logs", "val_loss")[1]  # the steps are told apart
    for key in TASK_KEYS:
        assert result[key] == logged(trained / "logs", key)[2], key
    assert result["val_tokens"] == 128 and result["hellaswag/docs"] == result["piqa/docs"] == 8  # the run's flags


@pytest.mark.slow  # torchrun with 2 processes
def test_two_ranks_under_torchrun_give_the_numbers_of_one_process(trained, capsys):
    argv = ["--snapshot", str(trained / "logs" / "snapshot_0000001.pt"), "--tasks", "hellaswag,piqa", "--limit", "7"]
    one = evaluate_json(argv, capsys)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "tools.evaluate", *argv, "--json", "--device", "cpu"], capture_output=True,
                          text=True, timeout=120, env=train_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(proc.stdout.strip())  # one JSON line: only rank 0 prints
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)
    assert one["val_loss"] == logged(trained / "logs", "val_loss")[2]
    assert two["val_bpb"] == pytest.approx(one["val_bpb"], rel=1e-6)
    assert {k: v for k, v in two.items() if k not in ("val_loss", "val_bpb")} == \
        {k: v for k, v in one.items() if k not in ("val_loss", "val_bpb")}
    assert two["hellaswag/docs"] == 7 and two["piqa/acc_norm"] == one["piqa/acc_norm"]  # the tasks: bit for bit


def test_hugging_face_weights_get_hugging_faces_own_loss(tmp_path, capsys, shared_data):  # (the shared copa)
    torch.manual_seed(0)
    hf = perturb_(GPT2LMHeadModel(GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=2)).eval(), 0.1)
    hf.save_pretrained(tmp_path / "hf")
    make_shards(tmp_path / "data", "val", [200], seed=2)
    result = evaluate_json(["--model", str(tmp_path / "hf"), "--data_dir", str(tmp_path / "data"),
                            "--micro_batch_size", "2", "--seq_len", "16", "--val_tokens", "96", "--tasks", "copa",
                            "--limit", "5", "--dtype", "fp32", "--eval_dir", str(SHARED_DATA / "evals")], capsys)
    loader = DistributedDataLoader(tmp_path / "data", "val", 2, 16)
    with torch.no_grad():
        losses = [F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()) for x, y in
                  (loader.next_batch() for _ in range(3))]
    assert result["val_tokens"] == 96 and result["step"] is None
    assert result["val_loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)
    from evaluation import tasks as evals
    from training import hf as hf_weights
    suite = evals.Suite({"copa": evals.load_docs("copa", SHARED_DATA / "evals" / "copa.jsonl", 5)}, 32, 32)
    ours = hf_weights.from_pretrained(str(tmp_path / "hf"))
    assert result["copa/acc"] == evals.evaluate(ours, suite, "cpu")["copa/acc"]


@pytest.mark.parametrize("argv, message", [
    (["--snapshot", "missing.pt"], "--snapshot: snapshot missing.pt: no such file"),
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--seq_len", "128"],
     "--seq_len 128 exceeds the model's block_size 64"),
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--data_dir", "{logs}"], "no val shards"),
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--data_dir", "{logs}/nowhere"], "nowhere does not exist"),
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--micro_batch_size", "64"], "fewer than one optimizer step needs"),
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--tasks", "hellaswag", "--eval_dir", "{logs}"],
     "hellaswag: the data file {logs}/hellaswag.jsonl does not exist"),
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--tasks", "piqa,nope"], "--tasks 'piqa,nope': unknown task nope"),
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--tasks", "piqa", "--eval_dir", "{logs}/.."],
     "piqa: the data file {logs}/../piqa.jsonl does not exist"),
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--tasks", "copa", "--eval_dir", "{logs}/../bad_evals"],
     "bad_evals/copa.jsonl, line 2: no field 'choice2'"),
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--tasks", "copa", "--limit", "0"], "--limit 0: the number of"),
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--data_dir", "{logs}/../other_vocabulary"],
     "test_val_000000.bin: token id 50257 at position 0 is not in the model's vocabulary"),
    # Flags outside their ranges (config.FLAG_RANGES): tracebacks before
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--val_tokens", "0"], "--val_tokens 0: pass a number at least 1"),
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--micro_batch_size", "0"], "--micro_batch_size 0: pass a number at "
                                                                          "least 1"),
    (["--snapshot", "{logs}/snapshot_0000001.pt", "--seq_len", "-4"], "--seq_len -4: pass a number at least 1"),
])
def test_bad_paths_and_mismatched_shards_are_clear_errors(trained, argv, message, capsys):
    argv, message = [a.format(logs=trained / "logs") for a in argv], message.format(logs=trained / "logs")
    (trained / "bad_evals").mkdir(exist_ok=True)
    copa = {"premise": "It rained.", "choice1": "We got wet.", "choice2": "We sang.", "question": "effect", "label": 0}
    no_choice2 = {key: value for key, value in copa.items() if key != "choice2"}
    (trained / "bad_evals" / "copa.jsonl").write_text(json.dumps(copa) + "\n" + json.dumps(no_choice2) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        run_entry_point(lambda: main([*argv, "--device", "cpu"]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


@pytest.mark.slow  # a few seconds: keeps `-m 'not slow'` under 90 s
def test_an_fsdp_snapshot_directory_gets_the_val_loss_and_task_scores_its_run_logged(trained, tmp_path, capsys):
    fsdp_job = [*JOB, "--max_steps", "2", "--snapshot_every", "1", "--eval_tasks", "piqa", "--parallel", "fsdp"]
    main_in_process([*fsdp_job, "--data_dir", str(trained / "data"), "--log_dir", str(tmp_path), "--eval_dir",
                     str(trained / "evals")])
    result = evaluate_json(["--snapshot", str(tmp_path / "snapshot_0000000"), "--tasks", "piqa"], capsys)
    assert result["step"] == 0
    assert result["val_loss"] == pytest.approx(logged(tmp_path, "val_loss")[1], rel=1e-6)
    assert result["piqa/acc_norm"] == logged(tmp_path, "piqa/acc_norm")[1] and result["piqa/docs"] == 8
