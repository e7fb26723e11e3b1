"""The chunked cross-entropy of training/loss.py (ChunkedLinearCrossEntropy): the same loss and gradients as full
logits + F.cross_entropy, and Hugging Face's GPT-2, in fp32, bf16 and fp16 with a GradScaler, compiled and under DDP,
without ever building the (tokens × vocab) logits."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GPT2Config, GPT2LMHeadModel

from fp8_emulation import cpu_scaled_mm_problem, emulated_fp8_loss, fp8_case, reference_scaled_mm, relative_error
from model import GPT, GPTConfig
from training import hf
from training.distributed import teardown_distributed
from training.loss import linear_cross_entropy, loss_chunk_tokens

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


def loss_and_gradients(model: torch.nn.Module, idx: torch.Tensor,
                       targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    _, loss = model(idx, targets)
    loss.backward()
    return loss.detach(), gradients(model)


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

    loss, chunked = loss_and_gradients(model, idx, targets)
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
    eager_loss, eager = loss_and_gradients(model, idx, targets)
    compiled = torch.compile(model)  # dynamo traces the autograd.Function's forward and backward
    _, loss = compiled(idx, targets)
    loss.backward()
    assert loss.item() == pytest.approx(eager_loss.item(), rel=1e-5)
    assert_close_relative(gradients(model), eager, rel=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# --fp8_head: the output layer's matmuls through torch._scaled_mm, which torch 2.13 runs on the CPU too


def fp8_loss_and_grads(x, weight, targets, fp8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast("cpu", torch.bfloat16):
        loss = linear_cross_entropy(x, weight, targets, 1000, 32, fp8=fp8)
    loss.backward()
    grads = x.grad.float(), weight.grad.float()
    x.grad = weight.grad = None
    return loss.detach(), *grads


@pytest.fixture(params=["cpu_kernel", "reference"])
def scaled_mm(request, monkeypatch) -> None:
    """torch._scaled_mm as this CPU's oneDNN kernel runs it (skipped, saying why, where it has none: AVX2-only CPUs)
    and as a reference in plain fp32 arithmetic (on every CPU), so no host leaves the FP8 head's path untested."""
    if request.param == "reference":
        monkeypatch.setattr(torch, "_scaled_mm", reference_scaled_mm)
    elif (problem := cpu_scaled_mm_problem()) is not None:
        pytest.skip(problem)


def test_the_fp8_head_gives_the_loss_and_gradients_of_its_quantised_operands(scaled_mm):
    x, weight, targets = fp8_case()
    loss, grad_x, grad_w = fp8_loss_and_grads(x, weight, targets, fp8=True)
    expected_loss, expected_x, expected_w = emulated_fp8_loss(x.detach(), weight.detach(), targets, 1000)
    bf16_loss, bf16_x, bf16_w = fp8_loss_and_grads(x, weight, targets, fp8=False)
    # torch._scaled_mm against the emulation: the same roundings, summed in another order (measured with the CPU's
    # kernel: 1e-7 and 4e-7; a bf16 logit or an e5m2 gradient entry that rounded the other way would show as 1e-3 or
    # more).
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-5)
    errors = relative_error(grad_x, expected_x), relative_error(grad_w, expected_w)
    assert max(errors) < 1e-4, errors
    # And FP8 is what ran: the bf16 path is far from the emulation (measured: 5e-2 and 4e-2).
    bf16_errors = relative_error(bf16_x, expected_x), relative_error(bf16_w, expected_w)
    assert min(bf16_errors) > 100 * max(errors), (errors, bf16_errors)
    assert abs(bf16_loss.item() - loss.item()) < 1e-2  # the quantisation costs little in the loss itself


class ScaledMatmuls:
    """torch._scaled_mm, recording each call's operand dtypes, out dtype and fast accumulation, and asserting what
    CUDA's kernel requires but the CPU's does not: the first operand row-major, the second column-major, every
    dimension a multiple of 16, not both operands e5m2, each scale a single fp32 number."""

    def __init__(self):
        self.real, self.calls = torch._scaled_mm, []

    def __call__(self, a, b, scale_a, scale_b, out_dtype=None, use_fast_accum=False, **kwargs):
        assert a.stride(1) == 1 and b.stride(0) == 1, (a.stride(), b.stride())
        assert all(d % 16 == 0 for d in (*a.shape, *b.shape)), (a.shape, b.shape)
        assert torch.float8_e5m2 not in (a.dtype,) or b.dtype != torch.float8_e5m2
        assert all(s.dtype == torch.float32 and s.numel() == 1 for s in (scale_a, scale_b))
        self.calls.append((a.dtype, b.dtype, out_dtype, use_fast_accum))
        return self.real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum,
                         **kwargs)


def test_the_fp8_matmuls_take_the_operands_as_cudas_kernel_requires(scaled_mm, monkeypatch):
    recorder = ScaledMatmuls()
    monkeypatch.setattr(torch, "_scaled_mm", recorder)
    x, weight, targets = fp8_case()
    fp8_loss_and_grads(x, weight, targets, fp8=True)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    per_chunk = [(e4m3, e4m3, torch.bfloat16, True),  # the logits: fast accumulation, as modded-nanogpt's forward
                 (e5m2, e4m3, torch.bfloat16, False),  # the gradient of x, in the autocast dtype
                 (e5m2, e4m3, torch.float32, False)]  # the gradient of the weight, summed over chunks in fp32
    assert recorder.calls == per_chunk * 3  # 96 tokens in chunks of 32


def test_validation_with_the_fp8_head_runs_in_the_autocast_dtype(monkeypatch):
    # Without gradients (validation), the loss measures the weights: no FP8 rounding of the logits.
    recorder = ScaledMatmuls()
    monkeypatch.setattr(torch, "_scaled_mm", recorder)
    x, weight, targets = fp8_case()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        fp8 = linear_cross_entropy(x, weight, targets, 1000, 32, fp8=True)
        plain = linear_cross_entropy(x, weight, targets, 1000, 32)
    assert recorder.calls == [] and fp8.item() == plain.item()


def test_the_fp8_head_refuses_a_cpu_an_older_gpu_and_another_dtype_naming_the_flag(monkeypatch):
    from training.errors import UserError
    from training.fp8 import check_fp8_head, fp8_head_problem

    assert "CUDA GPU with FP8 tensor cores" in fp8_head_problem(torch.device("cpu"), torch.bfloat16)
    # CUDA's answers faked (this torch build has none), both sides of sm89: an A100 and an H100.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda", 0)
    assert "compute capability 8.9 or later" in fp8_head_problem(cuda, torch.bfloat16)
    assert "A100-SXM4-80GB has 8.0" in fp8_head_problem(cuda, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_head_problem(cuda, torch.bfloat16) is None
    assert "--dtype is float16" in fp8_head_problem(cuda, torch.float16)
    check_fp8_head(cuda, torch.bfloat16, 64 * 1024, 768)
    with pytest.raises(UserError, match=r"^--fp8_head: its FP8 matmuls need .* multiples of 16\. Leave --fp8_head out"):
        check_fp8_head(cuda, torch.bfloat16, 64 * 1000 + 8, 768)
    with pytest.raises(UserError, match=r"^--fp8_head: it needs a CUDA GPU with FP8 tensor cores .* on cpu\."):
        check_fp8_head(torch.device("cpu"), torch.bfloat16, 1024, 768)


@pytest.mark.slow  # a few seconds: train_gpt2.py's start
def test_train_gpt2_with_fp8_head_on_a_cpu_exits_2_in_one_line(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT, make_shards
    from helpers_train import train_env

    make_shards(tmp_path / "data", "train", [4000])
    command = [sys.executable, "train_gpt2.py", "--model", "tiny", "--device", "cpu", "--fp8_head", "--dtype", "bf16",
               "--data_dir",
               str(tmp_path / "data"), "--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "32",
               "--max_steps", "1", "--val_every", "0", "--sample_every", "0", "--eval_every", "0",
               "--log_dir", str(tmp_path / "logs")]
    proc = subprocess.run(command, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --fp8_head: it needs a CUDA GPU with FP8 tensor cores") and "Traceback" not in \
        proc.stderr


# ----------------------------------------------------------------------------------------------------------------
# dev/loss_schedules.py: where the compiled chunk loop runs, the candidates for compiled memory


def test_every_loss_schedule_gives_trainings_loss_and_gradients_uncompiled_and_then_leaves_it_as_it_was():
    from dev.loss_schedules import loss_schedule
    from training import loss

    # Uncompiled, "eager" and "grad_w_op" run the same ops as training's loop (the op adds the same product in place);
    # "compiled_chunks" compiles its chunks even here, so it is checked with the compiled ones.
    model = tiny_model()
    idx, targets = batch()
    expected_loss, expected = loss_and_gradients(model, idx, targets)
    training_loop = loss.ChunkedLinearCrossEntropy, loss.cross_entropy_chunk, loss.add_weight_gradient
    for schedule in ("eager", "grad_w_op"):
        with loss_schedule(schedule):
            scheduled, grads = loss_and_gradients(model, idx, targets)
        assert scheduled.item() == expected_loss.item(), schedule
        assert all(torch.equal(grads[name], expected[name]) for name in expected), schedule
    assert (loss.ChunkedLinearCrossEntropy, loss.cross_entropy_chunk, loss.add_weight_gradient) == training_loop
    with pytest.raises(ValueError, match="loss schedule 'fused' is none of inline, grad_w_op, eager, compiled_chunks"):
        with loss_schedule("fused"):
            pass


def test_the_leanest_schedule_peaks_lowest_within_5_percent_of_inlines_time():
    from dev.loss_schedules import leanest_schedule

    schedules = {"inline": {"ms": 30.0, "peak_bytes": 9e9}, "grad_w_op": {"ms": 31.0, "peak_bytes": 2e9},
                 "eager": {"ms": 45.0, "peak_bytes": 1e9}, "compiled_chunks": {"ms": 31.4, "peak_bytes": 1.5e9}}
    assert leanest_schedule(schedules) == "compiled_chunks"  # eager peaks lower, but takes 1.5x as long
    assert leanest_schedule({"inline": schedules["inline"], "eager": schedules["eager"]}) is None
    off_cuda = {name: s | {"peak_bytes": None} for name, s in schedules.items()}
    assert leanest_schedule(off_cuda) == "grad_w_op"  # no peaks: the fastest


@pytest.mark.slow  # about a minute: three compilations of the loss alone
def test_every_compiled_loss_schedule_gives_eagers_loss_and_gradients_and_inline_holds_every_product():
    from dev.loss_schedules import SCHEDULES, loss_schedule
    from tools.bench.loss_memory import buffers_alive, generated_code, loss_function, loss_inputs, loss_step

    vocab, chunk = 1000, 128
    inputs = loss_inputs(512, 64, 1024, vocab, torch.device("cpu"))  # 4 chunks
    eager = loss_step(loss_function(vocab, chunk, compile=False), *inputs, torch.bfloat16)
    products = {}
    for schedule in SCHEDULES:
        with loss_schedule(schedule):
            loss_fn = loss_function(vocab, chunk, compile=True)
            codes = generated_code(loss_fn, *inputs, torch.bfloat16)
            loss_value, grad_x, grad_w = loss_step(loss_fn, *inputs, torch.bfloat16)
        assert loss_value == pytest.approx(eager[0], rel=1e-5), schedule
        assert relative_error(grad_x, eager[1]) < 1e-3 and relative_error(grad_w, eager[2]) < 1e-3, schedule
        alive = [buffers_alive(code).most_alive for code in codes]
        products[schedule] = max((n for counts in alive for (shape, dtype), n in counts.items()
                                  if shape == (1024, 64) and dtype == "bfloat16"), default=0)
        assert all(n <= 1 for counts in alive for (shape, _), n in counts.items() if shape == (chunk, 1024)), schedule
    # Inline, Inductor keeps every chunk's bf16 product of the weight's gradient for one fused sum at the end (the
    # bf16 cast of the weight shares its shape); in an op of its own, each is added and freed in turn.
    assert products["inline"] >= 4 and products["grad_w_op"] <= 1
    assert products["eager"] == 0  # nothing compiled: the loss stays out of the graph
