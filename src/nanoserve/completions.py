"""One prompt's completions as `LLM` runs them, and the `RequestOutput` it returns (vLLM's shape).

Introduced with `SamplingParams.n`, `stop` and `logprobs` (after stage 11). A request for n
completions runs as n child sequences (`sampling.child_params`): child 0 first, the others once
its prompt is computed, so from stage 07 on they find its full blocks in the prefix cache. After
every engine step each child's new tokens go through its `TextStream`; a stop string aborts the
child, and its output keeps the tokens through the one that completed the stop string. It never
schedules and never samples: it watches sequences the engine fills in.

    RequestOutput(prompt, prompt_token_ids, outputs=[CompletionOutput(index, text, token_ids,
                  finish_reason, logprobs, cumulative_logprob), ...])   .text: outputs[0].text
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from nanoserve.detokenizer import TextStream, cut_at_stop, tokens_through_stop
from nanoserve.sampling import SamplingParams, child_params
from nanoserve.types import Sequence


class Logprob(NamedTuple):
    """One token's log-probability under the model's raw distribution, and its rank (1: top)."""

    logprob: float
    rank: int


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's fields)."""

    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, a stop token or a stop string) or "length"
    # SamplingParams.logprobs set: per token {token id: Logprob}, the sampled token first, then
    # the top-`logprobs` ones (the sampled one may be among them: then k entries, else k + 1)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # the sum of the sampled tokens' logprobs


@dataclass
class RequestOutput:
    """One finished request: its prompt and its n completions (`text`, `token_ids`,
    `finish_reason` and `logprobs` read the first, as they did before n existed)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def text(self) -> str:
        """The first completion's text."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """The first completion's token ids."""
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        """Why the first completion ended."""
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        """The first completion's logprobs (None unless asked for)."""
        return self.outputs[0].logprobs


class Completion:
    """One child sequence; its text followed token by token when it has stop strings or is
    streamed (otherwise it is decoded once, at the end)."""

    def __init__(self, seq: Sequence, index: int, tokenizer, streamed: bool = False):
        self.seq, self.index, self.tokenizer = seq, index, tokenizer
        params = seq.params
        self.stream = TextStream(tokenizer, params.stop, params.include_stop_str_in_output)
        self.is_watched = streamed or bool(params.stop)
        self.num_seen = 0  # completion tokens pushed into the stream

    def observe(self) -> str:
        """Push the tokens that arrived since the last call; the text they make safe to show."""
        if not self.is_watched:
            return ""
        start = self.seq.num_prompt_tokens + self.num_seen
        new = self.seq.token_ids[start:]
        self.num_seen += len(new)
        return self.stream.push(new) if new else ""

    @property
    def is_stopped(self) -> bool:
        """True once a stop string appeared (the caller aborts the sequence)."""
        return self.stream.stopped

    def output(self) -> CompletionOutput:
        """The finished completion, cut at its stop string if one appeared."""
        ids, reason = self.seq.completion_token_ids, self.seq.finish_reason
        decode = self.stream.decode if self.tokenizer is not None else _no_text
        if self.is_stopped:
            stop = self.stream.stop
            num = tokens_through_stop(decode, ids, stop, self.stream.num_tokens_at_stop or len(ids))
            ids, reason = ids[:num], "stop"
            text = cut_at_stop(decode(ids), stop, self.stream.include_stop)
            text = self.stream.text if text is None else text  # the whole decode may differ
        else:
            text = decode(ids)
        assert reason is not None, "outputs are built for finished sequences"
        logprobs = self._logprobs(ids)
        cumulative = None if logprobs is None else sum(d[t].logprob for t, d in zip(ids, logprobs))
        return CompletionOutput(self.index, text, ids, reason, logprobs, cumulative)

    def _logprobs(self, ids: list[int]) -> list[dict[int, Logprob]] | None:
        if self.seq.params.logprobs is None:
            return None
        out = []
        for i, token_id in enumerate(ids):
            entry = self.seq.logprobs[i]
            ranked = {token_id: Logprob(entry.logprob, entry.rank)}
            for rank, (top_id, logprob) in enumerate(entry.top.items(), start=1):
                ranked.setdefault(top_id, Logprob(logprob, rank))
            out.append(ranked)
        return out


def _no_text(token_ids: list[int]) -> str:
    return ""  # a model without a tokenizer: ids only


class RequestRun:
    """One prompt's n completions in the engine: child 0 at once, the others a step later."""

    def __init__(
        self,
        engine,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer,
        streamed: bool = False,
    ):
        self.engine, self.prompt, self.prompt_ids = engine, prompt, prompt_ids
        self.tokenizer, self.streamed = tokenizer, streamed
        self.is_watched = streamed or bool(params.stop)  # else a step leaves nothing to do
        self.waiting: list[SamplingParams] = child_params(params)
        self.completions: list[Completion] = []
        self._add(self.waiting.pop(0))

    @property
    def seqs(self) -> list[Sequence]:
        """The child sequences queued so far."""
        return [c.seq for c in self.completions]

    @property
    def is_finished(self) -> bool:
        """True once every child is queued and finished."""
        return not self.waiting and all(c.seq.is_finished for c in self.completions)

    def advance(self) -> list[str]:
        """After a step: each child's new text; stop strings abort their child; the other
        children are queued once child 0's prompt is computed (it has a token, or finished)."""
        if not self.is_watched and not self.waiting:
            return []
        pieces = [c.observe() for c in self.completions]
        stopped = [c.seq for c in self.completions if c.is_stopped and not c.seq.is_finished]
        self.engine.abort(stopped)
        first = self.completions[0].seq
        if self.waiting and (first.num_completion_tokens > 0 or first.is_finished):
            while self.waiting:
                self._add(self.waiting.pop(0))
        return pieces

    def output(self) -> RequestOutput:
        """The request's RequestOutput (every child finished)."""
        outputs = [c.output() for c in self.completions]
        return RequestOutput(self.prompt, self.prompt_ids, outputs)

    def _add(self, params: SamplingParams) -> None:
        seq = self.engine.add_request(self.prompt_ids, params)
        index = len(self.completions)
        self.completions.append(Completion(seq, index, self.tokenizer, self.streamed))
