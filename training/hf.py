"""Hugging Face's GPT-2 and ours: the same parameters under the same names (transformer.h.0.attn.c_attn, ...), but for
the Conv1D layers, whose weights are nn.Linear's transposed, and our vocabulary padded to a multiple of 128. Import
(from_pretrained: a hub name or a save_pretrained directory) and export (to_hf: a GPT2LMHeadModel, which
save_pretrained writes as safetensors) both go through this mapping. A local directory's files are checked before
transformers reads them (local_config): transformers starts a weight missing from the file from random numbers, with a
warning, and goes on. An arch="modern" model exports as a Qwen3ForCausalLM, the standard class with the same parts
(qwen3_state_dict). transformers is imported where it is used, so training from scratch does not need it.
"""

import json
from pathlib import Path

import torch

from model import GPT, NORM_EPS, ROPE_THETA, GPTConfig
from rundir.snapshot import read_torch_file
from training.errors import UserError
from training.parsing import PARSE_ERRORS, parse_problem
from training.tokenizer import gpt2_spec

# Hugging Face's GPT-2 stores these linear layers as Conv1D modules, whose weights are nn.Linear's transposed.
HF_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# The causal-mask buffers some versions of transformers saved among the weights (OpenAI's files on the hub hold them).
CAUSAL_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
# The config.json keys of the model's shape, and the settings our GPT-2 has one way only (OpenAI's): a config with
# another value describes another function, which these weights in our model would not compute.
SHAPE_KEYS = ("n_positions", "vocab_size", "n_layer", "n_head", "n_embd")
OPENAI_SETTINGS = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "layer_norm_epsilon": (1e-5,),
                   "tie_word_embeddings": (True,), "scale_attn_weights": (True,),
                   "scale_attn_by_inverse_layer_idx": (False,), "add_cross_attention": (False,)}
# The weight files from_pretrained looks for in a directory, in its order of preference (an index: sharded).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# What read_torch_file calls a pytorch_model.bin, and the fix its refusal of one ends with.
PYTORCH_WEIGHT_FILE = ("a PyTorch weight file", "Get these weights as model.safetensors, which holds tensors only, "
                       "from where they came from, or convert a copy you trust to it (save_pretrained writes "
                       "model.safetensors).")
WHAT_LOADS = ("Pass a directory that transformers' save_pretrained wrote for a GPT2LMHeadModel, or gpt2, gpt2-medium, "
              "gpt2-large or gpt2-xl (downloaded on first use).")


def gpt_config(hf: dict, where: str = "the Hugging Face config") -> GPTConfig:
    """Our shape of a Hugging Face GPT-2 config (a config.json, or GPT2Config.to_dict()); a UserError naming `where`
    if it is not one our GPT-2 can be."""
    problem = config_problem(hf)
    if problem:
        raise UserError(f"{where}: {problem}. {WHAT_LOADS}")
    return GPTConfig(block_size=hf["n_positions"], vocab_size=hf["vocab_size"], n_layer=hf["n_layer"],
                     n_head=hf["n_head"], n_embd=hf["n_embd"])


def config_problem(hf) -> str | None:
    if not isinstance(hf, dict):
        return f"a JSON {type(hf).__name__}, not an object of settings"
    if hf.get("model_type") != "gpt2":
        return f"model_type {hf.get('model_type')!r}; only GPT-2 (model_type 'gpt2') weights fit this model"
    for key in SHAPE_KEYS:
        if key not in hf:
            return f"no {key} (save_pretrained writes it)"
        if not isinstance(hf[key], int) or isinstance(hf[key], bool) or hf[key] < 1:
            return f"{key} {hf[key]!r}, not a whole number of 1 or more"
    if hf["n_embd"] % hf["n_head"]:
        return f"n_embd {hf['n_embd']} is not a multiple of n_head {hf['n_head']}"
    for key, values in OPENAI_SETTINGS.items():
        if key in hf and hf[key] not in values:
            return f"{key} {hf[key]!r}, where this GPT-2 has {' or '.join(map(repr, values))}"
    return None


def local_config(directory: Path) -> GPTConfig:
    """The shape of the GPT-2 in a save_pretrained directory, read from its config.json, with the weight file that
    from_pretrained loads checked against it. UserError naming the file if either is not what it should be."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise UserError(f"{directory} has no config.json, so it is not a Hugging Face model directory (save_pretrained "
                        f"writes one). {WHAT_LOADS}")
    try:
        hf = json.loads(config_file.read_bytes())
    except OSError as e:
        raise UserError(f"{config_file} could not be read ({e.strerror}). {WHAT_LOADS}") from e
    except PARSE_ERRORS as e:
        raise UserError(f"{config_file} is {parse_problem(e)}. {WHAT_LOADS}") from e
    config = gpt_config(hf, str(config_file))
    check_weight_file(directory, config)
    return config


def check_weight_file(directory: Path, config: GPTConfig) -> None:
    """UserError naming the weight file unless it holds every weight of `config`'s GPT-2, of its shape, and no other
    (the causal-mask buffers of older files aside). Names are GPT2LMHeadModel's or, as in OpenAI's files, its
    transformer's; lm_head.weight, tied to the token embedding, may be left out."""
    path, found = weight_shapes(directory)
    with torch.device("meta"):  # the shapes alone: no memory, however large the model
        expected = {name: tuple(tensor.shape) for name, tensor in hf_state_dict(GPT(config)).items()}
    ours = {(name if name.startswith("transformer.") or name == "lm_head.weight" else "transformer." + name): name
            for name in found if not name.endswith(CAUSAL_MASK_BUFFERS)}
    missing = [name for name in expected if name not in ours and name != "lm_head.weight"]
    unexpected = [name for our_name, name in ours.items() if our_name not in expected]
    reshaped = [f"{ours[name]} {list(found[ours[name]])}, not {list(shape)}" for name, shape in expected.items()
                if name in ours and found[ours[name]] != shape]
    problems = [f"{description}: {first_few(names)}" for description, names in (
        (f"{len(missing)} of its {len(expected) - 1} weights missing", missing),
        (f"{len(unexpected)} tensors it does not have", unexpected),
        (f"{len(reshaped)} of another shape", reshaped)) if names]
    if problems:
        raise UserError(f"{path} does not hold the GPT-2 weights its config.json describes (n_layer {config.n_layer}, "
                        f"n_head {config.n_head}, n_embd {config.n_embd}, n_positions {config.block_size}, vocab_size "
                        f"{config.vocab_size}): {'; '.join(problems)}. Loaded as it is, the model would train from "
                        f"random numbers where weights are missing. {WHAT_LOADS}")


def first_few(names: list[str], few: int = 3) -> str:
    return ", ".join(names[:few]) + (f" and {len(names) - few} more" if len(names) > few else "")


def weight_shapes(directory: Path) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """The weight file from_pretrained would load from `directory`, and the name and shape of every tensor in it
    (in every shard it lists, if it is an index), read without loading a tensor."""
    path = next((directory / name for name in WEIGHT_FILES if (directory / name).is_file()), None)
    if path is None:
        raise UserError(f"{directory} holds no weight file ({', '.join(WEIGHT_FILES)}); save_pretrained writes "
                        f"model.safetensors beside config.json. {WHAT_LOADS}")
    shapes = {}
    for file in index_shards(path) if path.name.endswith(".index.json") else [path]:
        shapes |= safetensors_shapes(file) if file.suffix == ".safetensors" else torch_file_shapes(file)
    return path, shapes


def index_shards(index: Path) -> list[Path]:
    """The shard files a sharded checkpoint's index names (its weight_map's values), beside it."""
    try:
        names = set(json.loads(index.read_bytes())["weight_map"].values())
    except PARSE_ERRORS as e:
        raise UserError(f"{index} is {parse_problem(e)}. {WHAT_LOADS}") from e
    except (KeyError, TypeError, AttributeError) as e:  # not {"weight_map": {tensor name: file name}}
        raise UserError(f"{index} has no weight_map of tensor names to shard files, as save_pretrained writes. "
                        f"{WHAT_LOADS}") from e
    # A plain file name only: a path could reach out of the directory.
    if not all(isinstance(name, str) and name and Path(name).name == name for name in names):
        raise UserError(f"{index} names shard files outside its directory ({first_few(sorted(map(str, names)))}); "
                        f"save_pretrained writes them beside it. {WHAT_LOADS}")
    return [index.parent / name for name in sorted(names)]


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open  # installed with transformers

    try:
        with safe_open(path, framework="pt") as f:  # reads the header alone
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path} could not be read as a safetensors file ({e}); it is truncated, corrupt or not one. "
                        f"{WHAT_LOADS}") from e


def torch_file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """A pytorch_model.bin's tensors, read as our snapshots are (snapshot.read_torch_file: no code is run), as meta
    tensors, which take no memory."""
    try:
        state = read_torch_file(path, PYTORCH_WEIGHT_FILE, map_location="meta")
    except ValueError as e:  # its message names the file and what is wrong with it
        raise UserError(f"{e} {WHAT_LOADS}") from e
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UserError(f"{path} is not a state dict (a dict of tensor names to tensors), as save_pretrained writes. "
                        f"{WHAT_LOADS}")
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def from_pretrained(name_or_dir: str) -> GPT:
    """Load Hugging Face GPT-2 weights: a hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a local
    directory written by transformers' save_pretrained (its files checked first: local_config)."""
    from transformers import GPT2LMHeadModel  # only needed here, so not a hard dependency

    if Path(name_or_dir).is_dir():
        local_config(Path(name_or_dir))
    try:
        hf_model = GPT2LMHeadModel.from_pretrained(name_or_dir)
    except OSError as e:  # what transformers raises for no network or an unknown name
        raise UserError(f"{name_or_dir}: the Hugging Face weights could not be loaded "
                        f"({str(e).strip().splitlines()[0]}). On a node without network, save them where there is "
                        "one with GPT2LMHeadModel.from_pretrained(name).save_pretrained(directory) and pass that "
                        f"directory. {WHAT_LOADS}") from e
    model = GPT(gpt_config(hf_model.config.to_dict()))
    load_hf_state_dict(model, hf_model.state_dict())
    return model


def load_hf_state_dict(model: GPT, hf_state: dict[str, torch.Tensor]) -> None:
    ours = model.state_dict()
    # Skip the causal-mask buffers some versions save, and lm_head, which GPT-2 ties to wte.
    hf_state = {k: v for k, v in hf_state.items() if not k.endswith(CAUSAL_MASK_BUFFERS) and k != "lm_head.weight"}
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


def to_qwen3(model: GPT, eot: int = gpt2_spec().eot):
    """A Qwen3ForCausalLM holding an arch="modern" model's weights: the same decoder (rotary positions paired half a
    head apart, RMSNorm on each head's queries and keys, SwiGLU, untied embeddings, biases on attention only)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = model.config
    hf_config = Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=model.transformer.h[0].mlp.hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
        head_dim=cfg.n_embd // cfg.n_head, max_position_embeddings=cfg.block_size, rms_norm_eps=NORM_EPS,
        hidden_act="silu", tie_word_embeddings=False, attention_bias=cfg.attention_bias, bos_token_id=eot,
        eos_token_id=eot)
    # The rotary base: a config field whose name changed between transformers versions (rope_theta, then
    # rope_parameters), with the same default as ours, checked here rather than set.
    theta = getattr(hf_config, "rope_parameters", None) or {"rope_theta": getattr(hf_config, "rope_theta", None)}
    if theta["rope_theta"] != ROPE_THETA:
        raise ValueError(f"this transformers' Qwen3Config has rotary base {theta['rope_theta']}, ours {ROPE_THETA}")
    hf_model = Qwen3ForCausalLM(hf_config)
    hf_model.load_state_dict(qwen3_state_dict(model))  # strict: a name or shape mismatch fails here
    return hf_model.eval()


def to_hf(model: GPT, eot: int = gpt2_spec().eot):
    """A GPT2LMHeadModel holding our weights (a Qwen3ForCausalLM for arch="modern", see to_qwen3); eot: the id of
    its tokenizer's <|endoftext|>, the config's bos and eos (GPT-2's by default)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if model.config.arch == "modern":
        return to_qwen3(model, eot)
    cfg = model.config
    hf_config = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_ctx=cfg.block_size,
        n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
        activation_function="gelu_new",  # the tanh approximation of GELU, as in our MLP
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default
        # Our model has no dropout; zero here means fine-tuning in transformers continues the same way.
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=eot, eos_token_id=eot,
    )
    hf_model = GPT2LMHeadModel(hf_config)
    hf_model.load_state_dict(hf_state_dict(model))  # strict: a name or shape mismatch fails here, not later
    return hf_model.eval()
