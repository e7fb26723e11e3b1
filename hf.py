"""Hugging Face's GPT-2 and ours: the same parameters under the same names (transformer.h.0.attn.c_attn, ...), but for
the Conv1D layers, whose weights are nn.Linear's transposed, and our vocabulary padded to a multiple of 128. Import
(from_pretrained: a hub name or a save_pretrained directory) and export (to_hf: a GPT2LMHeadModel, which
save_pretrained writes as safetensors) both go through this mapping. transformers is imported where it is used, so
training from scratch does not need it.
"""

import torch

from model import GPT, GPTConfig

# Hugging Face's GPT-2 stores these linear layers as Conv1D modules, whose weights are nn.Linear's transposed.
HF_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt_config(hf: dict) -> GPTConfig:
    """Our shape of a Hugging Face GPT-2 config (a config.json, or GPT2Config.to_dict())."""
    return GPTConfig(block_size=hf["n_positions"], vocab_size=hf["vocab_size"], n_layer=hf["n_layer"],
                     n_head=hf["n_head"], n_embd=hf["n_embd"])


def from_pretrained(name_or_dir: str) -> GPT:
    """Load Hugging Face GPT-2 weights: a hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a local
    directory written by transformers' save_pretrained."""
    from transformers import GPT2LMHeadModel  # only needed here, so not a hard dependency

    hf_model = GPT2LMHeadModel.from_pretrained(name_or_dir)
    model = GPT(gpt_config(hf_model.config.to_dict()))
    load_hf_state_dict(model, hf_model.state_dict())
    return model


def load_hf_state_dict(model: GPT, hf_state: dict[str, torch.Tensor]) -> None:
    ours = model.state_dict()
    # Skip the causal-mask buffers some versions save, and lm_head, which GPT-2 ties to wte.
    hf_state = {k: v for k, v in hf_state.items()
                if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"}
    if set(ours) - {"lm_head.weight"} != set(hf_state):
        raise ValueError("Hugging Face weights do not match GPT-2's parameters: missing "
                         f"{sorted(set(ours) - set(hf_state) - {'lm_head.weight'})}, unexpected "
                         f"{sorted(set(hf_state) - set(ours))}")
    with torch.no_grad():
        for name, tensor in hf_state.items():
            if name.endswith(HF_CONV1D_WEIGHTS):
                tensor = tensor.t()
            target = ours[name]
            if name == "transformer.wte.weight":
                target = target[: tensor.shape[0]]  # the padded vocabulary rows stay as initialised
            if target.shape != tensor.shape:
                raise ValueError(f"Hugging Face parameter {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under Hugging Face GPT2LMHeadModel's names and layouts (the inverse of load_hf_state_dict)."""
    hf_state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        if name == "transformer.wte.weight":
            tensor = tensor[: model.config.vocab_size]
        if name.endswith(HF_CONV1D_WEIGHTS):
            tensor = tensor.t()
        hf_state[name] = tensor.contiguous().clone()
    hf_state["lm_head.weight"] = hf_state["transformer.wte.weight"]
    return hf_state


def to_hf(model: GPT):
    """A GPT2LMHeadModel holding our weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = model.config
    hf_config = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_ctx=cfg.block_size,
        n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
        activation_function="gelu_new",  # the tanh approximation of GELU, as in our MLP
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default
        # Our model has no dropout; zero here means fine-tuning in transformers continues the same way.
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=50256, eos_token_id=50256,
    )
    hf_model = GPT2LMHeadModel(hf_config)
    hf_model.load_state_dict(hf_state_dict(model))  # strict: a name or shape mismatch fails here, not later
    return hf_model.eval()
