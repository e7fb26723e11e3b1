"""The loss regime of the architecture comparison: what a count-based bigram model scores on the same val tokens.

    python -m dev.bigram                              # data/enwiki, the 65,536 val tokens the comparison validates on
    python -m dev.bigram --data_dir data/shakespeare --val_tokens 8192

A model that has learned only which token follows which scores about this; the comparison's final val losses
(docs/architectures.md) are read against it. The bigram is fitted on every train token, with interpolated absolute
discounting (Kneser and Ney's discount of 0.75 for every seen pair, its mass given to the unigram distribution,
itself add-one smoothed so that an unseen token costs a finite loss), and scored on the first val_tokens next-token
predictions of the val stream, as train_gpt2.py's validation reads it (each target after the token before it).
"""

import argparse

import numpy as np

from dataloader import HEADER_BYTES, TOKEN_DTYPE, find_shards, read_shard_header

VOCAB = 50257
DISCOUNT = 0.75


def read_tokens(data_dir: str, split: str) -> np.ndarray:
    return np.concatenate([np.fromfile(path, dtype=TOKEN_DTYPE, offset=HEADER_BYTES, count=read_shard_header(path))
                           for path in find_shards(data_dir, split)]).astype(np.int64)


def unigram_probabilities(train: np.ndarray, vocab: int = VOCAB) -> np.ndarray:
    return (np.bincount(train, minlength=vocab) + 1) / (train.size + vocab)


def bigram_loss(train: np.ndarray, val: np.ndarray, vocab: int = VOCAB, discount: float = DISCOUNT) -> float:
    """Mean cross-entropy (nats) of val's next tokens under the bigram fitted on train."""
    pairs, pair_counts = np.unique(train[:-1] * vocab + train[1:], return_counts=True)
    unigram = unigram_probabilities(train, vocab)
    context_counts = np.bincount(train[:-1], minlength=vocab)
    followers = np.bincount(pairs // vocab, minlength=vocab)  # distinct tokens seen after each token
    previous, target = val[:-1], val[1:]
    seen = np.minimum(np.searchsorted(pairs, previous * vocab + target), pairs.size - 1)
    count = np.where(pairs[seen] == previous * vocab + target, pair_counts[seen], 0)
    context = context_counts[previous]
    backoff = np.where(context > 0, discount * followers[previous] / np.maximum(context, 1), 1.0)
    probability = np.maximum(count - discount, 0) / np.maximum(context, 1) + backoff * unigram[target]
    return float(-np.log(probability).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="data/enwiki")
    parser.add_argument("--val_tokens", type=int, default=65_536)
    args = parser.parse_args()
    train, val = read_tokens(args.data_dir, "train"), read_tokens(args.data_dir, "val")[:args.val_tokens + 1]
    unigram = float(-np.log(unigram_probabilities(train)[val[1:]]).mean())
    print(f"{args.data_dir}: a bigram fitted on {train.size:,} train tokens scores {bigram_loss(train, val):.4f} on "
          f"{val.size - 1:,} val predictions (the unigram alone: {unigram:.4f})")


if __name__ == "__main__":
    main()
