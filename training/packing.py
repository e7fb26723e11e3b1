"""Document-aligned rows for the data loader's align_bos=True (dataloader.py): every row starts at a document's first
token, the token after an EOT (or a shard's first token, unless that is an EOT), or continues a document longer than
a row.

pack_rows packs a shard's documents into rows of T+1 tokens (x and its shifted y): best fit from a window of the next
PACK_WINDOW documents, the largest that fits the row's space left; when none fits, the shortest is cropped to fill the
row and its rest dropped. A document longer than a row is first cut into rows of its own, each continuing it, and a
shorter tail that ends a row started by another document. No token is padding; the share cropped is pack_rows' second
result (dev/align_bos_waste.py measures it on enwiki).
"""

import bisect

import numpy as np

PACK_WINDOW = 1000  # documents pack_rows chooses from: a wider window wastes less and packs slower


def document_starts(tokens: np.ndarray, eot: int) -> np.ndarray:
    """Where the shard's documents start: after each EOT (the data's tokenizer's), and at 0 unless the shard opens
    with an EOT."""
    starts = np.flatnonzero(tokens[:-1] == eot) + 1
    return starts if tokens[0] == eot else np.concatenate([[0], starts])


def pack_rows(tokens: np.ndarray, row_len: int, eot: int, split_long: bool = True) -> tuple[list[np.ndarray], int]:
    """Best-fit packing of the shard's documents into rows of row_len tokens (see the module doc).

    A document longer than a row is cut into row_len pieces and a shorter tail (split_long; without it, cropped
    like any document that does not fit): its first piece is a row starting at its first token, each later piece a
    row of its own continuing it, and the tail fills the end of a row that starts with another document, never a
    row's start. Returns (rows, cropped): rows[i] is row i's (start, length) pieces of `tokens` in order, an int64
    array (pieces, 2), and cropped the number of the shard's tokens in no row. Deterministic: it depends only on
    the tokens, row_len, split_long and eot (the data's tokenizer's <|endoftext|>).
    """
    starts = document_starts(tokens, eot)
    lengths = np.diff(np.append(starts, tokens.size))
    # (length, start) sorted, ties to the later start: documents (may start a row) and tails (may not)
    documents: list[tuple[int, int]] = []
    tails: list[tuple[int, int]] = []
    next_document, rows, row, space = 0, [], [], row_len
    while True:
        # (tails cannot start a row: a window of only tails reads on)
        while (len(documents) + len(tails) < PACK_WINDOW or not documents) and next_document < starts.size:
            start, length = int(starts[next_document]), int(lengths[next_document])
            next_document += 1
            if split_long and length > row_len:
                rows += [[(piece, row_len)] for piece in range(start, start + length - row_len + 1, row_len)]
                start, length = start + length // row_len * row_len, length % row_len
                if length:
                    bisect.insort(tails, (length, start))
            else:
                bisect.insort(documents, (length, start))
        candidates = [documents] if space == row_len else [documents, tails]
        candidates = [units for units in candidates if units]
        if not candidates:
            break
        fits = [(units[i], units, i) for units in candidates
                if (i := bisect.bisect_right(units, (space, tokens.size)) - 1) >= 0]
        if fits:
            _, units, i = max(fits)
        else:  # nothing fits: crop the shortest
            _, units, i = min((units[0], units, 0) for units in candidates)
        length, start = units.pop(i)
        taken = min(length, space)
        row.append((start, taken))
        space -= taken
        if space == 0:
            rows.append(row)
            row, space = [], row_len
    return [np.array(row, dtype=np.int64) for row in rows], tokens.size - len(rows) * row_len
