"""The plain data every layer shares: a request (`Sequence`), a step's batch, and its inputs.

Introduced in stage 00 (`Sequence`, `ScheduledBatch`); `AttentionMetadata` and `StepInputs` in
stage 04, and every stage fills them in since. Nothing here decides anything: the scheduler and
the cache managers (engine/) fill in a `Sequence`, the model runner's input packer builds the
`StepInputs`, the attention backends (kernels/) read them. It sits at the bottom of the import
order, so anyone may use it.
"""

from __future__ import annotations

import itertools
from enum import Enum
from typing import NamedTuple

import torch

from nanoserve.logprobs import TokenLogprobs
from nanoserve.sampling import SamplingParams, make_generator


class SequenceStatus(Enum):
    """WAITING -> RUNNING -> FINISHED; preemption sends RUNNING back to WAITING."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt plus completion token ids of one request.

    It holds ids only; where its keys and values live is recorded by the cache manager of the
    stage (a slab id in stage 01, a block table from stage 03).
    """

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
        self.num_scheduled_tokens = 0  # tokens this step computes (a chunk of a long prefill)
        self.slab_id: int | None = None  # stage 01: the contiguous slab this sequence owns
        self.block_table: list[int] = []  # stage 03+: physical block ids, in logical order
        self.num_preemptions = 0
        self.num_pending = 0  # stage 11: tokens sampled on the device, not yet seen by the host
        # params.logprobs set: completion index -> that token's logprobs (the runner fills it;
        # a token discarded after the end may leave an entry past the completion: ignore it)
        self.logprobs: dict[int, TokenLogprobs] = {}

    def __len__(self) -> int:
        """Every token of the sequence, counting one the device sampled and the host awaits."""
        return len(self.token_ids) + self.num_pending

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

    def finish(self, reason: str) -> None:
        """End the request: FINISHED, for `reason` ("stop", "length" or "abort"). The one place
        that writes status FINISHED and finish_reason (the scheduler calls it); a token the
        device still owes it is never appended."""
        self.status, self.finish_reason = SequenceStatus.FINISHED, reason
        self.num_pending = 0


class ScheduledBatch(NamedTuple):
    """The plan of one step (what `Scheduler.schedule` returns and `runner.execute` runs): the
    sequences of the step and its kind; the sequences that left the running set since the last
    plan (finished, preempted, aborted), whose device rows the runner lets go before it runs this
    one (stage 11: the runner alone writes its device batch); and (stage 12) how many guesses
    each sequence may take, room for them already reserved in its blocks (() when none may),
    and the sequences whose tables were cut since the last plan with how many blocks each kept
    (the runner's device copy of a table is stale past them)."""

    seqs: list[Sequence]
    is_prefill: bool
    freed: tuple[Sequence, ...] = ()
    guesses: tuple[int, ...] = ()
    trimmed: tuple[tuple[Sequence, int], ...] = ()


class Landed(NamedTuple):
    """A step whose tokens reached the host: its plan, and per sequence of it the tokens it
    gains ([] for a prefill chunk that samples nothing; [t] after a plain step; the kept guesses
    then the drawn token after a stage 12 verify step) and, after a verify step, what each
    guessed (None: nobody guessed)."""

    plan: ScheduledBatch
    tokens: list[list[int]]
    guesses: list[list[int]] | None = None


class StepOutput(NamedTuple):
    """What `runner.execute(plan)` hands `Scheduler.update(plan, out)`.

    A synchronous runner returns the plan's own tokens. Stage 11's runner keeps one step in
    flight: the plan's tokens are still on the device (`tokens` None), and the step launched
    before it has landed (`earlier`)."""

    inputs: StepInputs | None  # what the plan ran (for --trace); None: an empty plan
    sampled: tuple[int, ...]  # the indices of plan.seqs that draw a token in this step
    tokens: list[list[int]] | None  # per plan.seqs, as in Landed; None: still on the device
    earlier: Landed | None = None  # stage 11: the step before, whose tokens arrived meanwhile
    guesses: list[list[int]] | None = None  # stage 12: the guesses each sequence took

    @classmethod
    def of(cls, token_ids: list[int | None], inputs: StepInputs | None = None) -> StepOutput:
        """A synchronous step's output from one token id per sequence of its plan (None: a
        prefill chunk that sampled nothing)."""
        sampled = tuple(i for i, token_id in enumerate(token_ids) if token_id is not None)
        return cls(inputs, sampled, [[] if t is None else [t] for t in token_ids])


class HostMetadata(NamedTuple):
    """Host (Python list) copies of metadata fields, for torch code that loops per sequence.

    Same names as the tensors they copy; only the real sequences (no CUDA-graph padding rows).
    A kernel backend never reads them: a captured graph cannot see Python lists.
    """

    cu_seqlens_q: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]


class AttentionMetadata(NamedTuple):
    """Where this step's K/V goes and what each sequence reads: one set of names for every stage.

    B sequences (rows past `num_seqs` are padding a caller asked for: slot -1, context length 0),
    T packed query tokens. Two sequences with 3 and 2 new tokens over cached prefixes of 4 and 7:
    cu_seqlens_q [0, 3, 5], cu_seqlens_k [0, 7, 16], context_lens [7, 9], max_seqlen_q 3.
    """

    is_prefill: bool
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32: sequence i owns packed rows q[i] .. q[i+1]-1
    cu_seqlens_k: torch.Tensor  # (B + 1,) int32: the same over whole contexts (cached + new)
    max_seqlen_q: int  # the most new tokens of one sequence
    max_seqlen_k: int  # the longest context
    slot_mapping: torch.Tensor  # (T,) int64 flat slot each new token's K/V goes to; -1 = none
    context_lens: torch.Tensor  # (B,) int32 tokens each sequence attends over
    block_tables: torch.Tensor  # (B, W) int32 block ids in logical order, padded with -1
    host: HostMetadata

    @property
    def num_seqs(self) -> int:
        """Real sequences in the step (padding rows excluded)."""
        return len(self.host.context_lens)


class StepRow(NamedTuple):
    """One sequence's share of a step, as plain data: what a tensor-parallel worker receives.

    A prompt of 7 tokens with 4 cached, table [3, 9] (block_size 4): token_ids = its last 3,
    start = 4, so they sit at positions 4..6 and slots 9*4+0 .. 9*4+2.
    """

    token_ids: list[int]  # the tokens this step computes
    start: int  # position of token_ids[0]: the tokens before it are cached (or not needed)
    block_table: list[int]  # where the sequence's K/V lives ([] when nothing is stored)


class StepMessage(NamedTuple):
    """What rank 0 sends each tensor-parallel worker per step: enough to pack the same inputs."""

    is_prefill: bool
    rows: list[StepRow]  # one per sequence of the batch, in batch order
    num_seqs: int
    ids_from_first_rank: bool = False  # stage 11: the rows' token ids are placeholders; rank 0
    # broadcasts the real ones (sampled on its device, never seen by the host) inside the step
    every_row: bool = False  # stage 12: logits at every packed row (a verify step), not the last


class StepInputs(NamedTuple):
    """Everything one model call reads: packed token ids, their positions, the metadata."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, each token's position inside its own sequence
    metadata: AttentionMetadata


class ModelSpec(NamedTuple):
    """What the model runner builds its model from; a tensor-parallel worker builds its shard."""

    source: str  # a known name, a preset, a GGUF file or a safetensors folder
    dtype: torch.dtype
    device: torch.device
    tp_rank: int = 0  # stage 09: this process's rank among tp_size
    tp_size: int = 1
