"""GPT-2, written from scratch, in the order data flows through it; and, with GPTConfig(arch="modern"), the same
decoder with the parts that models trained since 2023 share (see ModernAttention and SwiGLU). Parameter names follow
Hugging Face's GPT-2, so that weights load and export by name (training/hf.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from training.loss import linear_cross_entropy, loss_chunk_tokens


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # query, key, value for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALED_INIT = True

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, positions: torch.Tensor | None = None,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.c_attn(x).unflatten(-1, (3, self.n_head, -1)).permute(2, 0, 3, 1, 4)  # each (B, nh, T, hs)
        return self.c_proj(attend(q, k, v, kv_cache, positions, visible))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache | None, positions: torch.Tensor | None,
           visible: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of q, k, v (B, nh, T, hs), cached or not; returns the heads' outputs side by side, (B, T, C)."""
    if kv_cache is None:  # a whole sequence (training, evaluation)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention where the device has it
    else:  # new tokens against every cached position; visible (T, max_len) says which each one may see
        k, v = kv_cache.write(positions, k, v)
        # Plain matmuls: for one query the fused kernels waste their tiles (on an H100, 124 µs a layer in the
        # memory-efficient kernel, the one that takes a mask; a whole 124M decode step 1.0 ms instead of 2.1).
        with sdpa_kernel(SDPBackend.MATH):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    return y.transpose(1, 2).flatten(2)  # (B, T, nh, hs) -> (B, T, nh·hs)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # the approximation GPT-2 was trained with
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALED_INIT = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: the residual stream itself is never normalised."""

    # --activation_checkpointing's recomputation of residual_branches (training/recompute.py); None: keep activations
    recompute: Callable | None = None

    def __init__(self, config: GPTConfig):
        super().__init__()
        modern = config.arch == "modern"  # (the parts of arch="modern" are below)
        self.ln_1 = norm(config, config.n_embd)
        self.attn = (ModernAttention if modern else CausalSelfAttention)(config)
        self.ln_2 = norm(config, config.n_embd)
        self.mlp = (SwiGLU if modern else MLP)(config)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, positions: torch.Tensor | None = None,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        # Inside forward, so that fsdp's hooks around the block gather its weights outside the recomputed part, before
        # the forward and again before the backward.
        if self.recompute is not None and self.training and torch.is_grad_enabled():
            return self.recompute(self.residual_branches, x, positions)
        return self.residual_branches(x, kv_cache, positions, visible)

    def residual_branches(self, x: torch.Tensor, kv_cache: KVCache | None = None,
                          positions: torch.Tensor | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, positions, visible)
        return x + self.mlp(self.ln_2(x))


# ----------------------------------------------------------------------------------------------------------------
# arch="modern": what decoders since GPT-2 changed (Llama, Qwen3, modded-nanogpt; docs/architectures.md): rotary
# positions, RMSNorm, QK-norm, a SwiGLU MLP, biases on attention's projections only, zero-initialised output
# projections, untied embeddings; laid out as Qwen3, so that it exports as a Qwen3ForCausalLM with the same logits.

ROPE_THETA = 10_000.0  # rotary base: the wavelengths run from 2π to 2π·10,000 positions, plenty for 1,024
NORM_EPS = 1e-6


def rotation_table(max_len: int, head_size: int) -> torch.Tensor:
    """(2, max_len, head_size) fp32 cos and sin: rotate turns channels (i, i + hs/2) at position p by p · θ^(−2i/hs)."""
    inv_freq = ROPE_THETA ** -(torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq).repeat(1, 2)  # (max_len, hs)
    return torch.stack((angles.cos(), angles.sin()))


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) of x (B, nh, T, hs) by rotation_table's rows at its positions, so
    that a query–key dot product depends only on how far apart the two tokens are (pairs as Hugging Face's Qwen)."""
    cos, sin = rotation.to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class ModernAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        head_size = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.q_norm = norm(config, head_size)  # QK-norm, per head, before the rotation
        self.k_norm = norm(config, head_size)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_proj.ZERO_INIT = True
        # Computed once here: in forward, Inductor recomputed them for every element of q and k (modern's step took
        # 1.156x GPT-2's on an H100 instead of 1.011x). Constants: not in state_dict.
        self.register_buffer("rotation", rotation_table(config.block_size, head_size), persistent=False)
        if config.attention_bias:  # on q, k, v and the output; zeros made here, so the weights' draws stay the same
            for linear in (self.c_attn, self.c_proj):
                linear.bias = nn.Parameter(torch.zeros(linear.out_features))

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, positions: torch.Tensor | None = None,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.c_attn(x).unflatten(-1, (3, self.n_head, -1)).unbind(2)  # each (B, T, nh, hs)
        # Normalised in fp32 (as Qwen3 does; under autocast c_attn's output is bf16, and its gain fp32)
        q, k = self.q_norm(q.float()).type_as(v), self.k_norm(k.float()).type_as(v)
        rotation = self.rotation[:, positions]
        q, k, v = rotate(q.transpose(1, 2), rotation), rotate(k.transpose(1, 2), rotation), v.transpose(1, 2)
        return self.c_proj(attend(q, k, v, kv_cache, positions, visible))


class SwiGLU(nn.Module):
    """silu(x·W_gate) ⊙ (x·W_up), then down (Shazeer 2020). The hidden width is 8/3 of n_embd (rounded up to a multiple
    of 64), so that its three matrices hold as many weights as GPT-2's two at 4×."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.hidden = swiglu_hidden_size(config.n_embd)
        self.c_fc = nn.Linear(config.n_embd, 2 * self.hidden, bias=False)  # gate and up, one matmul
        self.c_proj = nn.Linear(self.hidden, config.n_embd, bias=False)
        self.c_proj.ZERO_INIT = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.c_fc(x).split(self.hidden, dim=-1)
        return self.c_proj(F.silu(gate) * up)


def swiglu_hidden_size(n_embd: int) -> int:
    return math.ceil(8 * n_embd / 3 / 64) * 64


def norm(config: GPTConfig, size: int) -> nn.Module:
    """GPT-2's LayerNorm (mean and variance, gain and bias), or modern's RMSNorm (the scale alone, a gain, no bias)."""
    return nn.RMSNorm(size, eps=NORM_EPS) if config.arch == "modern" else nn.LayerNorm(size)


# ----------------------------------------------------------------------------------------------------------------
# the model

@dataclass(frozen=True)  # frozen: the presets below are shared, so nobody may change them in place
class GPTConfig:
    block_size: int = 1024  # longest context the model can see
    vocab_size: int = 50257  # 50,000 BPE merges + 256 byte tokens + <|endoftext|>
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    arch: str = "gpt2"  # or "modern" (see ModernAttention and SwiGLU)
    attention_bias: bool = False  # modern: biases on attention's projections (gpt2 has biases everywhere: ignored)

    @property
    def padded_vocab_size(self) -> int:
        # A multiple of 128, whose matmuls run faster on GPUs; the extra rows are never a target, nor in the logits.
        return math.ceil(self.vocab_size / 128) * 128


ARCHITECTURES = ("gpt2", "modern")

PRESETS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    # Small models for CPU, laptops and tests.
    "small": GPTConfig(block_size=256, n_layer=4, n_head=4, n_embd=256),
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64),
}


def with_arch(config: GPTConfig, arch: str, attention_bias: bool | None = None) -> GPTConfig:
    """config's shape as `arch`: modern has attention's biases unless attention_bias is False; gpt2 has them all."""
    return replace(config, arch=arch, attention_bias=arch == "modern" and attention_bias is not False)


class GPT(nn.Module):
    loss_chunk_tokens: int | None = None  # tokens per chunk of the loss; None: loss_chunk_tokens(the device)
    fp8_head: bool = False  # --fp8_head: the training loss's matmuls in FP8 (training/loss.py)

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        assert config.n_embd % config.n_head == 0, "n_embd must be a multiple of n_head"
        if config.arch not in ARCHITECTURES:
            raise ValueError(f"arch {config.arch!r} is none of {', '.join(ARCHITECTURES)}")
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(config.padded_vocab_size, config.n_embd)))  # tokens
        if config.arch == "gpt2":  # (modern rotates queries and keys by their positions instead)
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.transformer.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.transformer.ln_f = norm(config, config.n_embd)
        # (modern's untied output layer starts random too: zero, as in modded-nanogpt, it ended 0.07 higher in val loss)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.tie_weights()
        self.apply(self._init_weights)

    def tie_weights(self) -> None:
        # GPT-2 reads and writes a token with one matrix (38M parameters fewer at 124M); modern unties them: an input
        # row is a lookup, an output row a direction.
        if self.config.arch == "gpt2":
            self.lm_head.weight = self.transformer.wte.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.Linear) and getattr(module, "ZERO_INIT", False):
            # modern's output projections (their biases are zeros already): each block starts as the identity
            # (modded-nanogpt's; Muon's first update of a zero matrix is as large as of any other).
            nn.init.zeros_(module.weight)
        elif isinstance(module, nn.Linear):
            # Scaled, a block's two projections keep the residual stream's variance flat in depth (GPT-2, 2.3)
            scaled = getattr(module, "RESIDUAL_SCALED_INIT", False)
            nn.init.normal_(module.weight, std=0.02 * (2 * self.config.n_layer) ** -0.5 if scaled else 0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the lookup tables, which cost no FLOPs: GPT-2's position embeddings
        (its token embedding is also the output layer, so it does count) or modern's untied token embedding."""
        cfg, tied = self.config, self.config.arch == "gpt2"
        padding = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.n_embd * (1 if tied else 2)  # (output's, input's)
        lookup = self.transformer.wpe.weight.numel() if tied else cfg.vocab_size * cfg.n_embd
        return sum(p.numel() for p in self.parameters()) - padding - (lookup if non_embedding else 0)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (PaLM paper, appendix B): 6·N for the matmuls with the N weights, plus
        6·n_layer·2·seq_len·n_embd for attention's Q·Kᵀ and A·V (causal masking not subtracted, by convention)."""
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_embd * seq_len

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_caches: list[KVCache] | None = None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits, None) without targets; (None, mean loss) with targets, the logits never built (training/loss.py).
        With kv_caches (one per layer, see generate) idx holds the tokens at `positions` (T,), a tensor: CUDA graphs."""
        x = self.hidden_states(idx, kv_caches, positions)
        if targets is None:
            return self.logits(x), None  # (B, T, vocab)
        chunk_tokens = self.loss_chunk_tokens or loss_chunk_tokens(idx.device)
        return None, linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten(),
                                          self.config.vocab_size, chunk_tokens, fp8=self.fp8_head)

    def hidden_states(self, idx: torch.Tensor, kv_caches: list[KVCache] | None = None,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, n_embd): the final norm's output, which the LM head reads (evaluation/tasks.py: where it scores)."""
        T, block_size = idx.size(1), self.config.block_size
        if positions is None:
            if T > block_size:
                raise ValueError(f"sequence of length {T} is longer than the model's block_size {block_size}")
            positions = torch.arange(T, device=idx.device)
        # With caches, (T, block_size): cached position j is visible to the token at position p if j <= p
        visible = None if kv_caches is None else torch.arange(block_size, device=idx.device) <= positions[:, None]
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.config.arch == "gpt2":
            x = x + self.transformer.wpe(positions)
        for i, block in enumerate(self.transformer.h):
            x = block(x, kv_caches[i] if kv_caches else None, positions, visible)
        return self.transformer.ln_f(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(..., vocab) next-token scores from hidden states (..., n_embd); the padding columns dropped."""
        return self.lm_head(x)[..., : self.config.vocab_size]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None,
                 compile: bool = False) -> torch.Tensor:
        """idx (B, T) and max_new_tokens sampled tokens: the prompt read once into key/value caches, then each new token
        alone (DecodeStep, compile: torch.compiled); past block_size, a refill per step (docs/generation.md)."""
        block_size = self.config.block_size
        kv_caches = [KVCache(block_size) for _ in range(self.config.n_layer)]
        decode, filled = None, 0  # filled: the positions the caches hold
        for _ in range(max_new_tokens):
            if filled in (0, block_size):  # (re)fill the caches from the (last block_size) tokens
                filled = min(idx.size(1), block_size)
                logits, _ = self(idx[:, -filled:], kv_caches=kv_caches)  # at positions 0 .. filled - 1
            else:  # only the token sampled last
                decode = decode or DecodeStep(self, kv_caches, idx[:, -1:], filled, compile)
                logits = decode(idx[:, -1:], filled)
                filled += 1
            next_token = sample_next_token(logits[:, -1, :].float(), temperature, top_k, top_p, generator)
            idx = torch.cat((idx, next_token), dim=1)
        return idx

    def crop_block_size(self, block_size: int) -> None:
        """Shorten the context to block_size (a finetune on shorter sequences): keep the first position embeddings."""
        if block_size > self.config.block_size:
            raise ValueError(f"cannot crop block_size {self.config.block_size} to the longer {block_size}")
        self.config = replace(self.config, block_size=block_size)
        if self.config.arch == "gpt2":
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size].detach().clone())


# ----------------------------------------------------------------------------------------------------------------
# generation: the keys and values of the tokens so far kept per layer, one new token a step

class KVCache:
    """One attention layer's keys and values for max_len positions, allocated at the first write, then written in
    place: a generation step's shapes never change, so that a GPU can replay it as one CUDA graph (DecodeStep)."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.k = self.v = None  # each (B, nh, max_len, hs), from the first write

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) at positions (T,); returns the whole buffers, each (B, nh, max_len, hs)."""
        if self.k is None:
            B, nh, _, hs = k.shape
            # Zeros, not empty: a position not written yet is masked out of attention, but 0 × NaN would still be NaN.
            self.k, self.v = (k.new_zeros(B, nh, self.max_len, hs) for _ in range(2))
        self.k.index_copy_(2, positions, k)
        self.v.index_copy_(2, positions, v)
        return self.k, self.v


class DecodeStep:
    """One new token per row through the model and its caches; on CUDA captured once as a CUDA graph and replayed for
    each token (at batch 1 a 124M step's ~300 kernels take less time to run than to launch from Python)."""

    def __init__(self, model: GPT, kv_caches: list[KVCache], token: torch.Tensor, position: int,
                 compile: bool = False):
        self.token = token.clone()  # (B, 1)
        self.position = torch.tensor([position], device=token.device)
        # (torch.compile keeps its code with decode_forward's, so a later generation of the same shapes reuses it)
        forward = torch.compile(decode_forward, fullgraph=True) if compile else decode_forward
        self.step = lambda: forward(model, self.token, kv_caches, self.position)
        self.graph = None
        if token.device.type == "cuda":
            # A capture needs a warm-up run on a side stream first; the first real step's, it writes what that would.
            side = torch.cuda.Stream(token.device)
            side.wait_stream(torch.cuda.current_stream(token.device))
            with torch.cuda.stream(side):
                self.step()
            torch.cuda.current_stream(token.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.step()

    def __call__(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """The logits (B, 1, vocab) of token (B, 1) at position, written into the caches."""
        self.token.copy_(token)
        self.position.fill_(position)
        if self.graph is None:
            return self.step()
        self.graph.replay()
        return self.logits


def decode_forward(model: GPT, token: torch.Tensor, kv_caches: list[KVCache], position: torch.Tensor) -> torch.Tensor:
    return model(token, kv_caches=kv_caches, positions=position)[0]


def sample_next_token(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                      generator: torch.Generator | None) -> torch.Tensor:
    """The next token (B, 1) from logits (B, vocab): the likeliest at temperature 0, else sampled from softmax(logits /
    temperature) among the top_k likeliest and, of those, the nucleus of top_p (Holtzman et al. 2019)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # ([-1] would wait for the GPU)
        logits.masked_fill_(logits < kth_largest, -float("inf"))  # (a boolean index would sync with the GPU)
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = F.softmax(sorted_logits, dim=-1)
        # A token is out if the likelier ones already reach top_p; so the likeliest token is always in.
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        logits.masked_fill_(outside.scatter(1, order, outside), -float("inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
