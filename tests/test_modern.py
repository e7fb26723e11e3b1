"""--arch modern (model.py's ModernAttention, SwiGLU, RMSNorm, rotary positions, untied output layer): the
same logits and greedy tokens as the Qwen3ForCausalLM it exports as, rotary's relative positions, cached
generation, its parameters (no wpe, biases on attention only, untied, zero-init projections) and their counts, the
Muon split, the flags (--attention_bias and --align_bos on by default, --init_from, recipes), and whole runs: 2
ranks, fsdp, a resume, fp16/bf16, activation checkpointing, and evals' scoring."""

import math
import re
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_activation_checkpointing import loss_gradients_and_flops
from test_model import generate_without_cache
from torch._inductor.utils import run_and_get_code

from conftest import ROOT, make_document_shards, make_shards, perturb_, save_tiny_model
from evaluation import tasks as evals
from helpers_train import main_in_process, read_metrics, run_train
from model import GPT, PRESETS, GPTConfig, rotate, rotation_table
from rundir.snapshot import load_snapshot, read_model, snapshot_path
from tools import export_hf
from train_gpt2 import initial_model
from training.config import TrainConfig, parse_args
from training.errors import UserError
from training.inputs import model_config, resolve_plan
from training.optim import Optimizers, adamw, build_optimizers, split_for_muon
from training.step import train_step

CPU = torch.device("cpu")
FP32_NEWTON_SCHULZ = ROOT / "tests" / "train_with_fp32_newton_schulz.py"
# GPT-2's vocabulary (so that the padding rows 50,257 → 50,304 are dropped on export), 4 heads of 16; modern as
# train_gpt2.py builds it, with attention's biases.
EXPORT = GPTConfig(block_size=64, vocab_size=50257, n_layer=2, n_head=4, n_embd=64, arch="modern", attention_bias=True)
# A small vocabulary for the tests that only need a working model.
SMALL = GPTConfig(block_size=16, vocab_size=97, n_layer=2, n_head=2, n_embd=32, arch="modern", attention_bias=True)
BLOCK_MATRICES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def random_model(config: GPTConfig, scale: float = 0.2, seed: int = 0) -> GPT:
    """Every weight randomised: the zero-initialised projections and output layer, and the norms' gains (1 ± scale),
    so that a swapped, transposed or dropped tensor changes the outputs."""
    torch.manual_seed(seed)
    return perturb_(GPT(config), scale, seed=seed).eval()


def random_tokens(config: GPTConfig, B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------------
# export: a Qwen3ForCausalLM with our logits and our greedy tokens

def assert_same_logits(ours: GPT, qwen3, min_std: float = 0.5) -> None:
    """fp32 logits on random tokens, every position of the context: within 1e-4 of ours."""
    idx = random_tokens(ours.config, B=2, T=ours.config.block_size, seed=1)
    with torch.no_grad():
        expected, _ = ours(idx)
        got = qwen3(idx).logits
    assert got.shape == expected.shape == (2, ours.config.block_size, ours.config.vocab_size)
    assert expected.std() > min_std  # far from uniform, so the comparison has teeth
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("attention_bias", [True, False])
def test_to_hf_gives_a_qwen3_with_our_logits_and_greedy_tokens(attention_bias):
    from transformers import Qwen3ForCausalLM

    ours = random_model(replace(EXPORT, attention_bias=attention_bias))
    qwen3 = export_hf.to_hf(ours)
    assert isinstance(qwen3, Qwen3ForCausalLM) and qwen3.config.attention_bias is attention_bias
    assert_same_logits(ours, qwen3)
    prompt = random_tokens(EXPORT, B=2, T=8, seed=2)
    expected = ours.generate(prompt, 20, temperature=0)
    got = qwen3.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False)
    assert got.shape == expected.shape == (2, 28)  # (no early stop at an EOT)
    assert torch.equal(got, expected)
    assert len(set(expected[0, 8:].tolist())) > 5  # not one token repeated: each step's argmax is compared


def test_export_hf_writes_a_directory_that_qwen3_loads_with_our_logits(tmp_path):
    from transformers import Qwen3ForCausalLM

    path = save_tiny_model(tmp_path / "model.pt", perturb=0.2, arch="modern")
    export_hf.main([str(path), str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    loaded = Qwen3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert loaded.config.tie_word_embeddings is False  # (tied, from_pretrained would overwrite lm_head with wte)
    assert_same_logits(read_model(path).eval(), loaded)


# ----------------------------------------------------------------------------------------------------------------
# the model

def test_rotary_dot_products_depend_only_on_the_distance_between_positions():
    q, k = torch.randn(2, 1, 1, 1, 16, generator=torch.Generator().manual_seed(0))  # (B, nh, T, hs) each
    table = rotation_table(400, 16)

    def score(p: int, distance: int) -> float:
        return (rotate(q, table[:, [p]]) * rotate(k, table[:, [p + distance]])).sum().item()

    for distance in (0, 1, 5, 40):  # (the angles are fp32: a few 1e-7 apart)
        assert [score(p, distance) for p in (1, 7, 60, 300)] == pytest.approx([score(0, distance)] * 4, rel=1e-5)
    scores = [score(3, d) for d in (0, 1, 5, 40)]
    assert min(abs(a - b) for i, a in enumerate(scores) for b in scores[i + 1:]) > 0.1  # and on the distance it does
    assert torch.equal(rotate(q, table[:, [0]]), q)  # position 0: no rotation
    rotated = rotate(q, table[:, [123]])
    assert rotated.norm().item() == pytest.approx(q.norm().item(), rel=1e-6) and not torch.allclose(rotated, q)


def test_the_rotation_table_holds_each_positions_angles_and_stays_out_of_snapshots():
    gpt = GPT(GPTConfig(arch="modern", block_size=64, n_layer=2, n_head=2, n_embd=32))  # head size 16
    table = gpt.transformer.h[1].attn.rotation
    assert table.shape == (2, 64, 16) and table.dtype == torch.float32
    pair, position = 3, 37  # channels 3 and 3 + 8 turn by the angle position · θ^(−2·3/16)
    angle = position * 10_000.0 ** (-2 * pair / 16)
    for channel in (pair, pair + 8):
        assert table[:, position, channel].tolist() == pytest.approx([math.cos(angle), math.sin(angle)], abs=1e-6)
    # Constants computed at construction: snapshots and the Hugging Face export hold the weights alone, as before.
    assert not any("rotation" in name for name in gpt.state_dict())


@pytest.mark.slow
def test_the_compiled_training_step_computes_no_cos_or_sin():
    # Computed in forward, the rotation's cos and sin were fused by Inductor into the kernels that rotate q and k and
    # computed again for every element of them: on an H100 that made modern's step 1.156x GPT-2's instead of 1.011x.
    gpt = GPT(GPTConfig(arch="modern", attention_bias=True, block_size=32, vocab_size=256, n_layer=1, n_head=2,
                        n_embd=32))
    idx = torch.randint(0, gpt.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(gpt)

    def forward_and_backward() -> None:
        _, loss = compiled(idx, idx)
        loss.backward()
    _, kernels = run_and_get_code(forward_and_backward)
    assert len(kernels) == 2  # the forward's code and the backward's
    assert re.findall(r"\b(?:sin|cos)\w*\(", "\n".join(kernels)) == []


@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (1.0, 10)])
def test_cached_generation_gives_the_uncached_tokens_within_and_past_block_size(temperature, top_k):
    model = random_model(SMALL, scale=0.3)
    idx = random_tokens(SMALL, B=3, T=5)
    n = 2 * SMALL.block_size  # past block_size: the window slides and the caches are refilled from position 0
    expected = generate_without_cache(model, idx, n, temperature, top_k, None, torch.Generator().manual_seed(3))
    got = model.generate(idx, n, temperature, top_k, generator=torch.Generator().manual_seed(3))
    assert got.shape == (3, 5 + n)
    assert torch.equal(got, expected)


def test_modern_has_no_position_embedding_biases_on_attention_only_rmsnorms_and_an_untied_output_layer():
    model, gpt2 = GPT(SMALL), GPT(replace(SMALL, arch="gpt2"))
    names = set(model.state_dict())
    assert not any(name.startswith("transformer.wpe") for name in names)
    assert {name for name in names if name.endswith("bias")} == {
        f"transformer.h.{i}.attn.{linear}.bias" for i in range(SMALL.n_layer) for linear in ("c_attn", "c_proj")}
    assert not any(name.endswith("bias") for name in GPT(replace(SMALL, attention_bias=False)).state_dict())
    assert "transformer.wpe.weight" in gpt2.state_dict() and any(name.endswith("bias") for name in gpt2.state_dict())
    assert {"transformer.h.0.attn.q_norm.weight", "transformer.h.0.attn.k_norm.weight"} <= names
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm))]
    assert len(norms) == 4 * SMALL.n_layer + 1 and all(isinstance(m, torch.nn.RMSNorm) for m in norms)
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # gpt2 as it was


def test_output_projections_and_attention_biases_start_at_zero_and_the_output_layer_random():
    torch.manual_seed(0)
    model = GPT(replace(SMALL, n_layer=4))
    for name, p in model.named_parameters():
        if name.endswith(("c_proj.weight", "bias")):
            assert torch.all(p == 0), name
        elif name.endswith(("wte.weight", "lm_head.weight", "c_attn.weight", "c_fc.weight")):
            assert p.std().item() == pytest.approx(0.02, rel=0.1), name
        else:
            assert name.endswith(("ln_1.weight", "ln_2.weight", "q_norm.weight", "k_norm.weight", "ln_f.weight"))
            assert torch.all(p == 1), name
    idx, targets = random_tokens(SMALL, B=2, T=16), random_tokens(SMALL, B=2, T=16, seed=1)
    with torch.no_grad():
        _, loss = model(idx, targets)
        # Every block starts as the identity: the logits are the final norm of the token's embedding, projected.
        x = F.rms_norm(model.transformer.wte(idx), (SMALL.n_embd,), eps=1e-6)
        expected = F.cross_entropy(model.logits(x).flatten(0, 1), targets.flatten())
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_attention_biases_leave_the_weights_random_draws_as_they_are_without_them():
    """The biases are made zero, not drawn by nn.Linear and zeroed: the runs measured before and after they were
    added start from the same weights (README, Architectures)."""
    torch.manual_seed(0)
    without = GPT(replace(SMALL, attention_bias=False)).state_dict()
    torch.manual_seed(0)
    with_biases = GPT(SMALL).state_dict()
    assert set(with_biases) - set(without) == {f"transformer.h.{i}.attn.{linear}.bias"
                                               for i in range(SMALL.n_layer) for linear in ("c_attn", "c_proj")}
    assert all(torch.equal(tensor, with_biases[name]) for name, tensor in without.items())
    assert without["transformer.h.1.attn.c_attn.weight"].std() > 0.01  # drawn, so the equality has teeth


@pytest.mark.parametrize("attention_bias", [False, True])
def test_num_params_counts_the_output_layer_but_not_the_input_embedding_and_flops_follow(attention_bias):
    config = GPTConfig(block_size=8, vocab_size=100, n_layer=2, n_head=2, n_embd=16, arch="modern",
                       attention_bias=attention_bias)  # 128 rows
    C, L, T, H = 16, 2, 8, 64  # H: SwiGLU's hidden width, 8/3·16 rounded up to a multiple of 64
    per_layer = (C  # ln_1's gain
                 + attention_bias * 4 * C  # c_attn's and attn.c_proj's biases
                 + C * 3 * C  # c_attn
                 + 2 * (C // 2)  # q_norm and k_norm, per head
                 + C * C  # attn.c_proj
                 + C  # ln_2
                 + C * 2 * H  # c_fc: gate and up
                 + H * C)  # mlp.c_proj: 4,144
    lm_head = 100 * C  # without its 28 padding rows
    n = L * per_layer + C + lm_head  # + ln_f
    assert n == (10_032 if attention_bias else 9904)
    model = GPT(config)
    assert model.num_params() == n
    assert model.num_params(non_embedding=False) == n + 100 * C  # + wte, also without its padding rows
    assert model.flops_per_token(T) == 6 * n + 12 * L * C * T == (63_264 if attention_bias else 62_496)


# ----------------------------------------------------------------------------------------------------------------
# the optimizers

def test_muon_takes_the_block_matrices_and_adamw_the_embeddings_output_layer_every_norm_and_the_biases():
    model = GPT(SMALL)
    names = {id(p): name for name, p in model.named_parameters()}
    matrices, rest = split_for_muon(model)
    assert sorted(names[id(p)] for p in matrices) == sorted(
        f"transformer.h.{i}.{m}.weight" for i in range(SMALL.n_layer) for m in BLOCK_MATRICES)
    gains, biases = ("ln_1", "attn.q_norm", "attn.k_norm", "ln_2"), ("attn.c_attn", "attn.c_proj")
    assert sorted(names[id(p)] for p in rest) == sorted(
        ["transformer.wte.weight", "lm_head.weight", "transformer.ln_f.weight"]
        + [f"transformer.h.{i}.{g}.weight" for i in range(SMALL.n_layer) for g in gains]
        + [f"transformer.h.{i}.{b}.bias" for i in range(SMALL.n_layer) for b in biases])
    optimizers = build_optimizers(model, TrainConfig(optimizer="muon"), "cpu")
    decay, no_decay, embedding = optimizers.by_name["adamw"].param_groups
    assert [names[id(p)] for p in decay["params"]] == ["lm_head.weight"]
    assert len(no_decay["params"]) == 1 + (len(gains) + len(biases)) * SMALL.n_layer
    assert [names[id(p)] for p in embedding["params"]] == ["transformer.wte.weight"]  # at --embed_lr (next test)
    assert embedding["weight_decay"] == decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [id(p) for p in optimizers.by_name["muon"].param_groups[0]["params"]] == [id(p) for p in matrices]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_input_embedding_learns_at_embed_lr_by_default_ten_times_max_lr_on_the_schedule(optimizer):
    def peak_lrs(arch: str, **flags) -> dict[str, float]:
        """{parameter name: its learning rate} at the schedule's peak (max_lr 1e-3)."""
        model = GPT(replace(SMALL, arch=arch))
        names = {id(p): name for name, p in model.named_parameters()}
        optimizers = build_optimizers(model, TrainConfig(optimizer=optimizer, max_lr=1e-3, muon_lr=0.02, **flags),
                                      "cpu")
        optimizers.set_lr(1e-3)
        return {names[id(p)]: group["lr"] for opt in optimizers for group in opt.param_groups for p in group["params"]}

    default = peak_lrs("modern")
    assert default["transformer.wte.weight"] == pytest.approx(1e-2)
    assert default["lm_head.weight"] == default["transformer.ln_f.weight"] == pytest.approx(1e-3)
    assert default["transformer.h.0.mlp.c_fc.weight"] == pytest.approx(1e-3 if optimizer == "adamw" else 0.02)
    assert peak_lrs("modern", embed_lr=3e-3)["transformer.wte.weight"] == pytest.approx(3e-3)
    # gpt2's wte is its output layer too: it stays with every other AdamW parameter, at --max_lr
    assert peak_lrs("gpt2")["transformer.wte.weight"] == pytest.approx(1e-3)


def test_a_snapshot_from_before_the_embedding_had_its_own_group_is_refused_naming_init_from():
    model = GPT(SMALL)
    # What build_optimizers made before --embed_lr: the embedding in AdamW's matrix group, two groups in all
    before = Optimizers({"adamw": adamw(list(model.parameters()), TrainConfig(), "cpu", fused=False)},
                        {"adamw": 1.0}).state_dict()
    optimizers = build_optimizers(model, TrainConfig(), "cpu")
    with pytest.raises(ValueError, match=r"the snapshot's adamw state has 2 parameter groups, this run's 3: .*"
                                         r"--embed_lr.*--init_from"):
        optimizers.load_state_dict(before)


def test_a_resume_takes_this_runs_embed_lr_and_says_it_replaced_the_saved_one():
    model = GPT(SMALL)
    saved = build_optimizers(model, TrainConfig(optimizer="muon", max_lr=1e-3, embed_lr=5e-3), "cpu").state_dict()
    optimizers = build_optimizers(model, TrainConfig(optimizer="muon", max_lr=1e-3, embed_lr=2e-3), "cpu")
    optimizers.load_state_dict(saved)
    optimizers.set_lr(1e-3)
    assert optimizers.by_name["adamw"].param_groups[2]["lr"] == pytest.approx(2e-3)
    assert optimizers.replaced_settings == {"--embed_lr (as a ratio to --max_lr)": (pytest.approx(5.0),
                                                                                    pytest.approx(2.0))}


# ----------------------------------------------------------------------------------------------------------------
# the flags

def plan(*flags: str):
    return resolve_plan(parse_args(["--model", "tiny", "--val_every", "0", "--micro_batch_size", "2",
                                    "--total_batch_size", "128", *flags]), world_size=1)


def test_embed_lr_on_gpt2_whose_embedding_is_its_output_layer_is_an_error_naming_the_flag():
    with pytest.raises(UserError, match=r"--embed_lr 0\.01: gpt2's token embedding is also its output layer"):
        plan("--embed_lr", "0.01")
    assert plan("--arch", "modern", "--embed_lr", "0.01").model_config.arch == "modern"


def test_attention_bias_is_on_for_modern_off_with_the_flag_and_an_error_naming_it_on_gpt2():
    assert plan("--arch", "modern").model_config.attention_bias is True
    assert plan("--arch", "modern", "--no-attention_bias").model_config.attention_bias is False
    assert plan().model_config.attention_bias is False  # (gpt2's biases are its own, on every layer)
    for flag in ("--attention_bias", "--no-attention_bias"):
        with pytest.raises(UserError, match=f"{flag}: gpt2 has biases on every layer.*train --arch modern"):
            plan(flag)


def test_align_bos_is_on_by_default_for_modern_only_and_the_flag_wins():
    assert plan("--arch", "modern").align_bos is True
    assert plan("--arch", "modern", "--no-align_bos").align_bos is False
    assert plan().align_bos is False and plan("--arch", "gpt2").align_bos is False
    assert plan("--align_bos").align_bos is True
    assert plan().model_config == PRESETS["tiny"]  # gpt2, as before --arch


def test_init_from_a_modern_snapshot_builds_it_and_refuses_arch_gpt2(tmp_path):
    path = save_tiny_model(tmp_path / "model.pt", perturb=0.1, arch="modern")
    cfg = parse_args(["--init_from", str(path), "--block_size", "32", "--val_every", "0"])
    the_plan = resolve_plan(cfg, world_size=1)
    assert the_plan.model_config == replace(PRESETS["tiny"], arch="modern", attention_bias=True, block_size=32)
    assert the_plan.align_bos is True
    model, saved = initial_model(cfg, the_plan), torch.load(path)["model"]
    assert model.config.arch == "modern" and model.config.block_size == 32
    assert all(torch.equal(p, saved[name]) for name, p in model.state_dict().items())
    assert model_config(parse_args(["--init_from", str(path), "--arch", "modern"])).arch == "modern"
    with pytest.raises(UserError, match=r"--arch gpt2 \(the weights have modern\)"):
        model_config(parse_args(["--init_from", str(path), "--arch", "gpt2"]))
    with pytest.raises(UserError, match=r"--attention_bias False \(the weights have True\)"):
        model_config(parse_args(["--init_from", str(path), "--no-attention_bias"]))


def test_a_recipe_sets_arch_and_turns_align_bos_off(tmp_path):
    recipe = tmp_path / "modern.toml"
    recipe.write_text('arch = "modern"\nalign_bos = false\nmodel = "tiny"\n')
    cfg = parse_args(["--config", str(recipe), "--val_every", "0", "--micro_batch_size", "2",
                      "--total_batch_size", "128"])
    assert (cfg.arch, cfg.align_bos) == ("modern", False)
    the_plan = resolve_plan(cfg, world_size=1)
    assert the_plan.model_config.arch == "modern" and the_plan.align_bos is False
    recipe.write_text('arch = "llama"\n')
    with pytest.raises(UserError, match=r"arch = 'llama' is not a valid value for --arch \(one of gpt2, modern\)"):
        parse_args(["--config", str(recipe)])


# ----------------------------------------------------------------------------------------------------------------
# training steps in this process: fp16 and bf16 autocast, activation checkpointing

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_steps_train_and_the_loss_falls(dtype, cpu_bf16):
    def steps(dtype: torch.dtype) -> list:
        torch.manual_seed(0)
        model = GPT(SMALL)
        optimizer = build_optimizers(model, TrainConfig(optimizer="muon", max_lr=1e-2, muon_lr=0.02), "cpu")
        scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
        tokens = random_tokens(SMALL, B=4, T=SMALL.block_size + 1)
        same_batch = SimpleNamespace(next_batch=lambda: (tokens[:, :-1], tokens[:, 1:]))  # as a data loader
        return [train_step(model, optimizer, scaler, same_batch, 1, 1e-2, 1.0, CPU, dtype) for _ in range(8)]

    fp32, low = steps(torch.float32), steps(dtype)
    assert not any(step.skipped for step in low)
    losses = [step.loss for step in low]
    assert losses[0] == pytest.approx(math.log(SMALL.vocab_size), abs=0.05)  # a random output layer: near uniform
    assert losses[-1] < losses[0] - 1.5  # the same batch again and again: learnt
    assert losses == pytest.approx([step.loss for step in fp32], abs=0.05)
    # Not fp32's numbers to the last bit: autocast really computed in low precision.
    assert [step.grad_norm for step in low] != [step.grad_norm for step in fp32]


@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_checkpointed_blocks_get_the_rotary_positions_and_give_the_same_loss_and_gradients(mode):
    # (The recomputed block must be given the positions too: modern's attention rotates by them.)
    loss, grads, flops = loss_gradients_and_flops(mode, config=SMALL, perturb=0.1)
    kept_loss, kept_grads, kept_flops = loss_gradients_and_flops("none", config=SMALL, perturb=0.1)
    assert loss == pytest.approx(kept_loss, rel=1e-6, abs=0)
    assert all(k.abs().max() > 0 for k in kept_grads)  # every weight gets a gradient (none is left at zero)
    assert all(torch.allclose(g, k, rtol=0, atol=1e-6 * k.abs().max()) for g, k in zip(grads, kept_grads))
    # blocks recomputes each block's forward; selective keeps every matmul's and attention's output
    assert flops > kept_flops if mode == "blocks" else flops == kept_flops


# ----------------------------------------------------------------------------------------------------------------
# evals.py scores a modern model

def test_batched_scoring_gives_each_requests_own_log_likelihood():
    model = random_model(SMALL, scale=0.3)
    generator = torch.Generator().manual_seed(5)
    requests = [evals.Request(torch.randint(0, 97, (n,), generator=generator).tolist(),
                              torch.randint(0, 97, (m,), generator=generator).tolist()) for n, m in
                ((12, 3), (5, 1), (16, 4), (2, 2))]
    batched, batched_greedy = evals.score_batch(model, requests, CPU, torch.float32)
    alone = [evals.score_batch(model, [r], CPU, torch.float32) for r in requests]
    torch.testing.assert_close(batched, torch.cat([ll for ll, _ in alone]), rtol=0, atol=1e-5)
    assert batched_greedy.tolist() == [greedy.item() for _, greedy in alone]
    # and each is the sum of log-softmax at its continuation's positions, from a plain forward
    for request, ll in zip(requests, batched):
        with torch.no_grad():
            logits, _ = model(torch.tensor([request.tokens]))
        logprobs = F.log_softmax(logits[0, -len(request.targets):], dim=-1)
        expected = logprobs.gather(1, torch.tensor(request.targets)[:, None]).sum()
        assert torch.isfinite(ll) and ll.item() == pytest.approx(expected.item(), abs=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# whole runs of train_gpt2.py

RUN = ["--arch", "modern", "--optimizer", "muon", "--micro_batch_size", "2", "--seq_len", "16",
       "--total_batch_size", "128", "--max_steps", "6", "--warmup_steps", "2", "--max_lr", "1e-2",
       "--muon_lr", "0.02", "--dtype", "fp32", "--val_every", "3", "--val_tokens", "128", "--snapshot_every", "100"]


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory):
    """6 steps of 128 tokens of modern with Muon and (its default) --align_bos: 1 process × 4 micro-steps, and 2
    torchrun ranks × 2 micro-steps under ddp and under fsdp."""
    root = tmp_path_factory.mktemp("modern")
    make_document_shards(root / "data", "train", 17, [3000], vocab=100)  # learnable: the steps really differ
    make_shards(root / "data", "val", [400], seed=1, vocab=100)
    args = [*RUN, "--data_dir", str(root / "data")]
    # Newton–Schulz in fp32: in bf16, gradients summed in another order (~1e-7 apart) give grad norms 4e-4 apart
    # within 4 steps (see tests/train_with_fp32_newton_schulz.py).
    return {"one": run_train(args, root / "one", script=FP32_NEWTON_SCHULZ),
            "ddp": run_train(args, root / "ddp", nproc=2, script=FP32_NEWTON_SCHULZ),
            "fsdp": run_train([*args, "--parallel", "fsdp"], root / "fsdp", nproc=2, script=FP32_NEWTON_SCHULZ),
            "root": root}


def by_step(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_modern_with_muon_and_aligned_rows_like_one_process(rank_runs, parallel):
    one, two = rank_runs["one"], rank_runs[parallel]
    assert "arch='modern'" in one.proc.stdout and "2 ranks × 2 accumulation steps" in two.proc.stdout
    # the last step's snapshot: the rows were document-aligned, the default for modern
    last = snapshot_path(rank_runs["root"] / parallel, 5, sharded=parallel == "fsdp")
    assert load_snapshot(last)["loader"]["align_bos"] == 1
    losses, norms = (by_step(one.records, key) for key in ("loss", "grad_norm"))
    assert sorted(losses) == list(range(6)) and losses[5] < losses[0] - 0.5
    assert by_step(two.records, "loss") == pytest.approx(losses, rel=1e-4)
    # fsdp: torch sums the sharded norm in another order (test_fsdp.py), here up to 6e-5 apart
    assert by_step(two.records, "grad_norm") == pytest.approx(norms, rel=1e-4 if parallel == "ddp" else 1e-3)
    assert by_step(two.records, "val_loss") == pytest.approx(by_step(one.records, "val_loss"), rel=1e-4)


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    """A 12-step modern run on document shards, snapshots every 4 steps, and the same run resumed from step 7's."""
    root = tmp_path_factory.mktemp("modern_resume")
    # about 13 and 11 steps of rows of 17 tokens
    make_document_shards(root / "data", "train", 17, [1000, 800], vocab=100)
    make_shards(root / "data", "val", [200], seed=1, vocab=100)
    args = ["--arch", "modern", "--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64",
            "--max_steps", "12", "--warmup_steps", "3", "--max_lr", "1e-2", "--val_every", "4", "--val_tokens", "64",
            "--dtype", "fp32", "--data_dir", str(root / "data"), "--snapshot_every", "4"]
    main_in_process([*args, "--log_dir", str(root / "whole")])
    main_in_process([*args, "--log_dir", str(root / "resumed"), "--resume", str(snapshot_path(root / "whole", 7))])
    return root


@pytest.mark.slow  # two runs in this process
def test_a_modern_run_resumes_exactly_from_a_mid_epoch_aligned_snapshot(resumed_runs):
    state = load_snapshot(snapshot_path(resumed_runs / "whole", 7))
    loader = state["loader"]  # mid-shard: 8 steps of 2 chunks
    assert loader["align_bos"] == 1 and [loader[k] for k in ("epoch", "shard_position", "chunk_position")] == [0, 0, 16]
    assert state["model_config"] == asdict(replace(PRESETS["tiny"], arch="modern", attention_bias=True))
    whole, resumed = read_metrics(resumed_runs / "whole"), read_metrics(resumed_runs / "resumed")
    assert by_step(whole, "loss")[11] < by_step(whole, "loss")[0] - 1.0  # each step moves the model
    assert list(by_step(resumed, "loss")) == [8, 9, 10, 11]
    assert by_step(resumed, "loss") == {s: loss for s, loss in by_step(whole, "loss").items() if s >= 8}


@pytest.mark.slow
def test_a_trained_modern_snapshot_exports_to_a_qwen3_with_its_logits(resumed_runs, tmp_path):
    from transformers import Qwen3ForCausalLM

    path = snapshot_path(resumed_runs / "whole", 11)
    export_hf.main([str(path), str(tmp_path / "hf")])
    ours = read_model(path).eval()
    # trained away from the zero init
    assert ours.lm_head.weight.abs().max() > 0 and ours.transformer.h[0].attn.c_proj.weight.abs().max() > 0
    assert_same_logits(ours, Qwen3ForCausalLM.from_pretrained(tmp_path / "hf").eval(), min_std=0.1)
