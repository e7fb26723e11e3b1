"""evals.py against lm-evaluation-harness 0.4.13 itself (dev/harness_compare.py's two runs) on a random GPT-2 of
block 64, and on one whose every position predicts " Shane" (the last word of LAMBADA's second document: a greedy
hit, which a random model never scores): every task, the first 3 documents (ARC and SciQ: the hand-made fixtures),
the same request texts, greedy flags, log-likelihoods and metrics. Needs the harness (`pip install
"lm_eval[hf]==0.4.13"`, e.g. in a venv of its own: README, "Zero-shot tasks"); skipped without it."""

import math
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "data" / "evals"


SHANE = 24379  # " Shane"


@pytest.mark.slow  # ~10 s each: the harness imports and loads 10 data sets
@pytest.mark.parametrize("model", ["random", "greedy"])
def test_every_task_scores_as_the_harness_does(model, tmp_path, shared_data):
    pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness: pip install 'lm_eval[hf]==0.4.13'")
    from transformers import GPT2Config, GPT2LMHeadModel

    from dev import harness_compare
    from tools.export_hf import write_tokenizer
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=50257))
    with torch.no_grad():  # far from the near-uniform init, so that the model tells the choices apart
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        if model == "greedy":  # the final LayerNorm's output is its bias alone, and " Shane" aligns with it
            direction = torch.nn.functional.normalize(torch.randn(64), dim=0)
            hf.transformer.ln_f.weight.zero_()
            hf.transformer.ln_f.bias.copy_(direction)
            hf.transformer.wte.weight[SHANE] = 20 * direction
    hf.save_pretrained(tmp_path)
    write_tokenizer(shared_data / "gpt2_tokenizer", tmp_path, 64)
    files = harness_compare.task_files([shared_data / "evals", FIXTURES],
                                       shared_data / "hellaswag" / "hellaswag_val.jsonl")
    assert len(files) == 10

    ours, our_requests = harness_compare.run_ours(tmp_path, files, limit=3)
    theirs, their_requests = harness_compare.run_harness(tmp_path, files, limit=3, batch_size=8)
    assert theirs["lambada_openai"]["acc"] == (1 / 3 if model == "greedy" else 0)
    for name in files:
        assert [r[:2] for r in our_requests[name]] == [r[:2] for r in their_requests[name]], name  # the texts
        assert [r[3] for r in our_requests[name]] == [r[3] for r in their_requests[name]], name  # greedy flags
        their_lls = [r[2] for r in their_requests[name]]
        assert [r[2] for r in our_requests[name]] == pytest.approx(their_lls, rel=1e-6, abs=1e-4), name
        assert ours[name].keys() == theirs[name].keys(), name
        for metric, value in ours[name].items():
            if metric == "perplexity":
                assert math.log(value) == pytest.approx(math.log(theirs[name][metric]), abs=1e-4)
            else:
                assert value == pytest.approx(theirs[name][metric], abs=1e-4), (name, metric)
