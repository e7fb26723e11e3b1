"""model.py: parity with Hugging Face's GPT-2 both ways, parameter and FLOP counts, init, optimizer groups,
generation and snapshot loading."""

import gc
import math
from dataclasses import asdict

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import perturb_
from model import GPT, PRESETS, GPTConfig, KVCache, sample_next_token
from rundir.snapshot import read_model
from training import hf

# Full GPT-2 vocabulary (so the internal padding 50257 -> 50304 is exercised), everything else small.
PARITY_CONFIG = GPTConfig(block_size=32, vocab_size=50257, n_layer=2, n_head=4, n_embd=32)
# A small vocabulary for the tests that only need a working model.
TINY = GPTConfig(block_size=16, vocab_size=97, n_layer=2, n_head=2, n_embd=16)


def hf_config(config: GPTConfig) -> GPT2Config:
    return GPT2Config(vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.n_embd,
                      n_layer=config.n_layer, n_head=config.n_head)


def random_tokens(config: GPTConfig, B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def hf_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(hf_config(PARITY_CONFIG)).eval()  # eval: HF has dropout, we do not
    perturb_(model, 0.3, seed=1)
    return model


def test_logits_and_loss_match_hugging_face_loaded_from_save_pretrained(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    ours = hf.from_pretrained(str(tmp_path)).eval()
    assert ours.config == PARITY_CONFIG

    idx = random_tokens(PARITY_CONFIG, B=3, T=PARITY_CONFIG.block_size)
    with torch.no_grad():
        hf_out = hf_model(idx, labels=idx)
        logits, _ = ours(idx)
        # HF shifts labels inside: position t predicts idx[t+1], so its loss is ours on (idx[:-1] -> idx[1:]).
        _, loss = ours(idx[:, :-1], targets=idx[:, 1:])

    assert logits.shape == (3, PARITY_CONFIG.block_size, 50257)  # padding columns (up to 50304) not visible
    assert hf_out.logits.abs().max() > 5.0  # non-trivial weights, so the comparison below means something
    assert (logits - hf_out.logits).abs().max().item() <= 1e-4
    assert abs(loss.item() - hf_out.loss.item()) <= 1e-5


def test_hf_state_dict_loads_into_hugging_face_with_same_logits():
    torch.manual_seed(0)
    ours = GPT(PARITY_CONFIG).eval()
    perturb_(ours, 0.3, seed=2)
    hf_model = GPT2LMHeadModel(hf_config(PARITY_CONFIG)).eval()
    hf_model.load_state_dict(hf.hf_state_dict(ours), strict=True)  # names, shapes (unpadded wte, Conv1D) all match

    idx = random_tokens(PARITY_CONFIG, B=2, T=20, seed=3)
    with torch.no_grad():
        expected, _ = ours(idx)
        actual = hf_model(idx).logits
    assert (actual - expected).abs().max().item() <= 1e-4


def test_gpt2_preset_has_the_reference_parameter_counts():
    with torch.device("meta"):  # shapes only: no 500 MB of weights to allocate and initialise
        model = GPT(PRESETS["gpt2"])
    assert model.num_params(non_embedding=False) == 124_439_808
    assert model.num_params() == 123_653_376  # minus the 1024x768 position embedding


def test_loss_at_init_is_log_vocab_size():
    torch.manual_seed(0)
    config = GPTConfig(block_size=32, vocab_size=50257, n_layer=2, n_head=2, n_embd=64)
    model = GPT(config)
    idx = random_tokens(config, B=4, T=32)
    targets = random_tokens(config, B=4, T=32, seed=1)
    with torch.no_grad():
        _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(50257)) < 0.1  # ln(50257) = 10.825: uniform predictions at init


def test_init_scales_residual_projections_and_ties_lm_head():
    torch.manual_seed(0)
    n_layer = 4
    model = GPT(GPTConfig(block_size=64, vocab_size=1000, n_layer=n_layer, n_head=4, n_embd=128))
    residual_std = 0.02 / math.sqrt(2 * n_layer)  # 0.00707
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            assert p.std().item() == pytest.approx(residual_std, rel=0.05), name
        elif name.endswith(("wte.weight", "wpe.weight", "c_attn.weight", "c_fc.weight")):
            assert p.std().item() == pytest.approx(0.02, rel=0.05), name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
        else:
            assert name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "transformer.ln_f.weight"
            assert torch.all(p == 1), name
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert model.lm_head.weight is model.transformer.wte.weight


def test_flops_per_token_matches_hand_count():
    config = GPTConfig(block_size=8, vocab_size=100, n_layer=2, n_head=2, n_embd=16)  # wte padded to 128 rows
    C, L, T = 16, 2, 8
    # Parameters other than the position embedding, from the shapes (wte counted once, it is also lm_head,
    # and without its padding rows):
    wte = 100 * C  # 1600
    per_layer = (2 * C  # ln_1
                 + C * 3 * C + 3 * C  # c_attn
                 + C * C + C  # attn.c_proj
                 + 2 * C  # ln_2
                 + C * 4 * C + 4 * C  # c_fc
                 + 4 * C * C + C)  # mlp.c_proj: 12·C² + 13·C = 3280
    ln_f = 2 * C
    n = wte + L * per_layer + ln_f
    assert n == 8192
    model = GPT(config)
    assert model.num_params() == 8192
    assert model.num_params(non_embedding=False) == 8192 + 8 * C  # + wpe
    assert model.flops_per_token(T) == 6 * 8192 + 12 * L * C * T == 52_224


@pytest.fixture(scope="module")
def tiny_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    perturb_(model, 0.3, seed=4)  # larger logits than at init, so greedy and sampled continuations differ
    return model


def generate_without_cache(model: GPT, idx: torch.Tensor, n: int, temperature: float = 0.0, top_k: int | None = None,
                           top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The reference for GPT.generate: every token from a forward over the whole (last block_size) context."""
    for _ in range(n):
        with torch.no_grad():
            logits, _ = model(idx[:, -model.config.block_size:])
        idx = torch.cat((idx, sample_next_token(logits[:, -1], temperature, top_k, top_p, generator)), dim=1)
    return idx


def test_generate_temperature_zero_and_top_k_one_are_greedy(tiny_model):
    idx = random_tokens(TINY, B=2, T=5)
    expected = generate_without_cache(tiny_model, idx, 8)
    assert expected.shape == (2, 5 + 8)
    assert torch.equal(tiny_model.generate(idx, 8, temperature=0), expected)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(tiny_model.generate(idx, 8, temperature=1.0, top_k=1, generator=g), expected)


def test_generate_is_reproducible_with_a_seeded_generator(tiny_model):
    idx = random_tokens(TINY, B=2, T=5)
    first = tiny_model.generate(idx, 10, generator=torch.Generator().manual_seed(123))
    again = tiny_model.generate(idx, 10, generator=torch.Generator().manual_seed(123))
    other = tiny_model.generate(idx, 10, generator=torch.Generator().manual_seed(124))
    assert first.shape == (2, 15)
    assert torch.equal(first[:, :5], idx)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)  # it does sample: 20 draws from a 97-way softmax


def test_generate_top_k_only_samples_from_the_k_most_likely(tiny_model):
    idx = random_tokens(TINY, B=64, T=4)
    out = tiny_model.generate(idx, 1, temperature=2.0, top_k=3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        top3 = tiny_model(idx)[0][:, -1].topk(3).indices
    assert (out[:, -1:] == top3).any(dim=1).all()
    assert len(set(out[:, -1].tolist())) > 3  # different rows, different top-3 sets: not just a constant


def test_generate_crops_contexts_longer_than_block_size(tiny_model):
    idx = random_tokens(TINY, B=1, T=TINY.block_size + 7)
    out = tiny_model.generate(idx, 3, temperature=0)
    assert out.shape == (1, TINY.block_size + 10)
    # Only the last block_size tokens matter.
    cropped = tiny_model.generate(idx[:, -TINY.block_size:], 3, temperature=0)
    assert torch.equal(out[:, -3:], cropped[:, -3:])


def test_forward_rejects_sequences_longer_than_block_size(tiny_model):
    with pytest.raises(ValueError, match=r"length 17 .*block_size 16"):
        tiny_model(random_tokens(TINY, B=1, T=17))


@pytest.mark.parametrize("prompt_len", [5, TINY.block_size])  # shorter than block_size, and reaching it
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, None, None), (1.0, None, None), (0.8, 10, 0.9)])
def test_cached_generation_gives_the_uncached_tokens_within_and_past_block_size(tiny_model, prompt_len, temperature,
                                                                                top_k, top_p):
    idx = random_tokens(TINY, B=3, T=prompt_len)
    n = 2 * TINY.block_size  # well past block_size: the window slides and the cache is refilled
    expected = generate_without_cache(tiny_model, idx, n, temperature, top_k, top_p, torch.Generator().manual_seed(3))
    got = tiny_model.generate(idx, n, temperature, top_k, top_p, generator=torch.Generator().manual_seed(3))
    assert got.shape == (3, prompt_len + n)
    assert torch.equal(got, expected)


def test_generate_reads_the_prompt_once_then_one_token_per_step_until_block_size(tiny_model):
    seen = []  # the number of tokens each forward embeds, per row
    hook = tiny_model.transformer.wte.register_forward_hook(lambda module, args, out: seen.append(args[0].size(1)))
    try:
        tiny_model.generate(random_tokens(TINY, B=2, T=5), 14)  # 5 + 14 = 19 > block_size 16
    finally:
        hook.remove()
    # The prompt, then each sampled token alone up to 16 tokens; past that, the whole 16-token window per step.
    assert seen == [5] + [1] * 11 + [16] * 2


def test_cached_logits_match_a_full_forward(tiny_model):
    tokens = random_tokens(TINY, B=2, T=TINY.block_size)
    with torch.no_grad():
        full, _ = tiny_model(tokens)
        caches = [KVCache(TINY.block_size) for _ in range(TINY.n_layer)]
        prefill, _ = tiny_model(tokens[:, :6], kv_caches=caches)  # into empty caches: positions 0..5
        several, _ = tiny_model(tokens[:, 6:9], kv_caches=caches, positions=torch.arange(6, 9))
        steps = [tiny_model(tokens[:, t:t + 1], kv_caches=caches, positions=torch.tensor([t]))[0]
                 for t in range(9, TINY.block_size)]
    cached = torch.cat([prefill, several, *steps], dim=1)
    assert cached.shape == full.shape
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)


def test_the_caches_are_allocated_once_and_every_decode_step_has_the_same_shapes(tiny_model, monkeypatch):
    # What lets a GPU replay the step as a CUDA graph: fixed buffers, written in place, and fixed shapes.
    writes = []
    real_write = KVCache.write

    def spied_write(self, positions, k, v):
        buffers = real_write(self, positions, k, v)
        writes.append((self, buffers[0].data_ptr(), buffers[0].shape, tuple(positions.shape)))
        return buffers

    monkeypatch.setattr(KVCache, "write", spied_write)
    tiny_model.generate(random_tokens(TINY, B=2, T=5), 11)  # up to block_size 16: a prefill, then 10 single steps
    first_layer = [w for w in writes if w[0] is writes[0][0]]
    assert [w[3] for w in first_layer] == [(5,)] + [(1,)] * 10
    assert {(w[1], w[2]) for w in first_layer} == {(first_layer[0][1], (2, TINY.n_head, TINY.block_size,
                                                                         TINY.n_embd // TINY.n_head))}


def test_generate_keeps_no_cache_after_it_returns(tiny_model):
    gc.collect()
    tiny_model.generate(random_tokens(TINY, B=2, T=4), 20)
    gc.collect()
    assert not [obj for obj in gc.get_objects() if type(obj) is KVCache]


@pytest.mark.slow  # torch.compile: about 10 s
def test_a_compiled_decode_step_samples_the_same_tokens_compiles_once_and_keeps_no_cache(tiny_model):
    from torch._dynamo.utils import counters
    idx = random_tokens(TINY, B=2, T=5)  # 5 + 14 tokens: past block_size 16, so the refills run too

    def sample(compile: bool) -> torch.Tensor:
        return tiny_model.generate(idx, 14, top_k=5, generator=torch.Generator().manual_seed(0), compile=compile)

    expected = sample(compile=False)
    torch._dynamo.reset()
    counters.clear()  # (they count over the whole process, other tests' compilations too)
    assert torch.equal(sample(compile=True), expected)
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(sample(compile=True), expected)  # new caches, the same shapes: no second compilation
    assert counters["stats"]["unique_graphs"] == graphs == 1
    gc.collect()
    assert not [obj for obj in gc.get_objects() if type(obj) is KVCache]  # compiled code holds no generation's caches


def test_top_p_tiny_is_greedy_and_top_p_one_is_no_limit(tiny_model):
    idx = random_tokens(TINY, B=4, T=5)
    greedy = tiny_model.generate(idx, 12, temperature=0)
    tiny_p = tiny_model.generate(idx, 12, top_p=1e-6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tiny_p, greedy)
    unlimited = tiny_model.generate(idx, 12, top_k=20, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(unlimited, greedy)
    assert torch.equal(tiny_model.generate(idx, 12, top_k=20, top_p=1.0, generator=torch.Generator().manual_seed(0)),
                       unlimited)


def test_top_p_samples_only_from_the_nucleus(tiny_model):
    idx = random_tokens(TINY, B=256, T=4)
    top_p = 0.5
    with torch.no_grad():
        probs = tiny_model(idx)[0][:, -1].softmax(-1)
    nuclei = []
    for row in probs.tolist():  # by hand: the likeliest tokens, one by one, until they add up to top_p
        nucleus, total = set(), 0.0
        for p, token in sorted(zip(row, range(len(row))), reverse=True):
            if total >= top_p:
                break
            nucleus.add(token)
            total += p
        nuclei.append(nucleus)
    nucleus_only = tiny_model.generate(idx, 1, top_p=top_p, generator=torch.Generator().manual_seed(0))[:, -1]
    unlimited = tiny_model.generate(idx, 1, generator=torch.Generator().manual_seed(0))[:, -1]
    assert all(token in nucleus for token, nucleus in zip(nucleus_only.tolist(), nuclei))
    assert sum(token not in nucleus for token, nucleus in zip(unlimited.tolist(), nuclei)) > 50  # it does cut
    assert len(set(nucleus_only.tolist())) > 5  # different rows, different tokens: not a constant


def test_top_p_reached_exactly_keeps_the_tokens_that_reach_it_and_no_more():
    logits = torch.tensor([[0.5, 0.25, 0.25]]).log()  # softmax gives back 0.5, 0.25, 0.25 exactly
    generator = torch.Generator().manual_seed(0)
    draws = [sample_next_token(logits.clone(), 1.0, None, 0.5, generator).item() for _ in range(100)]
    assert draws == [0] * 100  # the first token alone reaches top_p: the nucleus is {0}
    assert {sample_next_token(logits.clone(), 1.0, None, 0.75, generator).item() for _ in range(100)} == {0, 1}


def test_hugging_face_weights_generate_the_tokens_hugging_face_generates(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    ours = hf.from_pretrained(str(tmp_path)).eval()
    idx = random_tokens(PARITY_CONFIG, B=2, T=8)
    n = PARITY_CONFIG.block_size - 8
    expected = hf_model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)  # greedy, with Hugging Face's own cache
    assert torch.equal(ours.generate(idx, n, temperature=0), expected)


def test_read_model_restores_the_same_model(tiny_model, tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"model": tiny_model.state_dict(), "model_config": asdict(TINY), "step": 7}, path)
    loaded = read_model(path).eval()
    assert loaded.config == TINY
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied after load_state_dict
    idx = random_tokens(TINY, B=2, T=TINY.block_size)
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], tiny_model(idx)[0])


def test_read_model_rejects_a_file_without_model_and_config(tmp_path):
    path = tmp_path / "not_a_snapshot.pt"
    torch.save({"weights": torch.zeros(3)}, path)
    with pytest.raises(ValueError, match=r"not_a_snapshot\.pt.*'model' and 'model_config'"):
        read_model(path)
