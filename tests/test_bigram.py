"""dev/bigram.py: the count-based bigram is a distribution, and scores by hand's arithmetic."""

import math

import numpy as np

from dev.bigram import bigram_loss


def test_the_bigram_sums_to_one_after_every_token_and_matches_the_formula_by_hand():
    train, vocab = np.array([0, 1, 0, 1, 0, 2, 2]), 4  # token 3 never seen; 2 is seen after 0 and after 2
    # exp(-loss) of the two-token stream [a, b] is P(b | a): every pair, so each context's row must sum to 1.
    rows = [[math.exp(-bigram_loss(train, np.array([a, b]), vocab)) for b in range(vocab)] for a in range(vocab)]
    assert np.allclose([sum(row) for row in rows], 1.0)
    # P(1 | 0): 0 is followed by 1, 1, 2 (3 times, 2 distinct tokens), so (2 - 0.75) / 3 + 0.75 * 2 / 3 * P(1), with
    # P(1) = (2 + 1) / (7 + 4) from add-one counts.
    assert math.isclose(rows[0][1], (2 - 0.75) / 3 + 0.75 * 2 / 3 * 3 / 11)
    assert math.isclose(rows[3][1], 3 / 11)  # a token never seen before anything: the unigram alone
