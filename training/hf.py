"""Hugging Face's GPT-2 and ours: the same parameters and names but for Conv1D (transposed) and our padded vocabulary.
from_pretrained imports, a directory's files checked first (local_config: transformers would start a missing weight
from random numbers); tools/export_hf.py exports, leaving a record (read_export_record)."""

import json
from pathlib import Path

import torch

from model import GPT, GPTConfig
from rundir.snapshot import read_torch_file
from training.errors import UserError
from training.files import version_problem
from training.parsing import PARSE_ERRORS, parse_problem

# Hugging Face's GPT-2 stores these linear layers as Conv1D modules, whose weights are nn.Linear's transposed.
HF_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# The causal-mask buffers some versions of transformers saved among the weights (OpenAI's files on the hub hold them).
CAUSAL_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
# The config.json keys of the model's shape, and the settings our GPT-2 has one way only (OpenAI's): another value
# describes another function than our model computes.
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
EXPORT_RECORD = "export_hf.json"  # in an export: {"version", "snapshot", "files", "tokenizer"}, what it wrote there
EXPORT_VERSION = 2


def gpt_config(hf: dict, where: str = "the Hugging Face config") -> GPTConfig:
    """Our shape of a Hugging Face GPT-2 config.json's dict; a UserError naming `where` if our GPT-2 cannot be it."""
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
    """The shape of a save_pretrained directory's GPT-2, its weight file checked; UserError naming a bad file."""
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
    """UserError naming the weight file unless it holds every weight of `config`'s GPT-2, of its shape, and no other,
    under GPT2LMHeadModel's names or (OpenAI's files) its transformer's; lm_head.weight, tied to wte, may be missing."""
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
    """The weight file from_pretrained would load, and its (every shard's) tensors' shapes, no tensor loaded."""
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
    """A pytorch_model.bin's tensor shapes, read as our snapshots are (no code run), as meta tensors (no memory)."""
    try:
        state = read_torch_file(path, PYTORCH_WEIGHT_FILE, map_location="meta")
    except ValueError as e:  # its message names the file and what is wrong with it
        raise UserError(f"{e} {WHAT_LOADS}") from e
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UserError(f"{path} is not a state dict (a dict of tensor names to tensors), as save_pretrained writes. "
                        f"{WHAT_LOADS}")
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def from_pretrained(name_or_dir: str) -> GPT:
    """Hugging Face GPT-2 weights: a hub name (gpt2, ..., gpt2-xl) or a save_pretrained directory (checked first)."""
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
    """A GPT2LMHeadModel's weights into `model` (hf_state_dict's inverse); the padding rows of wte stay as they are."""
    ours = model.state_dict()
    with torch.no_grad():
        for name, tensor in hf_state.items():
            if name.endswith(CAUSAL_MASK_BUFFERS) or name == "lm_head.weight":  # (lm_head is tied to wte)
                continue
            target = ours[name][: tensor.shape[0]] if name == "transformer.wte.weight" else ours[name]
            target.copy_(tensor.t() if name.endswith(HF_CONV1D_WEIGHTS) else tensor)


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


def read_export_record(directory: Path, fix: str) -> dict:
    """The record export_hf.py left in `directory`; UserError ending with `fix` if malformed or another version."""
    record = directory / EXPORT_RECORD
    try:
        recorded = json.loads(record.read_bytes())
    except PARSE_ERRORS as e:
        raise UserError(f"{record} is {parse_problem(e)}, so {directory} is no export of this tool. {fix}") from e
    problem = version_problem(recorded, EXPORT_VERSION, "export records")
    if problem or not isinstance(recorded.get("files"), list) or not isinstance(recorded.get("tokenizer"), dict):
        raise UserError(f"{record} {problem or 'lists no files or no tokenizer'}, so {directory} is no export this "
                        f"tool reads. {fix}")
    return recorded
