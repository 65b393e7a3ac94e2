"""From one request's new token ids to text pieces: incremental decoding and stop strings.

Introduced in stage 10 (as serving/text.py, which re-exports it); below `llm` since stop strings
became a `SamplingParams` field, so `LLM.generate` and `LLM.stream` stop at them as the server
does. Decoding the whole completion at every token costs O(n) per token, O(n²) per request, so
each token is decoded against a short window of the ones before it (a tokenizer may decode a token
differently at the start of a string, and a character may span several byte tokens):

    token ids   [ ... sent ... | prev piece | new ]
                               ^prefix      ^read
    piece = decode(prev piece + new) minus decode(prev piece), once it ends in whole characters

A fast tokenizer (a Rust `tokenizers.Tokenizer` behind it) runs that window in Rust, as
`tokenizers.decoders.DecodeStream`. The hand-written window stays for a tokenizer without one (a
slow tokenizer, or a stand-in with only `decode`, like the stage 10 lesson's): DecodeStream needs
the Rust object. A stop string may arrive split over several tokens, so the last
len(longest stop) - 1 characters are held back until they cannot be the start of one. It does no
tokenizing of prompts and never looks at the engine.
"""

from __future__ import annotations

from collections.abc import Iterable

INCOMPLETE = "\ufffd"  # what a decoder prints for the first bytes of a character cut in two


class IncrementalDecoder:
    """Token ids in, the text they add out ("" while a character is still incomplete)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # token offsets of the decoding window (the picture above)
        self._read_offset = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast HF tokenizer's
        self._backend = backend if _has_decode_stream(backend) else None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """The text that these new tokens complete."""
        self.token_ids += token_ids
        if not token_ids:
            return ""
        if self._backend is not None:
            return self._stream.step(self._backend, list(token_ids)) or ""
        return self._window()

    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids, as `LLM` decodes a completion (special tokens skipped, by default)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _window(self) -> str:
        before = self.decode(self.token_ids[self._prefix_offset : self._read_offset])
        after = self.decode(self.token_ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith(INCOMPLETE):
            return ""  # nothing new yet, or half a character: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return after[len(before) :]


def _has_decode_stream(backend) -> bool:
    """True when backend is a Rust tokenizer that this `tokenizers` can stream-decode."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
    except ImportError:
        return False
    return isinstance(backend, Tokenizer)


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
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self.stop = list(stop)
        self.include_stop = include_stop  # SamplingParams.include_stop_str_in_output
        self.text = ""  # decoded so far, cut at a stop string once one is found
        self.num_sent = 0  # characters of text already returned
        self.stopped = False
        self.num_tokens_at_stop: int | None = None  # tokens pushed when the stop was seen

    @property
    def token_ids(self) -> list[int]:
        """Every token pushed so far."""
        return self.decoder.token_ids

    def push(self, token_ids: list[int]) -> str:
        """The text that these new tokens make safe to send (maybe empty)."""
        if self.tokenizer is None or self.stopped:
            self.decoder.token_ids += token_ids
            return ""
        self.text += self.decoder.push(token_ids)
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
        """Text of token ids, as the decoder decodes them."""
        return self.decoder.decode(token_ids)

    def _cut_at_stop(self) -> bool:
        """Cut the text at the earliest stop string in it; True if one was found."""
        if not self.stop:
            return False
        start = max(0, self.num_sent - max(map(len, self.stop)))  # a stop may end in new text
        found = cut_at_stop(self.text, self.stop, self.include_stop, start)
        if found is None:
            return False
        self.text, self.stopped = found, True
        self.num_tokens_at_stop = len(self.token_ids)
        return True

    def _send(self, end: int) -> str:
        piece, self.num_sent = self.text[self.num_sent : end], max(self.num_sent, end)
        return piece


def cut_at_stop(text: str, stop: list[str], include: bool, start: int = 0) -> str | None:
    """text up to the earliest stop string found at or after start (through it when include);
    None when there is none. Two stops found at one place: the shorter, which ends first."""
    found = [(i, len(s)) for s in stop if (i := text.find(s, start)) != -1]
    if not found:
        return None
    index, length = min(found)
    return text[: index + length * include]


def tokens_through_stop(decode, token_ids: list[int], stop: list[str], upper: int) -> int:
    """How many of token_ids it takes for their text to hold a stop string, at most upper (the
    count when the stream saw it): usually upper itself, less when the stream saw it late (a
    token that ended a stop also began a character, held back until the next one)."""
    num = upper
    while num > 1 and cut_at_stop(decode(token_ids[: num - 1]), stop, False) is not None:
        num -= 1
    return num
