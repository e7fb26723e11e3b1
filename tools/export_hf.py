"""Export a snapshot of this codebase as a Hugging Face model directory: GPT-2 (GPT2LMHeadModel), or, for an
--arch modern run, Qwen3 (Qwen3ForCausalLM, the standard class with the same decoder), with its tokenizer.

    python -m tools.export_hf logs/run/model_19072.pt exported/ --tokenizer_dir ../shared/data/gpt2_tokenizer

The directory then loads anywhere transformers does (and what reads transformers' directories: vLLM, llama.cpp's
converter), with the same logits as our model:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported/")
    tokenizer = AutoTokenizer.from_pretrained("exported/")   # GPT-2's: only if --tokenizer_dir was given

GPT-2's tokenizer is OpenAI's files from --tokenizer_dir. Any other the run trained with (data/prepare.py
--tokenizer) is written from the snapshot's record of it as a tokenizer.json that gives our ids on any text: a
trained BPE as it is, bytes as a byte-level BPE without merges (id = the byte's value), another tiktoken encoding
converted by transformers' TikTokenConverter; the config's bos and eos ids are its <|endoftext|>.

Weights go through transformers' own save_pretrained (model.safetensors), so the layout is whatever the installed
transformers writes and reads, not a hand-made imitation of it.

The directory is written whole or not at all (replace_directory): beside it first, each file
fsynced, then swapped in; a full disk is an error naming it and leaves it as it was. It then holds exactly this
model's files and export_hf.json, the record of an export (training/hf.py's EXPORT_VERSION): what it wrote, which lets
a later export replace it, and the snapshot's tokenizer record, with which tools.sample, tools.evaluate --model and
train_gpt2.py --init_from read the directory (tokenizer.read_tokenizer). A directory that is not empty and not such an
export is refused: the export deletes nothing it did not write.
"""

import argparse
import json
import os
import re
import shutil
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import tiktoken
import torch
from safetensors import SafetensorError
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM
from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode

from model import GPT, NORM_EPS, ROPE_THETA
from rundir.snapshot import read_model
from training.errors import UserError, run_entry_point
from training.files import fsync_directory, raise_for
from training.hf import EXPORT_RECORD, EXPORT_VERSION, hf_state_dict, read_export_record
from training.tokenizer import EOT_TEXT, TiktokenTokenizer, Tokenizer, gpt2_spec, load_tokenizer_of, read_tokenizer


def replace_directory(path: str | Path, fill: Callable[[Path], None]) -> None:
    """Leave at `path` what it held before (or nothing) or the complete new directory, which fill(tmp) writes beside
    it; the old one is renamed aside, then removed (a crash between the renames leaves it as <name>.<pid>.old)."""
    path = Path(os.path.realpath(path))  # (".": a name to put the new one beside; a link: the directory it names)
    tmp, old = (path.with_name(f"{path.name}.{os.getpid()}.{end}") for end in ("tmp", "old"))
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # a dead process's of the same pid
        tmp.mkdir(parents=True)
        fill(tmp)
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        fsync_directory(tmp)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            old.rename(path)
        raise_for(path, tmp, e)
    shutil.rmtree(old, ignore_errors=True)
    fsync_directory(path.parent)


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


def write_tokenizer(tokenizer_dir: Path, out_dir: Path, model_max_length: int) -> None:
    """Copy OpenAI's GPT-2 tokenizer files under the names transformers looks for."""
    shutil.copyfile(tokenizer_dir / "encoder.json", out_dir / "vocab.json")  # token -> id
    shutil.copyfile(tokenizer_dir / "vocab.bpe", out_dir / "merges.txt")  # BPE merges, in rank order
    tokenizer_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length,
                        "bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT, "add_prefix_space": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """A non-GPT-2 tokenizer of ours as a Hugging Face tokenizer.json that gives our ids on any text, where
    "<|endoftext|>" is the EOT id (as our encode(allow_eot=True))."""
    if tokenizer.spec.kind == "hf":
        return tokenizer.spec.definition  # a tokenizer.json already: as it was trained
    if isinstance(tokenizer, TiktokenTokenizer):
        return TiktokenToHF(tokenizer.encoding).converted().to_str()
    # bytes: each byte a token, spelt by the byte-level alphabet (GPT-2's bytes_to_unicode) and none merged
    alphabet = bytes_to_unicode()
    bytes_level = HFTokenizer(models.BPE({alphabet[byte]: byte for byte in range(256)}, merges=[]))
    bytes_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bytes_level.decoder = decoders.ByteLevel()
    bytes_level.add_special_tokens([AddedToken(EOT_TEXT, special=True, normalized=False)])  # the next id: 256
    return bytes_level.to_str()


class TiktokenToHF(TikTokenConverter):
    """transformers' TikTokenConverter fed an encoding in memory instead of a .tiktoken file, with its special tokens
    at their own ids (the converter would number them after the ranks, and an encoding's ids may have gaps). Only
    <|endoftext|> is special, as in our encode(allow_eot=True): another special token's text is plain text."""

    def __init__(self, encoding: tiktoken.Encoding):
        super().__init__(encoding, pattern=encoding._pat_str, extra_special_tokens=[EOT_TEXT])

    def load_tiktoken_bpe(self, encoding: tiktoken.Encoding) -> dict[bytes, int]:
        return encoding._mergeable_ranks

    def extract_vocab_merges_from_model(self, encoding: tiktoken.Encoding):
        vocab, merges = super().extract_vocab_merges_from_model(encoding)
        return vocab | encoding._special_tokens, merges  # (special tokens are printable ASCII: spelt as they are)


def write_own_tokenizer(tokenizer_json: str, out_dir: Path, model_max_length: int) -> None:
    """A non-GPT-2 tokenizer as transformers' AutoTokenizer reads it: its tokenizer.json (hf_tokenizer_json), and a
    tokenizer_config.json whose PreTrainedTokenizerFast has <|endoftext|> as its bos and eos."""
    (out_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                        "bos_token": EOT_TEXT, "eos_token": EOT_TEXT}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def check_out_dir(out_dir: Path) -> None:
    """A UserError unless out_dir is missing, empty, or an earlier export of this tool holding only what it wrote
    (its EXPORT_RECORD lists that): the export replaces the directory whole."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} is a file; pass a directory to write the model into (created if missing).")
    present = sorted(path.name for path in out_dir.iterdir()) if out_dir.exists() else []
    if not present:
        return
    fix = (f"The export replaces {out_dir} whole, and deletes nothing it did not write: pass a new or empty "
           "directory, or move those files out.")
    if not (out_dir / EXPORT_RECORD).is_file():
        raise UserError(f"{out_dir} holds files ({', '.join(present[:3])}{', ...' if len(present) > 3 else ''}) "
                        f"and no {EXPORT_RECORD}, so it is no earlier export of this tool. {fix}")
    recorded = read_export_record(out_dir, fix)
    others = sorted(set(present) - set(recorded["files"]) - {EXPORT_RECORD})
    if others:
        raise UserError(f"{out_dir} is an earlier export, and also holds what it did not write: "
                        f"{', '.join(others)}. {fix}")


def save_weights(hf_model, out_dir: Path) -> None:
    """save_pretrained; safetensors' I/O errors (a full disk) as the OSError they are, which names the file."""
    try:
        hf_model.save_pretrained(out_dir)
    except SafetensorError as e:  # (its Rust I/O errors are no OSErrors: "... (os error 28)")
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(out_dir / "model.safetensors")) from e


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshot", type=Path, help="a snapshot_*.pt written by train_gpt2.py (or just its model)")
    parser.add_argument("out_dir", type=Path, help="directory to write (created if missing; an earlier export there "
                                                   "is replaced)")
    parser.add_argument("--tokenizer_dir", type=Path,
                        help="folder with OpenAI's GPT-2 encoder.json and vocab.bpe, e.g. shared/data/gpt2_tokenizer")
    args = parser.parse_args(argv)

    if args.tokenizer_dir is not None:
        missing = [n for n in ("encoder.json", "vocab.bpe") if not (args.tokenizer_dir / n).is_file()]
        if missing:
            parser.error(f"--tokenizer_dir {args.tokenizer_dir} lacks {' and '.join(missing)}. Point it at a folder "
                         "holding OpenAI's GPT-2 encoder.json and vocab.bpe (shared/data/gpt2_tokenizer has both).")
    # Before the snapshot is read: a file among its parents, a symlink loop or a name too long raise here, each an
    # OSError that errors.run_entry_point turns into one paragraph naming out_dir.
    with suppress(FileNotFoundError):  # (made once the model is read)
        os.stat(args.out_dir)
    check_out_dir(args.out_dir)
    try:
        model = read_model(args.snapshot)
        tokenizer = read_tokenizer(args.snapshot)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    own_tokenizer = tokenizer.sha256 != gpt2_spec().sha256
    if own_tokenizer and args.tokenizer_dir is not None:
        parser.error(f"--tokenizer_dir: {args.snapshot} was trained with the tokenizer {tokenizer.describe()}, not "
                     "GPT-2's, and that is written from the snapshot's record of it. Leave --tokenizer_dir out.")
    # Converted before anything is written: a tokenizer this node cannot have (a tiktoken encoding offline) stops here
    tokenizer_json = hf_tokenizer_json(load_tokenizer_of(args.snapshot)) if own_tokenizer else None

    def write(out_dir: Path) -> None:
        save_weights(to_hf(model, tokenizer.eot), out_dir)
        if tokenizer_json is not None:
            write_own_tokenizer(tokenizer_json, out_dir, model.config.block_size)
        elif args.tokenizer_dir is not None:
            write_tokenizer(args.tokenizer_dir, out_dir, model.config.block_size)
        record = {"version": EXPORT_VERSION, "snapshot": str(args.snapshot.resolve()),
                  "files": sorted(path.name for path in out_dir.iterdir()),
                  "tokenizer": tokenizer.to_dict() | {"definition": None}}  # (an "hf" one's: tokenizer.json)
        (out_dir / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")

    replace_directory(args.out_dir, write)
    print(f"wrote {args.out_dir}: {model.num_params(non_embedding=False):,} parameters, config {model.config}")
    if tokenizer_json is not None:
        print(f"wrote its tokenizer, {tokenizer.describe()}: tokenizer.json and tokenizer_config.json "
              "(AutoTokenizer.from_pretrained reads them)")
    elif args.tokenizer_dir is not None:
        print(f"wrote the GPT-2 tokenizer (vocab.json, merges.txt, tokenizer_config.json) from {args.tokenizer_dir}")
    else:
        print("the tokenizer was NOT included. To add it, rerun with --tokenizer_dir pointing at a folder holding "
              "OpenAI's encoder.json and vocab.bpe, or, online, run "
              f"AutoTokenizer.from_pretrained('gpt2').save_pretrained('{args.out_dir}').")


if __name__ == "__main__":
    run_entry_point(main)
