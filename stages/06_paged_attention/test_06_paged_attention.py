"""Stage 06's graded contract: your paged attention kernels against plain causal attention, and
inside the engine.

Run against any implementation with `pytest stages/06_paged_attention --impl ref|starter|yours.py`.
Without a GPU the kernels run through Triton's interpreter (the repository's conftest.py sets
TRITON_INTERPRET=1) on tiny shapes in float32 and float64, whose `tl.dot` the interpreter gets
right. Every sequence's K/V sits on shuffled blocks of a pool whose other slots hold NaN, so a
kernel that reads a slot it does not own returns NaN; the output tensor is passed in (`out`)
filled with NaN too, and so is every torch.empty your wrappers call (the split-K partials), so a
row or partial never written is NaN on every run; a failure reruns the call to tell the causes
apart. Under the interpreter every load and store must address an element of a tensor the kernel
was given: a block table's tail is followed by POISON ids no read may reach. Some queries and
keys are large whole numbers, so scores run to the hundreds in float32. The oracle is `attend`
(stage 00's torch attention) over the K/V each sequence was given. Task 5 plugs your functions
into the reference engine (`LLM(stage=6, attention_backend="triton", components=...)`).
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernel_memory import empty_is_poison, strays_message, watch_memory
from nanoserve.kernels.attention import attend

pytest.importorskip("triton", reason="stage 06 needs triton (pip install triton)")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a CPU: the interpreter

# atol = rtol, against float64 attend. On a GPU Triton passes the softmax scale as a float32
# scalar, so float64 is only as exact as that rounding there; the interpreter keeps float64.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12 if DEVICE.type == "cpu" else 1e-5}
SMALL = (4, 2, 16)  # (H, H_kv, D): GQA ratio 2
SMOLLM2 = (9, 3, 64)  # ratio 3
POISON = 1 << 30  # the block id past the end of a table: far outside every pool here


class Pages:
    """One layer's paged K/V for a batch, on the device: sequence b's context_lens[b] positions
    on shuffled blocks (its row of block_tables padded with -1), every slot nobody owns NaN."""

    def __init__(
        self,
        context_lens,
        heads=SMALL,
        block_size=4,
        dtype=torch.float32,
        seed=0,
        spread: float = 0.0,
        tight: bool = False,
    ):
        """spread > 0: queries and keys are randn * spread rounded to whole numbers, so every
        q.k is exact in float32 and the scores run to the hundreds. tight: the longest row of
        the table has no -1 after it, and the table ends where a buffer of POISON ids begins."""
        self.num_heads, num_kv_heads, self.head_dim = heads
        self.dtype, self.context_lens, self.spread = dtype, list(context_lens), spread
        gen = torch.Generator().manual_seed(seed)
        counts = [-(-n // block_size) for n in self.context_lens]
        num_blocks = sum(counts) + 2  # two spare blocks: NaN, in nobody's table
        free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = [[free.pop() for _ in range(count)] for count in counts]
        width = max(counts) + (0 if tight else 1)  # else a -1 after every row, as a static buffer
        rows = [table + [-1] * (width - len(table)) for table in self.tables]
        # a view of the head of a longer buffer: what lies past the table's end is POISON
        buffer = torch.full((len(rows) * width + 64,), POISON, dtype=torch.int32)
        buffer[: len(rows) * width] = torch.tensor(rows, dtype=torch.int32).flatten()
        self.block_tables = buffer.to(DEVICE)[: len(rows) * width].view(len(rows), width)
        self.lens = torch.tensor(self.context_lens, dtype=torch.int32, device=DEVICE)
        shape = (num_blocks, block_size, num_kv_heads, self.head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.kv = []  # per sequence: its (n, H_kv, D) keys and values, for the oracle
        for table, n in zip(self.tables, self.context_lens):
            k, v = (self.randn(gen, n, num_kv_heads, self.head_dim) for _ in "kv")
            k = self.spread_out(k)
            slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
            self.k_cache.view(-1, num_kv_heads, self.head_dim)[slots] = k
            self.v_cache.view(-1, num_kv_heads, self.head_dim)[slots] = v
            self.kv.append((k, v))
        self.k_cache, self.v_cache = self.k_cache.to(DEVICE), self.v_cache.to(DEVICE)

    def randn(self, gen, *shape) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(self.dtype)

    def spread_out(self, x: torch.Tensor) -> torch.Tensor:
        """x * spread, rounded to whole numbers (x itself when spread is 0)."""
        return (x.double() * self.spread).round().to(self.dtype) if self.spread else x

    def queries(self, num_tokens: int, seed: int = 1) -> torch.Tensor:
        """(num_tokens, H, D) random queries in the pool's dtype, on the device."""
        gen = torch.Generator().manual_seed(seed)
        q = self.randn(gen, num_tokens, self.num_heads, self.head_dim)
        return self.spread_out(q).to(DEVICE)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def expected(self, q: torch.Tensor, b: int) -> torch.Tensor:
        """Causal attention of sequence b's last len(q) positions over its context, float64."""
        k, v = self.kv[b]
        return attend(q.cpu().double(), k.double(), v.double(), self.scale)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, rows) -> None:
    """got == want within the dtype's tolerance; rows[i] is output row i's (request, position)."""
    tol = TOLERANCE[dtype]
    got = got.cpu().double()
    far = ((got - want).abs() > tol + tol * want.abs()).flatten(1).any(1).tolist()
    wrong = [rows[i] for i, is_far in enumerate(far) if is_far]
    torch.testing.assert_close(
        got,
        want,
        atol=tol,
        rtol=tol,
        msg=lambda found: f"attention differs from the oracle for {describe(wrong)}. {found}",
    )


# What `out` holds before a diagnostic rerun: far from any attention output here (a weighted mean
# of values drawn from randn), so an element that still holds it was never written.
UNWRITTEN = 4096.0


def call_kernel(kernel, pages: Pages, q, fill: float, args: dict, owned_only: bool, **launch):
    """kernel(q, k_cache, v_cache, *args.values(), out, **launch), `out` a tensor full of `fill`
    (the starter's positional order); with owned_only, on a copy of the pool whose slots no
    sequence owns hold 0 instead of NaN. Every torch.empty the kernel's wrapper calls comes back
    full of NaN, and under the interpreter every load and store must address an element of a
    tensor the kernel was given."""
    k_cache, v_cache = pages.k_cache, pages.v_cache
    if owned_only:
        k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    out = torch.full_like(q, fill)
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, **args, "out": out}
    with watch_memory() as strays, empty_is_poison():
        got = kernel(q, k_cache, v_cache, *args.values(), out, **launch)
    if strays:
        raise AssertionError(strays_message(strays, tensors, MASK_ADVICE))
    return got


MASK_ADVICE = (
    "Every load and store needs a mask: the block table holds a request's blocks and then -1 "
    "padding or nothing at all, so its entry for a position at or past the request's "
    "context_len must not be read (load it with mask=position < context_len)"
)


def rows_not_finite(got: torch.Tensor) -> list[int]:
    return [i for i in range(got.shape[0]) if not torch.isfinite(got[i]).all()]


def describe(rows: list[tuple[int, int]]) -> str:
    """(request, position) pairs as 'request 0 at positions 32..69, request 2 at position 4';
    position -1 is a padding row (context 0)."""
    parts, by_request = [], {}
    for request, position in rows:
        by_request.setdefault(request, []).append(position)
    for request, positions in by_request.items():
        if positions == [-1]:
            parts.append(f"request {request} (padding, context 0)")
            continue
        runs = []  # consecutive positions as "a..b"
        for p in sorted(positions):
            if runs and p == runs[-1][1] + 1:
                runs[-1][1] = p
            else:
                runs.append([p, p])
        spans = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)
        plural = "s" if len(positions) > 1 else ""
        parts.append(f"request {request} at position{plural} {spans}")
    return ", ".join(parts)


def not_finite_message(rows: list[tuple[int, int]], bad: list[int], rerun) -> str:
    """Why output rows `bad` hold NaN or inf, found by calling the kernel again: rows[i] is row
    i's (request, position), and rerun(fill, owned_only) repeats the failing call."""
    marked = rerun(UNWRITTEN, owned_only=False).cpu()
    clean = rerun(float("nan"), owned_only=True).cpu()
    unwritten, foreign, arithmetic = [], [], []
    for i in bad:
        row = rows[i]
        if (marked[i] == UNWRITTEN).any():
            unwritten.append(row)
        elif torch.isfinite(clean[i]).all():
            foreign.append(row)
        else:
            arithmetic.append(row)
    causes = []
    if unwritten:
        causes.append(
            f"{describe(unwritten)}: never written. `out` came in full of NaN, and a rerun with "
            f"`out` full of {UNWRITTEN} left some of their elements at {UNWRITTEN}: no program "
            "stored them (check the grid covers every row and head, that no program returns before "
            "its store, a padding row's included: its output is 0, and the store's mask)"
        )
    if foreign:
        causes.append(
            f"{describe(foreign)}: read a slot its sequence does not own. Every slot no "
            "sequence owns holds NaN here, and with those slots set to 0 these rows are finite: "
            "a block past the context, a -1 table entry or another sequence's page was loaded "
            "unmasked"
        )
    if arithmetic:
        causes.append(
            f"{describe(arithmetic)}: NaN or inf even with every unowned slot set to 0 and "
            "every element of `out` written. The arithmetic makes it: exp of scores whose row "
            "max was not subtracted first (float32 exp overflows past 88, exp2 past 128: keep a "
            "running max), a softmax divided by a zero sum (a row or partition that saw no "
            "key: in prefill, a causal mask that hides a row's own key, < where <= belongs, "
            "leaves the first row none), or a reduce that read partial results no program "
            "wrote (every torch.empty of your wrapper comes back full of NaN here). On a GPU, "
            "also a load outside the "
            "pool (a -1 table entry taken as a block id addresses memory before its start)"
        )
    return "the output holds NaN or inf for " + ". And for ".join(causes)


def check_prefill(impl, pages: Pages, q_lens) -> None:
    """The last q_lens[b] positions of each sequence as one packed prefill (or extend) step."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = pages.queries(cu[-1])
    cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=DEVICE)

    def run(fill: float, owned_only: bool = False) -> torch.Tensor:
        args = dict(
            cu_seqlens_q=cu_seqlens_q,
            context_lens=pages.lens,
            block_tables=pages.block_tables,
            max_seqlen_q=max(q_lens),
            scale=pages.scale,
        )
        return call_kernel(impl.paged_attention_prefill, pages, q, fill, args, owned_only)

    got = run(float("nan"))
    assert got.shape == q.shape and got.dtype == q.dtype, (
        f"the output is {tuple(got.shape)} {got.dtype}; expected q's {tuple(q.shape)} {q.dtype}"
    )
    rows = [  # output row -> (request, position): each request's last q_lens[b] positions
        (b, pages.context_lens[b] - n + i) for b, n in enumerate(q_lens) for i in range(n)
    ]
    bad = rows_not_finite(got)
    if bad:
        raise AssertionError(not_finite_message(rows, bad, run))
    want = torch.cat([pages.expected(q[cu[b] : cu[b + 1]], b) for b in range(len(q_lens))])
    assert_close(got, want, pages.dtype, rows)


def check_decode(impl, pages: Pages, **launch) -> torch.Tensor:
    """One query per sequence at its last position; rows with context 0 must come back as 0."""
    q = pages.queries(len(pages.context_lens))

    def run(fill: float, owned_only: bool = False) -> torch.Tensor:
        args = dict(context_lens=pages.lens, block_tables=pages.block_tables, scale=pages.scale)
        return call_kernel(impl.paged_attention_decode, pages, q, fill, args, owned_only, **launch)

    got = run(float("nan"))
    assert got.shape == q.shape and got.dtype == q.dtype, (
        f"the output is {tuple(got.shape)} {got.dtype}; expected q's {tuple(q.shape)} {q.dtype}"
    )
    rows = [(b, n - 1) for b, n in enumerate(pages.context_lens)]  # each query's position
    bad = rows_not_finite(got)
    if bad:
        raise AssertionError(not_finite_message(rows, bad, run))
    for b, n in enumerate(pages.context_lens):
        if n == 0:
            largest = got[b].abs().max().item()
            assert not got[b].any(), (
                f"row {b} is padding (context 0): its output must be 0, yet it holds values up "
                f"to {largest:.3g} in size"
            )
        else:
            assert_close(got[b : b + 1], pages.expected(q[b : b + 1], b), pages.dtype, rows[b:])
    return got


# ---- task 1: prefill of whole prompts, read through the block table ----


def test_task_1_one_prompt_on_scattered_pages_matches_causal_attention(impl):
    check_prefill(impl, Pages([11]), [11])  # 3 blocks of 4, in shuffled order


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_task_1_a_packed_batch_of_ragged_prompts(impl, dtype):
    lens = [5, 1, 8, 13]  # past, below, at and past block boundaries of 4
    check_prefill(impl, Pages(lens, dtype=dtype), lens)


@pytest.mark.parametrize("heads", [(2, 2, 16), SMOLLM2, (4, 1, 32)], ids=["gqa1", "gqa3", "gqa4"])
def test_task_1_every_query_head_reads_its_own_kv_head(impl, heads):
    check_prefill(impl, Pages([6, 9], heads=heads), [6, 9])


def test_task_1_scores_in_the_hundreds_stay_finite_in_float32(impl):
    # q.k runs to about +-2000 here, scores (x 1/sqrt(16)) to hundreds: exp(score) overflows
    # float32 past 88 (exp2 past 128) unless each row's running max is subtracted first
    check_prefill(impl, Pages([11, 40], spread=15.0), [11, 40])


def test_task_1_a_table_row_with_no_padding_is_never_read_past_its_end(impl):
    # one request on exactly 3 blocks: its row is the whole table, and past it lie POISON ids
    check_prefill(impl, Pages([9], tight=True), [9])


# ---- task 2: a cached prefix, and prompts longer than a tile ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_task_2_the_seeds_extend_step_attends_over_the_cached_prefix(impl, dtype):
    # cu_seqlens_q [0, 3, 5], context_lens [7, 9]: 3 new tokens on 4 cached, 2 on 7
    check_prefill(impl, Pages([7, 9], dtype=dtype), [3, 2])


def test_task_2_prompts_longer_than_one_query_tile_and_one_key_tile(impl):
    check_prefill(impl, Pages([70, 40], heads=(2, 1, 16)), [70, 33])


@pytest.mark.parametrize("block_size", [1, 16])
def test_task_2_any_block_size(impl, block_size):
    check_prefill(impl, Pages([17, 5], block_size=block_size), [9, 5])


# ---- task 3: decode, one program per sequence and KV group ----


def test_task_3_decode_matches_attention_of_the_last_position(impl):
    check_decode(impl, Pages([1, 4, 5, 13, 30]))


@pytest.mark.parametrize("heads", [(2, 2, 16), SMOLLM2, (4, 1, 32)], ids=["gqa1", "gqa3", "gqa4"])
def test_task_3_all_query_heads_of_a_group_share_their_kv_head(impl, heads):
    check_decode(impl, Pages([9, 16, 17], heads=heads))


def test_task_3_scores_in_the_hundreds_stay_finite_in_float32(impl):
    check_decode(impl, Pages([5, 40, 17], spread=15.0))


def test_task_3_a_table_row_with_no_padding_is_never_read_past_its_end(impl):
    check_decode(impl, Pages([9, 3], tight=True))  # request 0's row is full: 3 blocks of 4


def test_task_3_padding_rows_give_zeros_and_read_nothing(impl):
    check_decode(impl, Pages([6, 0, 9, 0], dtype=torch.float64))  # rows 1, 3: a graph's padding


# ---- task 4: split-K, and the reduce that merges the partitions ----


@pytest.mark.parametrize("partition_size", [32, 64])
def test_task_4_partitions_merge_to_the_same_attention(impl, partition_size):
    # a table of 26 blocks of 4 = 104 positions: 4 partitions of 32, or 2 of 64
    check_decode(impl, Pages([100, 33, 1, 64]), partition_size=partition_size)


def test_task_4_empty_partitions_and_padding_rows_add_nothing(impl):
    pages = Pages([70, 0, 5], heads=SMOLLM2, dtype=torch.float64)  # 3 partitions of 32
    check_decode(impl, pages, partition_size=32)


def test_task_4_partials_of_scores_in_the_hundreds_merge_finite_in_float32(impl):
    # each partition's max differs by hundreds: the reduce re-weights by exp2(m_p - M), M the
    # largest, or exp2(m_p) alone overflows
    check_decode(impl, Pages([100, 40, 3], spread=15.0), partition_size=32)


# ---- task 5: the engine attends with your kernels ----

PROMPT_LENS = (3, 5, 9)  # below, at and past block boundaries of block_size 4
ENGINE = dict(device=DEVICE.type, dtype="float64", block_size=4, max_model_len=64, num_kv_blocks=32)
PIECES = ("paged_attention_prefill", "paged_attention_decode")


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(6)
    return [torch.randint(256, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def stage_04_tokens(tiny_llama_folder, prompts):
    return greedy(LLM(tiny_llama_folder, stage=4, **ENGINE), prompts)


@pytest.mark.parametrize(
    "pieces", [PIECES[:1], PIECES[1:], PIECES], ids=["prefill", "decode", "both"]
)
def test_task_5_the_engine_on_your_kernels_gives_stage_04_tokens(
    impl, tiny_llama_folder, prompts, stage_04_tokens, pieces
):
    # float64: the kernels sum in another order than torch, ~1e-16 apart, far from a tie
    components = {name: getattr(impl, name) for name in pieces}
    llm = LLM(
        tiny_llama_folder, stage=6, attention_backend="triton", components=components, **ENGINE
    )
    got = greedy(llm, prompts)
    for i, (mine, want) in enumerate(zip(got, stage_04_tokens)):
        assert mine == want, (
            f"request {i} on your {' and '.join(pieces)} kernel(s) generated {mine}; stage 04 "
            f"generated {want}"
        )
    assert got == stage_04_tokens, f"{len(got)} outputs for {len(stage_04_tokens)} requests"
