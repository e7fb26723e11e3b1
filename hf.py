"""Hugging Face's GPT-2 and ours: the same parameters under the same names (transformer.h.0.attn.c_attn, ...), but for
the Conv1D layers, whose weights are nn.Linear's transposed, and our vocabulary padded to a multiple of 128. Import
(from_pretrained: a hub name or a save_pretrained directory) and export (to_hf: a GPT2LMHeadModel, which
save_pretrained writes as safetensors) both go through this mapping. An arch="modern" model exports as a
Qwen3ForCausalLM, the standard class with the same parts (qwen3_state_dict). transformers is imported where it is
used, so training from scratch does not need it.
"""

import torch

from model import GPT, NORM_EPS, ROPE_THETA, GPTConfig

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


def qwen3_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """An arch="modern" model's weights under Qwen3ForCausalLM's names: our fused matrices split into its q/k/v and
    gate/up projections, and the padding rows of the vocabulary dropped."""
    ours, cfg = model.state_dict(), model.config
    hf_state = {"model.embed_tokens.weight": ours["transformer.wte.weight"][: cfg.vocab_size],
                "model.norm.weight": ours["transformer.ln_f.weight"],
                "lm_head.weight": ours["lm_head.weight"][: cfg.vocab_size]}
    for i in range(cfg.n_layer):
        block, layer = f"transformer.h.{i}.", f"model.layers.{i}."
        q, k, v = ours[block + "attn.c_attn.weight"].split(cfg.n_embd)
        gate, up = ours[block + "mlp.c_fc.weight"].split(model.transformer.h[i].mlp.hidden)
        hf_state |= {layer + "input_layernorm.weight": ours[block + "ln_1.weight"],
                     layer + "self_attn.q_proj.weight": q, layer + "self_attn.k_proj.weight": k,
                     layer + "self_attn.v_proj.weight": v,
                     layer + "self_attn.q_norm.weight": ours[block + "attn.q_norm.weight"],
                     layer + "self_attn.k_norm.weight": ours[block + "attn.k_norm.weight"],
                     layer + "self_attn.o_proj.weight": ours[block + "attn.c_proj.weight"],
                     layer + "post_attention_layernorm.weight": ours[block + "ln_2.weight"],
                     layer + "mlp.gate_proj.weight": gate, layer + "mlp.up_proj.weight": up,
                     layer + "mlp.down_proj.weight": ours[block + "mlp.c_proj.weight"]}
        if cfg.attention_bias:
            q, k, v = ours[block + "attn.c_attn.bias"].split(cfg.n_embd)
            hf_state |= {layer + "self_attn.q_proj.bias": q, layer + "self_attn.k_proj.bias": k,
                         layer + "self_attn.v_proj.bias": v,
                         layer + "self_attn.o_proj.bias": ours[block + "attn.c_proj.bias"]}
    return {name: tensor.contiguous().clone() for name, tensor in hf_state.items()}


def to_qwen3(model: GPT):
    """A Qwen3ForCausalLM holding an arch="modern" model's weights: the same decoder (rotary positions paired half a
    head apart, RMSNorm on each head's queries and keys, SwiGLU, untied embeddings, biases on attention only)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = model.config
    hf_config = Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=model.transformer.h[0].mlp.hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
        head_dim=cfg.n_embd // cfg.n_head, max_position_embeddings=cfg.block_size, rms_norm_eps=NORM_EPS,
        hidden_act="silu", tie_word_embeddings=False, attention_bias=cfg.attention_bias, bos_token_id=50256,
        eos_token_id=50256)
    # The rotary base: a config field whose name changed between transformers versions (rope_theta, then
    # rope_parameters), with the same default as ours, checked here rather than set.
    theta = getattr(hf_config, "rope_parameters", None) or {"rope_theta": getattr(hf_config, "rope_theta", None)}
    if theta["rope_theta"] != ROPE_THETA:
        raise ValueError(f"this transformers' Qwen3Config has rotary base {theta['rope_theta']}, ours {ROPE_THETA}")
    hf_model = Qwen3ForCausalLM(hf_config)
    hf_model.load_state_dict(qwen3_state_dict(model))  # strict: a name or shape mismatch fails here
    return hf_model.eval()


def to_hf(model: GPT):
    """A GPT2LMHeadModel holding our weights (a Qwen3ForCausalLM for arch="modern", see to_qwen3)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if model.config.arch == "modern":
        return to_qwen3(model)
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
