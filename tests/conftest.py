"""Shared test fixtures: the offline data beside the project (../shared/data) and tiny shard directories."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("SHARED_DATA", ROOT.parent / "shared" / "data"))
TIKTOKEN_CACHE = SHARED_DATA / "gpt2_tokenizer" / "tiktoken_cache"
sys.path.insert(0, str(ROOT))

# Test models are tiny: a second intra-op thread only adds spin-waiting on the 2 shared cores, never speed.
torch.set_num_threads(1)

# tiktoken reads the GPT-2 tokenizer from this cache instead of downloading it (tests never touch the network).
if TIKTOKEN_CACHE.is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data, or skip: the tests that need real data say so instead of passing without checking."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"needs the offline data in {SHARED_DATA} (set SHARED_DATA to its location)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def gpt2_encoding(shared_data):
    import tiktoken
    if not TIKTOKEN_CACHE.is_dir():
        pytest.skip(f"needs the GPT-2 tokenizer cache in {TIKTOKEN_CACHE}")
    return tiktoken.get_encoding("gpt2")


def make_shards(directory: Path, split: str, sizes: list[int], seed: int = 0, vocab: int = 50257) -> list[np.ndarray]:
    """Write random-token shards of the given sizes; returns their token arrays (for checking what was read)."""
    from dataloader import write_shard
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = []
    for i, n in enumerate(sizes):
        tokens = rng.integers(0, vocab, size=n, dtype=np.int64)
        write_shard(directory / f"test_{split}_{i:06d}.bin", tokens)
        arrays.append(tokens)
    return arrays
