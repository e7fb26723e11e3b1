"""GPT-2's tokenizer, the one every part of the code uses (shards, bits per byte, HellaSwag, samples), and text through
the model: a prompt in, sampled continuations out (generate_text, around model.GPT.generate).

tiktoken downloads the tokenizer's files on first use, into its cache ($TIKTOKEN_CACHE_DIR); offline, point that at
a copy (README, "tiktoken without network").
"""

import functools

import tiktoken
import torch

from errors import UserError
from model import GPT


@functools.cache  # one per process: data/tokenize_shards.py's pool workers build their own on first use
def gpt2_encoding() -> tiktoken.Encoding:
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken downloads the files on first use: anything from DNS to HTTP errors
        reason = (str(e).strip().splitlines() or [""])[0]
        raise UserError(f"the GPT-2 tokenizer could not be loaded ({type(e).__name__}: {reason}): tiktoken "
                        "downloads its two files on first use into its cache. On a node without network, set "
                        "TIKTOKEN_CACHE_DIR to a copy of that cache (README, \"tiktoken without network\"; "
                        "../shared/data/gpt2_tokenizer/tiktoken_cache holds one), or run once where there is "
                        "network.") from e


def generate_text(model: GPT, prompt: str, num_samples: int = 4, max_new_tokens: int = 32,
                  temperature: float = 1.0, top_k: int | None = 50, seed: int = 42,
                  top_p: float | None = None, compile: bool = False) -> list[str]:
    """num_samples continuations of prompt, each returned with the prompt in front.

    Runs on the device the model's weights are on. The generator is private, so sampling neither reads nor
    advances the global RNG: calling this in the middle of training leaves the training run unchanged.
    An empty prompt samples from <|endoftext|>, i.e. the start of a new document. compile: see GPT.generate.
    """
    enc = gpt2_encoding()
    prompt_tokens = enc.encode(prompt, allowed_special={"<|endoftext|>"}) or [enc.eot_token]
    device = next(model.parameters()).device
    idx = torch.tensor(prompt_tokens, dtype=torch.long, device=device).repeat(num_samples, 1)  # (B, T)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
                         compile=compile)
    return [prompt + enc.decode(row[len(prompt_tokens):].tolist()) for row in out]
