"""The n-gram proposer (prompt lookup): guess the next tokens by finding the sequence's newest
n tokens earlier in the sequence and proposing what followed them there.

Introduced in stage 12; its learner writes `propose_ngram`. It costs no model call, and it
guesses well where text repeats: code, edits of a given text, quoting, lists. Trace, k = 3,
n from 2 down to 1:

    tokens   5 8 2 7 9 8 2 | 7          suffix of 2: [2, 7] at positions 2..3 (and 6..7: itself)
                 ^^^^^                  propose what followed at 4..6: [9, 8, 2]

The newest earlier occurrence wins (it is the likeliest to continue the same way), longer
suffixes before shorter ones; nothing found proposes nothing and the step decodes one token.
"""

from __future__ import annotations

import torch

from nanoserve.types import Sequence

LOOKUP_WINDOW = 2048  # only the newest tokens are searched: the host's cost stays bounded


def propose_ngram(token_ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the newest earlier occurrence of the sequence's last n tokens
    (n from max_n down to min_n); [] when no suffix occurs earlier."""
    ids = token_ids[-LOOKUP_WINDOW:]
    last = len(ids) - 1
    # every earlier place the newest token occurs ends a candidate match (never the suffix
    # itself: the newest position is left out), found newest first by a C-speed list search
    earlier = ids[last - 1 :: -1] if last > 0 else []  # ids[last - 1], ..., ids[0]
    best_n, best_end, searched = 0, -1, 0
    while best_n < max_n:  # a match of max_n tokens cannot be beaten by an older one
        try:
            found = earlier.index(ids[last], searched)
        except ValueError:
            break
        end, searched = last - 1 - found, found + 1
        n = 1  # the match grows backwards while tokens agree
        while n < max_n and n <= end and ids[end - n] == ids[last - n]:
            n += 1
        if n > best_n:  # a longer match wins; of equal ones, the newest (found first)
            best_n, best_end = n, end
    if best_n < max(min_n, 1):
        return []
    return ids[best_end + 1 : best_end + 1 + k]


class NgramProposer:
    """Proposes by `propose_ngram` on the host; each guess is certain (q = one-hot). It may
    guess ahead: asked for more tokens than the budget, it looks past the tokens the step in
    flight will gain, and the device keeps what follows them (runner `resolve_ahead`)."""

    guesses_ahead = True

    def __init__(self, max_n: int, min_n: int, lookup=propose_ngram):
        self.max_n, self.min_n, self.lookup = max_n, min_n, lookup

    def propose(
        self, seqs: list[Sequence], budgets: tuple[int, ...]
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Up to budgets[b] guesses for seqs[b]; no draft distributions (None): every guess is
        certain."""
        guesses = [
            periodic(self.lookup(seq.token_ids, budget, self.max_n, self.min_n), seq, budget)
            if budget
            else []
            for seq, budget in zip(seqs, budgets)
        ]
        return guesses, None


def periodic(proposal: list[int], seq: Sequence, k: int) -> list[int]:
    """A proposal cut short by the sequence's end, carried on as the repeat it is.

    When what followed the match runs up to the newest token, the match sat len(proposal)
    tokens back and the text repeats with that period, so the guess goes round again:
    tokens ... 7 7 (match one back): [7] -> [7, 7, 7]; ... 4 5 4 5: [4, 5] -> [4, 5, 4].
    Guessing ahead needs this most: the newest tokens are still in flight, and the guesses
    start after them."""
    n = len(proposal)
    if 0 < n < k and seq.token_ids[-n:] == proposal:
        return [proposal[i % n] for i in range(k)]
    return proposal[:k]
