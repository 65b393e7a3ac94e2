"""A request as the engine sees it: its tokens, its sampling params, its place in the lifecycle.

Introduced in stage 00. A Sequence holds ids only; where its keys and values live is recorded by
the cache manager of the stage (a slab id in stage 01, a block table from stage 04).
"""

from __future__ import annotations

import itertools
from enum import Enum

import torch

from nanoserve.sampling import SamplingParams, make_generator


class SequenceStatus(Enum):
    """WAITING -> RUNNING -> FINISHED; preemption sends RUNNING back to WAITING."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt plus completion token ids of one request."""

    _ids = itertools.count()

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, device="cpu"):
        self.seq_id = next(Sequence._ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.generator = make_generator(params, torch.device(device))
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0  # tokens whose K/V is already stored
        self.slab_id: int | None = None  # stage 01: the contiguous slab this sequence owns
        self.block_table: list[int] = []  # stage 03+: physical block ids, in logical order
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def last_token_id(self) -> int:
        """The newest token; a decode step feeds it to the model."""
        return self.token_ids[-1]

    @property
    def prompt_token_ids(self) -> list[int]:
        """The request's prompt."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        """Tokens generated so far."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_completion_tokens(self) -> int:
        """How many tokens have been generated."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        """True once a stop token or a length limit was reached."""
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add a freshly sampled token."""
        self.token_ids.append(token_id)
