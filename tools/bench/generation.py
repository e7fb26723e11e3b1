"""Generation's speed (not a command: tools/bench.py --generation and tools/gpu_check.py share it): GPT.generate with
the key/value cache, and compiled, against a whole-context forward per token."""

import time

import torch

from model import GPT, GPTConfig, sample_next_token
from training.distributed import synchronize


def format_generation(g: dict) -> str:
    """time_generation's figures in a line: each run's tokens/s (past the second token for the cached ones)."""
    speed = g["tokens_per_sec"]
    cached = ", ".join(f"{speed[name]:,.1f} tokens/s {name.replace('_', ' ')} ({decode:,.1f} past the second token)"
                       for name, decode in g["decode_tokens_per_sec"].items())
    return (f"{cached}; {speed['without_cache']:,.1f} without the cache; {g['best_cached'].replace('_', ' ')} "
            f"{g['speedup']:.1f}x as fast as without; same tokens: {g['same_tokens']}")


def time_generation(config: GPTConfig, device: torch.device, new_tokens: int, prompt_tokens: int = 16,
                    compile: bool = False) -> dict:
    """Tokens/s of GPT.generate (with compile, also with its decode step compiled) and of a whole-context forward per
    token (one sample, top-k 50, the same seed), and whether they all gave the same tokens. With the cache, also the
    tokens/s of the steps after the second token: what is left once the prompt is read and (on CUDA) the decode step
    captured, costs that a longer generation amortises. best_cached names the faster run with the cache; speedup is
    its tokens/s over the run without."""
    torch.manual_seed(0)
    model = GPT(config).to(device).eval()
    idx = torch.randint(0, config.vocab_size, (1, prompt_tokens), device=device)

    def timed(run, n: int) -> tuple[torch.Tensor, float]:
        synchronize(device)
        t0 = time.perf_counter()
        out = run(n, torch.Generator(device=device).manual_seed(42))
        synchronize(device)
        return out, time.perf_counter() - t0

    runs = {"with_cache": lambda n, g: model.generate(idx, n, 1.0, 50, generator=g),
            "without_cache": lambda n, g: generate_without_cache(model, idx, n, 50, g)}
    if compile:
        runs["with_cache_compiled"] = lambda n, g: model.generate(idx, n, 1.0, 50, generator=g, compile=True)
    outputs, tokens_per_sec, decode_tokens_per_sec = {}, {}, {}
    for name, run in runs.items():
        timed(run, 2)  # untimed: CUDA's kernels load at their first call, and a compiled step compiles
        outputs[name], seconds = timed(run, new_tokens)
        tokens_per_sec[name] = new_tokens / seconds
        if name != "without_cache":
            _, first_two = timed(run, 2)
            decode_tokens_per_sec[name] = (new_tokens - 2) / (seconds - first_two)
    best_cached = max(decode_tokens_per_sec, key=tokens_per_sec.get)
    return {"new_tokens": new_tokens, "tokens_per_sec": tokens_per_sec, "decode_tokens_per_sec": decode_tokens_per_sec,
            "best_cached": best_cached, "speedup": tokens_per_sec[best_cached] / tokens_per_sec["without_cache"],
            "same_tokens": all(torch.equal(out, outputs["without_cache"]) for out in outputs.values())}


@torch.no_grad()
def generate_without_cache(model: GPT, idx: torch.Tensor, max_new_tokens: int, top_k: int,
                           generator: torch.Generator) -> torch.Tensor:
    """Generation without the key/value cache: every token from a forward over the whole context."""
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.block_size:])
        idx = torch.cat((idx, sample_next_token(logits[:, -1].float(), 1.0, top_k, None, generator)), dim=1)
    return idx
