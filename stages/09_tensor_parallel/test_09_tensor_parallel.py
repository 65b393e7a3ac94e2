"""Stage 09's graded contract: your shard arithmetic, and your layers run by real gloo ranks.

Run against any implementation with `pytest stages/09_tensor_parallel --impl ref|starter|yours`.
Task 1 calls your two functions directly. Tasks 2 to 6 run your layers in separate processes,
2 or 4 CPU ranks joined by a gloo process group (a `RankGroup`, started once per size for the
whole file): each rank builds your layer for its rank, loads whole float64 weights through its
`weight_loader` (a torch tensor, or a slice of a safetensors file that reads only its bytes),
runs the forward, and sends back what it holds. The oracle is the unsharded arithmetic in this
process (`F.linear`, `F.embedding`, one rank of the reference decoder), to 1e-12. Task 6 also
builds the whole decoder from your layers on 2 ranks: greedy tokens equal stage 08's, and so do
those of `LLM(stage=9, tensor_parallel_size=2)`.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import traceback
from contextlib import contextmanager, suppress
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanoserve import grading

HOST = "127.0.0.1"
STAGE = 9
START_TIMEOUT_S = 180  # spawning a rank imports torch: slow on a loaded laptop
REPLY_TIMEOUT_S = 120
COLLECTIVE_TIMEOUT_S = 60  # a rank left alone in an all-reduce gives up after this
RANK_PROGRAM = "__nanoserve_rank__"  # run_name of this file when a rank runs it
ATOL = 1e-12


# ---------------------------------------------------------------------------------------------
# The rank side. A rank check is a generator run in every rank: the part before its first
# `yield` builds your layer and loads its weights (no collective there), the part after it runs
# the forward (collectives) and yields what the parent compares. The parent starts the second
# part only once every rank finished the first, so a rank that fails to build never leaves the
# others waiting in an all-reduce.
# ---------------------------------------------------------------------------------------------


@contextmanager
def opened(source: dict | str):
    """name -> the whole tensor (source is a dict), or a safetensors slice (source is a file)."""
    if isinstance(source, dict):
        yield source
        return
    from safetensors import safe_open

    with safe_open(source, framework="pt") as f:
        yield {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118


def load(layer, param, loaded, *shard_id) -> None:
    layer.weight_loader(param, loaded, *shard_id)


def column_check(impl, tp, source, in_size, out_size, bias, x):
    layer = impl.ColumnParallelLinear(in_size, out_size, bias=bias, tp=tp)
    with opened(source) as w:
        load(layer, layer.weight, w["weight"])
        if bias:
            load(layer, layer.bias, w["bias"])
    yield
    yield {"weight_shape": tuple(layer.weight.shape), "out": layer(x)}


def merged_check(impl, tp, source, in_size, sizes, x):
    layer = impl.MergedColumnParallelLinear(in_size, sizes, tp=tp)
    with opened(source) as w:
        for shard_id in range(len(sizes)):
            load(layer, layer.weight, w[f"part{shard_id}"], shard_id)
    yield
    yield {"out": layer(x)}


def qkv_check(impl, tp, source, hidden, head_dim, num_heads, num_kv_heads, bias, x):
    layer = impl.QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=bias, tp=tp)
    with opened(source) as w:
        for shard_id in "qkv":
            load(layer, layer.weight, w[f"{shard_id}.weight"], shard_id)
            if bias:
                load(layer, layer.bias, w[f"{shard_id}.bias"], shard_id)
    yield
    q, k, v = layer(x).split(layer.local_sizes(), dim=-1)
    yield {"q": q, "k": k, "v": v}


def row_check(impl, tp, source, in_size, out_size, bias, x_slices):
    layer = impl.RowParallelLinear(in_size, out_size, bias=bias, tp=tp)
    with opened(source) as w:
        load(layer, layer.weight, w["weight"])
        if bias:
            load(layer, layer.bias, w["bias"])
    yield
    yield {"weight_shape": tuple(layer.weight.shape), "out": layer(x_slices[tp.rank])}


def mlp_check(impl, tp, source, hidden, intermediate, x):
    gate_up = impl.MergedColumnParallelLinear(hidden, [intermediate] * 2, tp=tp)
    down = impl.RowParallelLinear(intermediate, hidden, tp=tp)
    with opened(source) as w:
        load(gate_up, gate_up.weight, w["gate"], 0)
        load(gate_up, gate_up.weight, w["up"], 1)
        load(down, down.weight, w["down"])
    yield
    gate, up = gate_up(x).chunk(2, dim=-1)
    yield {"out": down(F.silu(gate) * up)}


def embedding_check(impl, tp, source, vocab_size, hidden, ids):
    layer = impl.VocabParallelEmbedding(vocab_size, hidden, tp=tp)
    with opened(source) as w:
        load(layer, layer.weight, w["embed"])
    yield
    yield {"weight": layer.weight.detach().clone(), "out": layer(ids)}


def head_check(impl, tp, source, vocab_size, hidden, states, tied):
    head = impl.ParallelLMHead(vocab_size, hidden, tp=tp)
    embed = impl.VocabParallelEmbedding(vocab_size, hidden, tp=tp)
    with opened(source) as w:
        if tied:  # as the decoder ties them: the head's parameter IS the embedding's
            load(embed, embed.weight, w["embed"])
            head.weight = embed.weight
        else:
            load(head, head.weight, w["head"])
    yield
    yield {"logits": head.compute_logits(states)}


def last_logits(model, ids: list[int]) -> torch.Tensor | None:
    """(V,) logits after ids by a full recompute (stage 00's arithmetic); None off rank 0."""
    from nanoserve.engine.runner.input_packer import pack_step
    from nanoserve.kernels.attention import NoCacheAttention
    from nanoserve.sampling import SamplingParams
    from nanoserve.types import Sequence

    seq = Sequence(ids, SamplingParams(max_tokens=1))
    inputs = pack_step([seq], [[]], 1, "cpu", is_prefill=True, from_start=True)
    hidden = model(inputs.input_ids, inputs.positions, NoCacheAttention(), inputs.metadata)
    logits = model.compute_logits(hidden[-1:])
    return None if logits is None else logits[0]


def decoder_check(impl, tp, folder, prompts, max_tokens):
    """The reference decoder built from your layers: greedy tokens by full recompute; rank 0
    picks each token and broadcasts it, so every rank runs the same forwards."""
    from nanoserve.models import decoder
    from nanoserve.models.loader import load_model

    for name in LAYER_NAMES:  # the decoder builds its projections from these names
        setattr(decoder, name, getattr(impl, name))
    model = load_model(folder, torch.device("cpu"), torch.float64, tp)
    yield
    tokens, first_logits = [], []
    for prompt in prompts:
        ids = list(prompt)
        for step in range(max_tokens):
            logits = last_logits(model, ids)  # None on every rank but 0
            if step == 0:
                first_logits.append(logits)
            chosen = torch.zeros(1, dtype=torch.int64)
            if logits is not None:
                chosen[0] = int(logits.argmax())
            dist.broadcast(chosen, src=0)
            ids.append(int(chosen))
        tokens.append(ids[len(prompt) :])
    yield {"tokens": tokens, "first_logits": first_logits}


LAYER_NAMES = (
    "QKVParallelLinear",
    "MergedColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelLMHead",
)
CHECKS = {
    f.__name__: f
    for f in (
        column_check,
        merged_check,
        qkv_check,
        row_check,
        mlp_check,
        embedding_check,
        head_check,
        decoder_check,
    )
}


def serve_rank(rank: int, size: int, port: int, conn, impl_name: str) -> None:
    """One rank: join the gloo group, load the implementation, run checks until told to stop."""
    from nanoserve.layers.tensor_parallel import TensorParallel

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)  # layers are built in float64, as the weights are
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    tp = TensorParallel(rank, size)
    try:
        impl = grading.load_impl(STAGE, impl_name)
    except Exception as err:  # reported by every check, as the parent's own loading would
        impl = err
    conn.send(("ready", None))
    running = None
    while (message := conn.recv()) is not None:  # None: the parent is done with this group
        try:
            if isinstance(impl, Exception):
                raise impl
            with torch.inference_mode():
                if message[0] == "setup":
                    running = CHECKS[message[1]](impl, tp, **message[2])
                    next(running)
                    conn.send(("ok", None))
                else:
                    conn.send(("ok", next(running)))
        except BaseException as err:  # the parent reports it as the test's failure
            running = None
            where = traceback.format_exc(limit=-4)
            conn.send(("error", f"rank {rank}: {type(err).__name__}: {err}\n{where}"))
    os._exit(0)  # at once: the group ends with its processes (a clean destroy waits for peers)


if __name__ == RANK_PROGRAM:  # this file, run by runpy in a spawned rank process
    serve_rank(**RANK_ARGS)  # noqa: F821 (given to runpy.run_path as init_globals)


# ---------------------------------------------------------------------------------------------
# The parent side: a group of rank processes, started once per size for the whole file.
# ---------------------------------------------------------------------------------------------


class RankGroup:
    """`size` spawned rank processes in one gloo group (a fresh TCPStore on port 0), each running
    this file's `serve_rank`. `run(check, **kwargs)` runs a rank check on every rank and returns
    the list of what each yielded, rank 0 first; it fails the test with the first rank's error."""

    def __init__(self, size: int):
        self.size = size
        self.processes, self.conns, self.store = [], [], None
        self.is_ready = False

    def launch(self) -> None:
        """Spawn the ranks; they import torch and join the group while the parent goes on."""
        context = multiprocessing.get_context("spawn")
        self.store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
        impl_name = grading.normalize_impl(os.environ.get(grading.IMPL_ENV_VAR))
        for rank in range(self.size):
            parent_end, child_end = context.Pipe()
            args = dict(
                rank=rank, size=self.size, port=self.store.port, conn=child_end, impl_name=impl_name
            )
            process = context.Process(
                target=runpy.run_path,
                args=(str(Path(__file__).resolve()),),
                kwargs=dict(init_globals={"RANK_ARGS": args}, run_name=RANK_PROGRAM),
                daemon=True,
            )
            process.start()
            child_end.close()
            self.processes.append(process)
            self.conns.append(parent_end)
        self.is_ready = False

    def run(self, check: str, **kwargs) -> list:
        if not self.processes:
            self.launch()
        if not self.is_ready:
            self.replies(START_TIMEOUT_S, "start")
            self.is_ready = True
        for conn in self.conns:
            conn.send(("setup", check, kwargs))
        self.replies(REPLY_TIMEOUT_S, "build and load")
        for conn in self.conns:
            conn.send(("run",))
        try:
            return self.replies(REPLY_TIMEOUT_S, "forward", drain=False)
        except BaseException:
            self.close()  # a rank may be stuck in a collective: the next test starts afresh
            raise

    def replies(self, timeout: float, phase: str, drain: bool = True) -> list:
        """Every rank's answer, in rank order; an error (or a dead or silent rank) fails the test.

        With drain, a rank's error is raised only once every other rank has answered too, so no
        reply of this phase is left in a pipe for the next test to read as its own; without it
        (the forward, where the others may wait in a collective for the failed rank), the caller
        closes the group."""
        answers: dict[int, object] = {}
        errors: list[str] = []
        while len(answers) < self.size:
            waiting = [r for r in range(self.size) if r not in answers]
            ready = wait(
                [self.conns[r] for r in waiting] + [self.processes[r].sentinel for r in waiting],
                timeout,
            )
            if not ready:
                self.close()
                silent = (
                    f"ranks {waiting} did not answer within {timeout} s ({phase}): one waits in "
                    "a collective another rank never reached?"
                )
                pytest.fail(errors[0] if errors else silent, pytrace=False)
            for r in waiting:
                if self.conns[r] in ready and self.conns[r].poll():
                    status, value = self.conns[r].recv()
                    answers[r] = value
                    if status == "error":
                        errors.append(value)
                        if not drain:
                            pytest.fail(value, pytrace=False)
                elif self.processes[r].sentinel in ready:
                    code = self.processes[r].exitcode
                    self.close()
                    pytest.fail(f"rank {r} died ({phase}), exit code {code}", pytrace=False)
        if errors:
            others = f"\n(and {len(errors) - 1} other rank(s) failed too)" if errors[1:] else ""
            pytest.fail(errors[0] + others, pytrace=False)
        return [answers[r] for r in range(self.size)]

    def close(self) -> None:
        for conn, process in zip(self.conns, self.processes):
            if process.is_alive():
                with suppress(OSError):
                    conn.send(None)
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes, self.conns, self.store = [], [], None
        self.is_ready = False


class RankGroups(dict):
    """groups[size]: the RankGroup of that many ranks, started the first time a test asks."""

    def __missing__(self, size: int) -> RankGroup:
        self[size] = RankGroup(size)
        return self[size]


@pytest.fixture(scope="module")
def ranks():
    """ranks[size]: a group of 2 or 4 ranks, shared by the whole file, closed after it."""
    groups = RankGroups()
    yield groups
    for group in groups.values():
        group.close()


def weights(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def as_source(tensors: dict, tmp_path: Path, form: str) -> dict | str:
    """The checkpoint a rank loads: the tensors themselves, or a safetensors file holding them."""
    if form == "tensor":
        return tensors
    from safetensors.torch import save_file

    path = tmp_path / "checkpoint.safetensors"
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path))
    return str(path)


def share(total: int, rank: int, size: int) -> slice:
    """Rank's slice of an evenly split dimension (the test's own arithmetic, not yours)."""
    n = total // size
    return slice(rank * n, (rank + 1) * n)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= ATOL, f"{what}: differs from the unsharded result by {err:.3g}"


FORMS = pytest.mark.parametrize("form", ["tensor", "safetensors"])


# ---- task 1: the shard arithmetic ----


@pytest.mark.parametrize(
    ("total", "size", "ranges"),
    [
        (12, 2, [(0, 6), (6, 12)]),
        (12, 3, [(0, 4), (4, 8), (8, 12)]),
        (16, 4, [(0, 4), (4, 8), (8, 12), (12, 16)]),
        (8, 1, [(0, 8)]),
        (2, 2, [(0, 1), (1, 2)]),
    ],
)
def test_task_1_shard_range_gives_each_rank_its_equal_slice_in_order(impl, total, size, ranges):
    got = [tuple(impl.shard_range(total, rank, size)) for rank in range(size)]
    assert got == ranges, f"{total} over {size}: {got}, want {ranges}"


@pytest.mark.parametrize(("total", "size"), [(7, 2), (6, 4), (1, 2), (515, 2)])
def test_task_1_shard_range_rejects_a_size_that_does_not_divide(impl, total, size):
    # flooring would drop the last items; a ceiling would overrun the slice each rank allocated
    with pytest.raises(ValueError):
        impl.shard_range(total, size - 1, size)


@pytest.mark.parametrize(("rank", "size"), [(2, 2), (-1, 2), (4, 4)])
def test_task_1_shard_range_rejects_a_rank_outside_the_group(impl, rank, size):
    with pytest.raises(ValueError):
        impl.shard_range(8, rank, size)


@pytest.mark.parametrize(
    ("total", "size", "ranges"),
    [
        (5, 2, [(0, 3, 3), (3, 5, 3)]),  # the lesson's trace: rank 1 holds one padding row
        (515, 2, [(0, 258, 258), (258, 515, 258)]),
        (515, 4, [(0, 129, 129), (129, 258, 129), (258, 387, 129), (387, 515, 129)]),
        (256, 2, [(0, 128, 128), (128, 256, 128)]),  # divides: no padding at all
        (2, 4, [(0, 1, 1), (1, 2, 1), (2, 2, 1), (2, 2, 1)]),  # ranks 2, 3: padding only
        (7, 1, [(0, 7, 7)]),
    ],
)
def test_task_1_padded_shard_range_gives_every_rank_ceil_rows_and_its_real_ids(
    impl, total, size, ranges
):
    got = [tuple(impl.padded_shard_range(total, rank, size)) for rank in range(size)]
    assert got == ranges, f"{total} over {size}: {got}, want {ranges}"


# ---- task 2: column-parallel ----


@FORMS
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_task_2_each_rank_computes_its_rows_of_the_output(impl, ranks, tmp_path, form, bias):
    in_size, out_size = 6, 8
    w = {"weight": weights(out_size, in_size, seed=1), "bias": weights(out_size, seed=2)}
    x = weights(5, in_size, seed=3)
    full = F.linear(x, w["weight"], w["bias"] if bias else None)
    source = as_source(w if bias else {"weight": w["weight"]}, tmp_path, form)
    got = ranks[2].run(
        "column_check", source=source, in_size=in_size, out_size=out_size, bias=bias, x=x
    )
    for rank, result in enumerate(got):
        assert result["weight_shape"] == (4, 6), f"rank {rank} holds {result['weight_shape']}"
        assert_close(result["out"], full[:, share(8, rank, 2)], f"rank {rank}'s output features")


def test_task_2_four_ranks_side_by_side_are_the_whole_output(impl, ranks):
    w, x = weights(12, 5, seed=4), weights(3, 5, seed=5)
    got = ranks[4].run(
        "column_check", source={"weight": w}, in_size=5, out_size=12, bias=False, x=x
    )
    assert_close(torch.cat([r["out"] for r in got], dim=-1), F.linear(x, w), "ranks 0..3 joined")


@FORMS
def test_task_2_merged_gate_up_gives_each_rank_its_gate_slice_then_its_up_slice(
    impl, ranks, tmp_path, form
):
    gate, up, x = weights(8, 6, seed=6), weights(8, 6, seed=7), weights(4, 6, seed=8)
    source = as_source({"part0": gate, "part1": up}, tmp_path, form)
    got = ranks[2].run("merged_check", source=source, in_size=6, sizes=[8, 8], x=x)
    for rank, result in enumerate(got):
        mine = share(8, rank, 2)
        want = torch.cat([F.linear(x, gate)[:, mine], F.linear(x, up)[:, mine]], dim=-1)
        assert_close(result["out"], want, f"rank {rank}: [its gate features | its up features]")


def test_task_2_merged_projections_of_different_sizes_each_split_on_their_own(impl, ranks):
    a, b, x = weights(4, 6, seed=9), weights(8, 6, seed=10), weights(3, 6, seed=11)
    got = ranks[2].run(
        "merged_check", source={"part0": a, "part1": b}, in_size=6, sizes=[4, 8], x=x
    )
    for rank, result in enumerate(got):
        want = torch.cat(
            [F.linear(x, a)[:, share(4, rank, 2)], F.linear(x, b)[:, share(8, rank, 2)]], dim=-1
        )
        assert_close(result["out"], want, f"rank {rank}: 2 rows of the first, 4 of the second")


# ---- task 3: q, k and v split by heads ----

HEAD_DIM, HIDDEN = 4, 8


def qkv_weights(num_heads: int, num_kv_heads: int, seed: int) -> dict:
    sizes = {"q": num_heads * HEAD_DIM, "k": num_kv_heads * HEAD_DIM, "v": num_kv_heads * HEAD_DIM}
    out = {}
    for i, (name, n) in enumerate(sizes.items()):
        out[f"{name}.weight"] = weights(n, HIDDEN, seed=seed + i)
        out[f"{name}.bias"] = weights(n, seed=seed + 10 + i)
    return out


def heads(y: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Heads first..first+count-1 of (T, H * HEAD_DIM) outputs."""
    return y[:, first * HEAD_DIM : (first + count) * HEAD_DIM]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "size", "bias", "form"),
    [
        (4, 2, 2, False, "tensor"),  # 2 query heads per KV head
        (8, 2, 2, False, "safetensors"),  # 4 per KV head: the KV share is not the query share
        (8, 4, 2, True, "tensor"),
        (8, 4, 4, False, "tensor"),  # the same model over 4 ranks: 2 q heads, 1 KV head each
        (4, 4, 2, True, "safetensors"),  # no GQA: as many KV heads as query heads
        (8, 2, 2, True, "safetensors"),
    ],
    ids=lambda v: str(v),
)
def test_task_3_each_rank_holds_its_query_heads_and_the_kv_heads_they_read(
    impl, ranks, tmp_path, num_heads, num_kv_heads, size, bias, form
):
    w = qkv_weights(num_heads, num_kv_heads, seed=20)
    if not bias:
        w = {name: t for name, t in w.items() if name.endswith("weight")}
    x = weights(5, HIDDEN, seed=30)
    full = {n: F.linear(x, w[f"{n}.weight"], w.get(f"{n}.bias")) for n in "qkv"}
    got = ranks[size].run(
        "qkv_check",
        source=as_source(w, tmp_path, form),
        hidden=HIDDEN,
        head_dim=HEAD_DIM,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        bias=bias,
        x=x,
    )
    q_share, kv_share = num_heads // size, num_kv_heads // size
    for rank, result in enumerate(got):
        q0, kv0 = rank * q_share, rank * kv_share
        where = (
            f"rank {rank} of {size} ({num_heads} q / {num_kv_heads} kv heads) should hold q "
            f"heads {q0}..{q0 + q_share - 1} and kv heads {kv0}..{kv0 + kv_share - 1}"
        )
        assert_close(result["q"], heads(full["q"], q0, q_share), f"q: {where}")
        assert_close(result["k"], heads(full["k"], kv0, kv_share), f"k: {where}")
        assert_close(result["v"], heads(full["v"], kv0, kv_share), f"v: {where}")
        # the grouping attention applies on this rank matches the model's: local query head i
        # reads local KV head i // (q_share / kv_share), which is global head q0+i's KV head
        for i in range(q_share):
            local = kv0 + i // (q_share // kv_share)
            model = (q0 + i) // (num_heads // num_kv_heads)
            assert local == model, (
                f"{where}: local query head {i} (global {q0 + i}) attends KV head {local} here, "
                f"but KV head {model} in the whole model"
            )


# ---- task 4: row-parallel ----


@FORMS
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_task_4_every_rank_gets_the_whole_output_from_its_input_slice(
    impl, ranks, tmp_path, form, bias
):
    in_size, out_size = 8, 6
    w = {"weight": weights(out_size, in_size, seed=40), "bias": weights(out_size, seed=41)}
    x = weights(5, in_size, seed=42)
    full = F.linear(x, w["weight"], w["bias"] if bias else None)
    source = as_source(w if bias else {"weight": w["weight"]}, tmp_path, form)
    slices = [x[:, share(in_size, rank, 2)] for rank in range(2)]
    got = ranks[2].run(
        "row_check", source=source, in_size=in_size, out_size=out_size, bias=bias, x_slices=slices
    )
    for rank, result in enumerate(got):
        assert result["weight_shape"] == (6, 4), f"rank {rank} holds {result['weight_shape']}"
        assert_close(result["out"], full, f"rank {rank}'s output (bias added once, after the sum)")


def test_task_4_four_ranks_sum_to_the_whole_output(impl, ranks):
    w, b, x = weights(3, 12, seed=43), weights(3, seed=44), weights(4, 12, seed=45)
    slices = [x[:, share(12, rank, 4)] for rank in range(4)]
    got = ranks[4].run(
        "row_check",
        source={"weight": w, "bias": b},
        in_size=12,
        out_size=3,
        bias=True,
        x_slices=slices,
    )
    for rank, result in enumerate(got):
        assert_close(result["out"], F.linear(x, w, b), f"rank {rank} of 4")


@pytest.mark.parametrize("size", [2, 4])
def test_task_4_column_then_row_is_the_whole_swiglu_mlp_with_one_all_reduce(impl, ranks, size):
    from nanoserve.models.decoder import swiglu

    gate, up, down = weights(16, 6, seed=46), weights(16, 6, seed=47), weights(6, 16, seed=48)
    x = weights(5, 6, seed=49)
    got = ranks[size].run(
        "mlp_check", source={"gate": gate, "up": up, "down": down}, hidden=6, intermediate=16, x=x
    )
    for rank, result in enumerate(got):
        assert_close(result["out"], swiglu(x, gate, up, down), f"rank {rank} of {size}")


# ---- task 5: the vocabulary ----

VOCAB, EMBED = 515, 6  # 515 divides by neither 2 nor 4


def edge_ids(vocab_size: int, size: int) -> torch.Tensor:
    """Each rank's first and last real id, ids repeated, and an id of every rank side by side."""
    rows = -(-vocab_size // size)
    ids = [0, vocab_size - 1, 1, 1]
    for rank in range(size):
        start = rank * rows
        ids += [start, min(vocab_size, start + rows) - 1]
    return torch.tensor(ids)


@FORMS
@pytest.mark.parametrize("size", [2, 4])
def test_task_5_every_rank_gets_every_tokens_embedding(impl, ranks, tmp_path, form, size):
    table = weights(VOCAB, EMBED, seed=50)
    ids = edge_ids(VOCAB, size)
    got = ranks[size].run(
        "embedding_check",
        source=as_source({"embed": table}, tmp_path, form),
        vocab_size=VOCAB,
        hidden=EMBED,
        ids=ids,
    )
    for rank, result in enumerate(got):
        assert_close(result["out"], F.embedding(ids, table), f"rank {rank} of {size}, ids {ids}")


@pytest.mark.parametrize(("vocab_size", "size"), [(VOCAB, 2), (VOCAB, 4), (5, 2)])
def test_task_5_each_rank_holds_its_rows_then_zero_padding(impl, ranks, vocab_size, size):
    table = weights(vocab_size, EMBED, seed=51)
    got = ranks[size].run(
        "embedding_check",
        source={"embed": table},
        vocab_size=vocab_size,
        hidden=EMBED,
        ids=torch.tensor([0]),
    )
    rows = -(-vocab_size // size)
    for rank, result in enumerate(got):
        start, end = min(vocab_size, rank * rows), min(vocab_size, (rank + 1) * rows)
        want = torch.zeros(rows, EMBED, dtype=torch.float64)
        want[: end - start] = table[start:end]
        assert_close(result["weight"], want, f"rank {rank}: ids {start}..{end - 1}, then zeros")


def test_task_5_the_v5_trace_embeds_ids_4_and_0_from_two_ranks(impl, ranks):
    table = weights(5, EMBED, seed=52)
    ids = torch.tensor([4, 0, 3, 2])
    got = ranks[2].run(
        "embedding_check", source={"embed": table}, vocab_size=5, hidden=EMBED, ids=ids
    )
    for rank, result in enumerate(got):
        assert_close(result["out"], table[ids], f"rank {rank}")


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("tied", [False, True], ids=["own_head", "tied_head"])
def test_task_5_rank_0_gets_the_whole_logits_and_the_others_none(impl, ranks, size, tied):
    table, head = weights(VOCAB, EMBED, seed=53), weights(VOCAB, EMBED, seed=54)
    states = weights(3, EMBED, seed=55)
    got = ranks[size].run(
        "head_check",
        source={"embed": table, "head": head},
        vocab_size=VOCAB,
        hidden=EMBED,
        states=states,
        tied=tied,
    )
    want = F.linear(states, table if tied else head)
    assert got[0]["logits"] is not None, "rank 0 samples: it must get the logits"
    assert_close(got[0]["logits"], want, "rank 0's logits (every id, no padding column)")
    for rank, result in enumerate(got[1:], start=1):
        assert result["logits"] is None, f"rank {rank} gets None: only rank 0 samples"


def test_task_5_the_padding_logit_is_never_a_column(impl, ranks):
    # every real logit very negative: a padding column (logit 0) left in would win the argmax
    table = -weights(5, EMBED, seed=56).abs() - 1
    states = torch.ones(2, EMBED, dtype=torch.float64)
    got = ranks[2].run(
        "head_check", source={"embed": table}, vocab_size=5, hidden=EMBED, states=states, tied=True
    )
    logits = got[0]["logits"]
    assert logits is not None and tuple(logits.shape) == (2, 5), "(N, V): V = 5 columns"
    assert_close(logits, F.linear(states, table), "logits")


# ---- task 6: the whole decoder from your layers, and the engine at two ranks ----

PROMPTS = ([5, 9, 300, 2, 514, 77, 13], [1], [258, 257, 3, 3, 3])
MAX_TOKENS = 8


def save_tiny(folder: Path, family: str, **shape) -> str:
    """A tiny random transformers checkpoint of this family, saved as safetensors, float64."""
    import transformers

    from nanoserve.testing import TINY_SHAPE

    names = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    }
    config_name, model_name = names[family]
    config = getattr(transformers, config_name)(**{**TINY_SHAPE, **shape})
    torch.manual_seed(9)
    model = getattr(transformers, model_name)(config).to(torch.float64).eval()
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A Llama with 8 query / 2 KV heads and a vocabulary of 515 (untied head); a Qwen2 with
    q/k/v biases and a tied head."""
    root = tmp_path_factory.mktemp("tp-models")
    llama = dict(
        vocab_size=VOCAB,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    return {
        "llama_8q_2kv_v515": save_tiny(root / "llama", "llama", **llama),
        "qwen2_bias_tied": save_tiny(root / "qwen2", "qwen2", tie_word_embeddings=True),
    }


def stage_08_tokens(folder: str) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, tokens): PROMPTS within the model's vocabulary, and stage 08's greedy tokens."""
    from nanoserve import LLM, SamplingParams

    llm = LLM(folder, stage=8, device="cpu", dtype="float64", max_model_len=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    vocab = llm.engine.runner.model.config.vocab_size
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    return prompts, [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    ("model", "engine_too"), [("llama_8q_2kv_v515", True), ("qwen2_bias_tied", False)]
)
def test_task_6_two_ranks_of_your_layers_generate_stage_08s_tokens(
    impl, ranks, tiny_models, model, engine_too
):
    from nanoserve import LLM, SamplingParams
    from nanoserve.models.loader import load_model

    folder = tiny_models[model]
    prompts, want = stage_08_tokens(folder)
    got = ranks[2].run("decoder_check", folder=folder, prompts=prompts, max_tokens=MAX_TOKENS)
    one_rank = load_model(folder, torch.device("cpu"), torch.float64)
    with torch.inference_mode():
        for prompt, logits in zip(prompts, got[0]["first_logits"]):
            assert_close(logits, last_logits(one_rank, prompt), "rank 0's logits after a prompt")
    assert got[0]["tokens"] == want, "your layers on 2 ranks: not stage 08's tokens"
    if not engine_too:  # starting the engine's workers costs seconds: one model is enough
        return
    # the engine's own workers (nanoserve/parallel/) run the same model at tensor_parallel_size 2
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(
        folder, stage=9, device="cpu", dtype="float64", max_model_len=64, tensor_parallel_size=2
    ) as llm:
        engine = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert engine == want, "LLM(stage=9, tensor_parallel_size=2): not stage 08's tokens"
