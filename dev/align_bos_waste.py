"""--align_bos's cost in tokens: the share of a train shard's tokens that packing.pack_rows crops (in no row), at
several sequence lengths, with long documents cut into row-sized pieces (the loader's packing) and without (every
row strictly starting at a document's first token, the rest of a long document dropped), against the stream cut
into rows that each start at the next document (no packing: the tail of every row's last document dropped). Also
the share of rows that start at a document's first token, and the packing time. The figures of docs/data.md's
--align_bos section.

    python -m data.prepare --input ../shared/data/enwiki/enwiki.jsonl.gz \\
        --val_input ../shared/data/enwiki/enwiki_val.jsonl.gz --output_dir data/enwiki
    python -m dev.align_bos_waste --shard data/enwiki/enwiki_train_000000.bin --seq_len 256 512 1024 2048
"""

import argparse
import time
from pathlib import Path

import numpy as np

from dataloader import Shard, read_data_tokenizer, read_shard_layout
from training.packing import document_starts, pack_rows


def unpacked_cropped(starts: np.ndarray, num_tokens: int, row_len: int) -> int:
    """Tokens in no row when each row is the row_len tokens from a document's start and the next row starts at the
    first document starting after it: the rest of the document a row ends in is dropped."""
    covered, position = 0, int(starts[0])
    while position + row_len <= num_tokens:
        covered += row_len
        following = np.searchsorted(starts, position + row_len)
        if following == starts.size:
            break
        position = int(starts[following])
    return num_tokens - covered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard", required=True)
    parser.add_argument("--seq_len", type=int, nargs="+", default=[256, 512, 1024, 2048])
    args = parser.parse_args()
    num_tokens, dtype = read_shard_layout(args.shard)
    tokens = Shard(args.shard, num_tokens, dtype).read(0, num_tokens)
    eot = read_data_tokenizer(Path(args.shard).parent).eot
    starts = document_starts(tokens, eot)
    lengths = np.diff(np.append(starts, tokens.size))
    print(f"{args.shard}: {tokens.size:,} tokens, {starts.size:,} documents, median {np.median(lengths):,.0f} "
          f"tokens, mean {lengths.mean():,.0f}")
    print("seq_len | cropped (long documents in pieces) | rows starting a document | cropped (strict) | "
          "cropped (unpacked) | pack s")
    for seq_len in args.seq_len:
        t0 = time.perf_counter()
        rows, cropped = pack_rows(tokens, seq_len + 1, eot)
        seconds = time.perf_counter() - t0
        starting = np.isin([row[0, 0] for row in rows], starts).mean()
        _, strict = pack_rows(tokens, seq_len + 1, eot, split_long=False)
        unpacked = unpacked_cropped(starts, tokens.size, seq_len + 1)
        print(f"{seq_len:7d} | {cropped / tokens.size:34.1%} | {starting:24.1%} | {strict / tokens.size:16.1%} | "
              f"{unpacked / tokens.size:18.1%} | {seconds:.2f}")


if __name__ == "__main__":
    main()
