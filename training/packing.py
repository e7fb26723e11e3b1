"""Document-aligned rows for the data loader's align_bos=True: a shard's documents packed best-fit into rows of T+1
tokens, cropping only when no document fits (docs/data.md, "--align_bos")."""

import bisect

import numpy as np

PACK_WINDOW = 1000  # documents pack_rows chooses from: a wider window wastes less and packs slower


def document_starts(tokens: np.ndarray, eot: int) -> np.ndarray:
    """Where the shard's documents start: after each EOT (the data's tokenizer's), and at 0 unless it opens with one."""
    starts = np.flatnonzero(tokens[:-1] == eot) + 1
    return starts if tokens[0] == eot else np.concatenate([[0], starts])


def pack_rows(tokens: np.ndarray, row_len: int, eot: int, split_long: bool = True) -> tuple[list[np.ndarray], int]:
    """Best-fit packing of the shard's documents into rows of row_len tokens: from the next PACK_WINDOW documents
    the largest that fits the row's space left, else the shortest cropped. A document longer than a row (split_long)
    is cut into rows of its own, its shorter tail left to end a row another document starts. Returns (rows, cropped):
    row i's (start, length) pieces of `tokens` (int64, (pieces, 2)), and the number of tokens in no row. It depends
    only on its arguments, so a resume rebuilds the same rows."""
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
        candidates = [units for units in ([documents] if space == row_len else [documents, tails]) if units]
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
