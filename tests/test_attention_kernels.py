"""attention_kernels.py: naming the attention kernel a step ran from its profile, choosing one for a device (with a
fallback where it is missing), and torch.compile keeping the kernel in force when it traced the step."""

import pytest
import torch

from model import GPT, GPTConfig
from tools.bench.step import profiled
from training.attention_kernels import attention_kernel, available_kernels, kernels_in_profile, resolve_kernel

HOPPER, AMPERE, ADA = (9, 0), (8, 0), (8, 9)


def test_the_profiles_aten_ops_name_the_kernel_forward_and_backward_eager_or_on_the_cpu():
    assert kernels_in_profile(["aten::_scaled_dot_product_flash_attention"]) == ["flash"]
    assert kernels_in_profile(["aten::_scaled_dot_product_flash_attention_backward"]) == ["flash"]
    assert kernels_in_profile(["aten::_scaled_dot_product_flash_attention_for_cpu"]) == ["flash"]
    assert kernels_in_profile(["aten::_scaled_dot_product_cudnn_attention_backward"]) == ["cudnn"]
    assert kernels_in_profile(["aten::_scaled_dot_product_efficient_attention"]) == ["efficient"]
    assert kernels_in_profile(["aten::_efficient_attention_forward"]) == ["efficient"]
    assert kernels_in_profile(["aten::_scaled_dot_product_attention_math"]) == ["math"]
    assert kernels_in_profile(["aten::scaled_dot_product_attention"]) == []  # the dispatcher's entry, not a kernel
    assert kernels_in_profile(["aten::mm", "flash_fwd_kernel"]) == []  # (the latter a CUDA kernel's name)
    names = ["aten::mm", "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_attention_math",
             "aten::_scaled_dot_product_cudnn_attention_backward"]
    assert kernels_in_profile(names) == ["cudnn", "math"]


def test_the_choice_on_each_device_and_its_fallback_where_a_kernel_is_missing():
    everything = {"flash", "cudnn", "efficient", "math"}
    assert resolve_kernel("default", HOPPER, everything) == (None, "torch's own order")
    # auto: cuDNN's on Hopper (where it was timed 0.68x flash's), torch's order before Hopper or without cuDNN 9
    assert resolve_kernel("auto", HOPPER, everything) == ("cudnn", "auto: cudnn")
    assert resolve_kernel("auto", ADA, everything)[0] is None
    assert resolve_kernel("auto", HOPPER, everything - {"cudnn"})[0] is None
    assert resolve_kernel("auto", None, {"flash", "math"})[0] is None  # not CUDA
    assert resolve_kernel("auto", AMPERE, everything) == (
        None, "auto: torch's own order (no kernel preferred on this device)")
    assert resolve_kernel("cudnn", HOPPER, everything) == ("cudnn", "cudnn")
    assert resolve_kernel("cudnn", AMPERE, everything - {"cudnn"}) == ("flash",
                                                                       "cudnn does not run here: flash instead")
    assert resolve_kernel("cudnn", None, {"math"}) == ("math", "cudnn does not run here: math instead")
    assert resolve_kernel("flash", (7, 5), {"efficient", "math"})[0] == "efficient"  # a T4: no flash kernel
    assert resolve_kernel("math", HOPPER, set()) == (None, "math does not run here: torch's own order instead")
    with pytest.raises(ValueError, match="'fa3' is none of default, auto, flash, cudnn, efficient, math"):
        resolve_kernel("fa3", HOPPER, everything)


def test_on_a_cpu_flash_and_math_run_and_a_kernel_put_first_is_the_one_that_runs():
    assert {"flash", "math"} <= available_kernels(torch.device("cpu"), torch.float32, 16)
    assert "cudnn" not in available_kernels(torch.device("cpu"), torch.float32, 16)
    model, idx = tiny_model_and_batch()
    assert ran(model, idx) == ["flash"]  # torch's own order
    with attention_kernel("math"):
        assert ran(model, idx) == ["math"]
    with attention_kernel("cudnn"):  # not on a CPU: its fallbacks in order, flash first
        assert ran(model, idx) == ["flash"]


def tiny_model_and_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=97, n_layer=1, n_head=2, n_embd=16)
    return GPT(config), torch.randint(0, 97, (2, 16))


def ran(step_model: torch.nn.Module, idx: torch.Tensor) -> list[str]:
    """The attention kernels of one forward and backward of step_model."""
    def step() -> None:
        step_model(idx, idx)[1].backward()
    return profiled(step, kernel_table=False)[1]


@pytest.mark.slow  # two compilations of a one-layer model: about a minute on two cores
def test_a_compiled_step_keeps_the_kernel_in_force_when_it_was_traced():
    model, idx = tiny_model_and_batch()
    with attention_kernel("math"):
        compiled = torch.compile(model)
        assert ran(compiled, idx) == ["math"]  # traced here (the profile sees the tracing's ops too)
    # Outside the context the compiled code still runs the math kernel, which Inductor wrote out as its own matmuls
    # and softmax: no fused kernel's op, and not flash (torch.compile does not guard on the choice).
    assert ran(compiled, idx) == []
    torch._dynamo.reset()
    compiled = torch.compile(model)  # traced under torch's own order
    assert ran(compiled, idx) == ran(compiled, idx) == ["flash"]
