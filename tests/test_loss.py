"""The chunked cross-entropy in model.py (ChunkedLinearCrossEntropy): the same loss and gradients as full logits +
F.cross_entropy, and Hugging Face's GPT-2, in fp32, bf16 and fp16 with a GradScaler, compiled and under DDP,
without ever building the (tokens × vocab) logits."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GPT2Config, GPT2LMHeadModel

import hf
from distributed import teardown_distributed
from model import GPT, GPTConfig, loss_chunk_tokens

# vocab 97 is padded to 128 rows, so the padding rows' gradient is checked too.
TINY = GPTConfig(block_size=16, vocab_size=97, n_layer=2, n_head=2, n_embd=16)
B, T, CHUNK = 3, 16, 10  # 48 tokens: chunks of 10, 10, 10, 10 and 8


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(TINY)
    model.loss_chunk_tokens = CHUNK
    with torch.no_grad():  # larger logits than at init, so softmax is far from uniform and errors would show
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def batch(config: GPTConfig = TINY, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, config.vocab_size, (B, T), generator=g) for _ in range(2))


def plain_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The path the chunked loss replaces: all the logits, then F.cross_entropy on an fp32 copy."""
    logits, _ = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def assert_close_relative(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rel: float) -> None:
    """Each gradient within rel of the largest entry of its expected value."""
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        assert want.abs().max() > 0, name  # a gradient that is all zeros would make the comparison empty
        error = (actual[name].float() - want.float()).abs().max() / want.float().abs().max()
        assert error <= rel, f"{name}: relative error {error:.2e} > {rel:.0e}"


def test_loss_and_every_gradient_match_full_logits_cross_entropy_in_fp32():
    model = tiny_model()
    idx, targets = batch()
    assert B * T > 4 * CHUNK  # several chunks, the last one partial

    _, loss = model(idx, targets)
    loss.backward()
    chunked = gradients(model)
    expected_loss = plain_loss(model, idx, targets)
    expected_loss.backward()
    expected = gradients(model)

    assert loss.dtype == torch.float32 and loss.shape == ()
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-5)
    assert len(chunked) == 2 + 12 * TINY.n_layer + 2  # every parameter, the tied lm_head once (as wte)
    assert_close_relative(chunked, expected, rel=1e-5)
    assert torch.all(chunked["transformer.wte.weight"][TINY.vocab_size:] == 0)  # the 31 padding rows


def test_forward_with_targets_returns_no_logits_and_without_targets_returns_them():
    model = tiny_model()
    idx, targets = batch()
    logits, loss = model(idx, targets)
    assert logits is None and loss is not None
    logits, loss = model(idx)
    assert logits.shape == (B, T, TINY.vocab_size) and loss is None


def test_loss_under_no_grad_equals_the_training_loss():
    model = tiny_model()
    idx, targets = batch()
    _, training = model(idx, targets)
    with torch.no_grad():  # validation: the chunked loss skips the gradient work
        _, validation = model(idx, targets)
    assert not validation.requires_grad
    assert validation.item() == training.item()


def test_a_target_outside_the_vocabulary_never_gives_a_finite_loss():
    # (Shards are checked for such ids before training starts: dataloader.py.)
    model = tiny_model()
    idx, targets = batch()
    targets[0, 0] = TINY.vocab_size  # a padding column: it has no probability, so the loss is infinite
    assert model(idx, targets)[1].item() == float("inf")
    targets[0, 0] = TINY.padded_vocab_size  # past the logits altogether
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        model(idx, targets)


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any operation produces while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


def test_full_logits_are_never_materialised():
    model = tiny_model()
    idx, targets = batch()
    # 4,656 elements; next largest are the MLP's activations (48 × 64 = 3,072) and one chunk's logits (970).
    full_logits = B * T * TINY.vocab_size

    with LargestTensor() as training:  # backward runs on this thread too (CPU), so it is watched as well
        _, loss = model(idx, targets)
        loss.backward()
    with LargestTensor() as old_path:  # the probe does see full logits where they exist
        plain_loss(model, idx, targets).backward()

    assert old_path.numel >= full_logits
    assert training.numel < full_logits


class OpRecorder(TorchDispatchMode):
    """Records (op name, output shape) of every operation run while active."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.ops.append((func.__name__, tuple(out.shape)))
        return out


def test_the_weight_is_cast_once_and_the_logits_matmul_runs_at_the_padded_width():
    model = tiny_model()
    idx, targets = batch()
    weight_shape = (TINY.padded_vocab_size, TINY.n_embd)
    with OpRecorder() as recorder, torch.autocast("cpu", torch.bfloat16):
        _, loss = model(idx, targets)
        loss.backward()
    weight_copies = [op for op in recorder.ops if op == ("_to_copy.default", weight_shape)]
    assert len(weight_copies) == 1  # once per forward, not once per chunk (5 chunks here)
    logits_matmuls = [shape for name, shape in recorder.ops if name == "mm.default" and shape[0] <= CHUNK
                      and len(shape) == 2 and shape[1] > TINY.n_embd]
    assert len(logits_matmuls) == -(-B * T // CHUNK)
    assert all(width % 64 == 0 for _, width in logits_matmuls), logits_matmuls  # 128, not the vocabulary's 97


def test_eager_makes_three_tensors_of_a_chunks_logits_size_not_nine():
    # The matmul's output, its fp32 copy (the rest of the loss and gradient written into it in place) and the
    # gradient in the autocast dtype. The out-of-place expression that compile wants made six more in eager, each
    # a pass over memory: on the CPU the chunk took 3x as long.
    model = tiny_model()
    idx, targets = batch()
    with OpRecorder() as recorder, torch.autocast("cpu", torch.bfloat16):
        _, loss = model(idx, targets)
        loss.backward()
    new_tensors = [name for name, shape in recorder.ops if len(shape) == 2 and shape[0] <= CHUNK
                   and shape[1] == TINY.padded_vocab_size and not name.split(".")[0].endswith("_")]  # not in place
    chunks = -(-B * T // CHUNK)
    assert len(new_tensors) == 3 * chunks, new_tensors


def test_the_loss_runs_as_many_chunks_as_the_device_rule_says():
    config = GPTConfig(block_size=1024, vocab_size=97, n_layer=1, n_head=1, n_embd=8)
    model = GPT(config)
    assert model.loss_chunk_tokens is None  # the device decides
    idx = torch.randint(0, 97, (3, 1024))
    with OpRecorder() as recorder:
        model(idx, idx)
    logits_matmuls = [shape for name, shape in recorder.ops if name == "mm.default" and shape[1] == 128]
    assert [rows for rows, _ in logits_matmuls] == [loss_chunk_tokens(torch.device("cpu"))] * 3
    # On a GPU, a GPT-2 micro-batch of 64 × 1,024 tokens in a few large chunks, not 64 small ones.
    assert 64 * 1024 // loss_chunk_tokens(torch.device("cuda")) == 16


def test_loss_and_gradients_match_hugging_face_gpt2():
    config = GPTConfig(block_size=32, vocab_size=50257, n_layer=2, n_head=4, n_embd=32)  # padded to 50304
    torch.manual_seed(0)
    hf_model = GPT2LMHeadModel(GPT2Config(vocab_size=config.vocab_size, n_positions=config.block_size,
                                          n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head))
    hf_model.eval()  # no dropout; gradients still flow
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ours = GPT(config)
    hf.load_hf_state_dict(ours, hf_model.state_dict())
    ours.loss_chunk_tokens = 16
    idx = torch.randint(0, config.vocab_size, (2, config.block_size), generator=torch.Generator().manual_seed(1))

    hf_out = hf_model(idx, labels=idx)  # HF shifts the labels inside: position t predicts idx[t + 1]
    hf_out.loss.backward()
    _, loss = ours(idx[:, :-1], targets=idx[:, 1:])  # 62 tokens: four chunks
    loss.backward()

    assert loss.item() == pytest.approx(hf_out.loss.item(), rel=1e-5)
    hf_grads = dict(hf_model.named_parameters())
    expected = {}
    for name, _ in ours.named_parameters():
        grad = hf_grads[name].grad  # tied: HF's wte gradient also holds its lm_head's, as ours does
        if name == "transformer.wte.weight":
            grad = torch.cat([grad, torch.zeros(config.padded_vocab_size - config.vocab_size, config.n_embd)])
        elif name.endswith(("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")):
            grad = grad.t()  # HF's Conv1D stores these transposed
        expected[name] = grad
    assert_close_relative(gradients(ours), expected, rel=1e-5)


def test_bf16_autocast_matches_the_plain_bf16_path_within_bf16_tolerance():
    model = tiny_model()
    idx, targets = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, targets)
    loss.backward()
    chunked = gradients(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss = plain_loss(model, idx, targets)
    expected_loss.backward()
    expected = gradients(model)

    assert loss.dtype == torch.float32  # the log-sum-exp is in fp32 whatever the matmul ran in
    assert all(g.dtype == torch.float32 for g in chunked.values())  # gradients in the parameters' dtype
    # Both paths round the logits to bf16 (8 bits of mantissa, 0.4 %); the chunked one sums wte's gradient over
    # chunks in fp32, so the two differ by a few bf16 roundings.
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-3)
    assert_close_relative(chunked, expected, rel=2e-2)


def test_fp16_with_grad_scaler_gives_the_unscaled_gradients_of_the_plain_fp16_path():
    def scaled_step(loss_fn) -> dict[str, torch.Tensor]:
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model)
        scaler.scale(loss).backward()  # the loss function's backward gets grad_output = 4096
        scaler.unscale_(optimizer)
        return gradients(model)

    idx, targets = batch()
    chunked = scaled_step(lambda model: model(idx, targets)[1])
    expected = scaled_step(lambda model: plain_loss(model, idx, targets))
    assert_close_relative(chunked, expected, rel=5e-3)  # fp16 keeps 11 bits of mantissa


def test_gradients_match_when_wrapped_in_ddp(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(tiny_model())  # find_unused_parameters=False: every gradient must arrive
        idx, targets = batch()
        for _ in range(2):  # a missed gradient hook fails the second step's reducer check
            _, loss = model(idx, targets)
            loss.backward()
            ddp = gradients(model.module)
    finally:
        teardown_distributed()
    plain = tiny_model()
    plain_loss(plain, idx, targets).backward()
    assert_close_relative(ddp, gradients(plain), rel=1e-5)


@pytest.mark.slow
def test_compiled_model_matches_eager():
    model = tiny_model()
    idx, targets = batch()
    _, eager_loss = model(idx, targets)
    eager_loss.backward()
    eager = gradients(model)

    compiled = torch.compile(model)  # dynamo traces the autograd.Function's forward and backward
    _, loss = compiled(idx, targets)
    loss.backward()
    assert loss.item() == pytest.approx(eager_loss.item(), rel=1e-5)
    assert_close_relative(gradients(model), eager, rel=1e-5)
