"""From one request's token deltas to text pieces: incremental decoding and stop strings (stage 10).

Introduced in stage 10. Decoding the whole completion at every token costs O(n) per token, O(n²)
per request, and the event loop that does it is the one that serves every other client. So each
step decodes a short window instead: the tokens since the last piece sent, with the piece
before them as context (a tokenizer may decode a token differently at the start of a string).

    token ids   [ ... sent ... | prev piece | new ]
                               ^prefix      ^read
    piece = decode(prev piece + new) minus decode(prev piece), once it ends in whole characters

A stop string may arrive split over several tokens, so the last len(longest stop) - 1 characters
are held back until they cannot be the start of one.
"""

from __future__ import annotations

from collections.abc import Iterable

INCOMPLETE = "\ufffd"  # what a decoder prints for the first bytes of a character cut in two


class TextStream:
    """Token ids in, text pieces out, for one request; `stopped` once a stop string appeared."""

    def __init__(
        self,
        tokenizer,
        stop: Iterable[str] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer  # None for a model without one: the text stays empty
        self.stop = list(stop)
        self.include_stop = include_stop  # the text ends with the stop string, not before it
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far, cut at a stop string once one is found
        self.num_sent = 0  # characters of text already returned
        self.stopped = False
        self._prefix_offset = 0  # token offsets of the decoding window (the picture above)
        self._read_offset = 0

    def push(self, token_ids: list[int]) -> str:
        """The text that these new tokens make safe to send (maybe empty)."""
        self.token_ids += token_ids
        if self.tokenizer is None or self.stopped:
            return ""
        self.text += self._decode_new()
        if self._cut_at_stop():
            return self._send(len(self.text))
        hold = max(map(len, self.stop), default=1) - 1
        return self._send(max(self.num_sent, len(self.text) - hold))

    def finish(self) -> str:
        """The rest of the text once the request has finished: what was held back, and the
        last characters if the window never completed them (the whole decode settles it)."""
        if self.tokenizer is None or self.stopped:
            return ""
        whole = self.decode(self.token_ids)
        if whole.startswith(self.text):
            self.text = whole
        self._cut_at_stop()
        return self._send(len(self.text))

    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids, as `LLM` decodes a completion (special tokens skipped, by default)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self) -> str:
        before = self.decode(self.token_ids[self._prefix_offset : self._read_offset])
        after = self.decode(self.token_ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith(INCOMPLETE):
            return ""  # nothing new yet, or half a character: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return after[len(before) :]

    def _cut_at_stop(self) -> bool:
        """Cut the text before the earliest stop string in it; True if one was found."""
        if not self.stop:
            return False
        start = max(0, self.num_sent - max(map(len, self.stop)))  # a stop may end in new text
        found = [(i, len(s)) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if not found:
            return False
        i, length = min(found)
        self.text, self.stopped = self.text[: i + length * self.include_stop], True
        return True

    def _send(self, end: int) -> str:
        piece, self.num_sent = self.text[self.num_sent : end], max(self.num_sent, end)
        return piece
