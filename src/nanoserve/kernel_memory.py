"""A kernel's memory mistakes made visible in tests: stray addresses, and memory never written.

Introduced for stage 05's and stage 06's graded tests (stage 08's use `empty_is_poison` too).
On a GPU an unmasked load past a tensor's end may read the allocator's slack and go unnoticed;
Triton's interpreter reads host memory just as silently.
Inside `watch_memory()` each load and store that the interpreter runs is checked lane by lane:
an active lane must address an element of some tensor passed to that kernel launch (the
learner's own scratch buffers count: they are arguments too). Lanes that do not are recorded and
masked off, so the stray read or write never happens; outside the interpreter nothing is watched.
Inside `empty_is_poison()` torch.empty and its kin return tensors full of NaN (or, integers, of
INT_POISON), so what nobody wrote reads the same wrong value on every run, never whatever the
memory happened to hold (zeros, often, which a padding row may want).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Extent:
    """The bytes [start, end) that a kernel argument's elements span."""

    kernel: str
    name: str  # the kernel's parameter name
    start: int
    end: int
    itemsize: int
    what: str  # shape and dtype, for the message


@dataclass
class Stray:
    """Loads or stores of one kernel that addressed no argument's elements."""

    kernel: str
    op: str  # "load" or "store"
    count: int = 0
    nearest: Extent | None = None  # the argument nearest the stray lane farthest from any
    elements_off: int = 0  # how far that lane is from it, in its elements
    before: bool = False  # below its start (a negative index), not past its end

    def describe(self, names: dict[int, str]) -> str:
        """In words; names maps a tensor's data_ptr to what the caller calls it."""
        where = "memory outside every tensor it was given"
        if self.nearest is not None:
            name = names.get(self.nearest.start, f"its argument {self.nearest.name}")
            side = "before the start" if self.before else "past the end"
            off = f"up to {self.elements_off} element(s) {side} of {name}"
            where += f", {off} ({self.nearest.what})"
        return f"kernel {self.kernel} ran {self.count} {self.op} lane(s) of {where}"


def strays_message(strays: list[Stray], tensors: dict[str, object], advice: str) -> str:
    """A graded test's failure for loads and stores outside the kernel's tensors: each named as
    the test calls it (`tensors`, name -> tensor; other values are skipped), then `advice`."""
    names = {t.data_ptr(): name for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    return (
        "your kernels touched memory outside the tensors they were given (the interpreter reads "
        "and writes it silently; a GPU may fault, read garbage or corrupt a neighbour): "
        + "; ".join(s.describe(names) for s in strays)
        + ". "
        + advice
    )


def is_interpreting() -> bool:
    """True when Triton kernels run through the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def extent_of(kernel: str, name: str, tensor: torch.Tensor) -> Extent:
    """The bytes the elements of a strided view span, from its first to past its last."""
    itemsize = tensor.element_size()
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    span = 0 if tensor.numel() == 0 else (last + 1) * itemsize
    what = f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
    return Extent(kernel, name, tensor.data_ptr(), tensor.data_ptr() + span, itemsize, what)


class MemoryWatch:
    """The interpreter's loads and stores, checked against the running launch's arguments."""

    def __init__(self, interpreter) -> None:
        self.interpreter = interpreter
        self.strays: list[Stray] = []
        self.launch: list[Extent] = []  # the arguments of the launch running now
        self.kernel = "?"  # the name of the kernel running now

    def started(self, executor, args_hst: list, kwargs_hst: dict) -> None:
        """A launch begins: its tensor arguments (host copies) are what it may touch."""
        named = [*zip(executor.arg_names, args_hst), *kwargs_hst.items()]
        self.kernel = executor.fn.__name__
        self.launch = [
            extent_of(self.kernel, n, t) for n, t in named if isinstance(t, torch.Tensor)
        ]

    def checked(self, op: str, ptrs, mask):
        """A new mask (the old handle may be used again): mask with the stray lanes off."""
        itemsize = ptrs.get_element_ty().primitive_bitwidth // 8
        addresses = ptrs.data.astype(np.int64)
        active = np.broadcast_to(mask.data, addresses.shape)
        inside = np.zeros(addresses.shape, dtype=bool)
        for e in self.launch:
            inside |= (addresses >= e.start) & (addresses + itemsize <= e.end)
        if (active & ~inside).any():
            self.record(op, addresses[active & ~inside])
        return self.interpreter.TensorHandle(active & inside, mask.dtype)

    def record(self, op: str, addresses: np.ndarray) -> None:
        found = [s for s in self.strays if (s.kernel, s.op) == (self.kernel, op)]
        stray = found[0] if found else Stray(self.kernel, op)
        if not found:
            self.strays.append(stray)
        stray.count += addresses.size
        for address in {int(addresses.min()), int(addresses.max())}:  # the two farthest out
            gap = self.nearest(address)
            if gap is not None and gap[1] > stray.elements_off:
                stray.nearest, stray.elements_off, stray.before = gap

    def nearest(self, address: int) -> tuple[Extent, int, bool] | None:
        """The launch's argument nearest a stray byte address, how many of its elements away,
        and whether the address lies before its start (else past its end)."""
        gaps = [
            (e, -(-(e.start - address) // e.itemsize), True)
            if address < e.start
            else (e, (address - e.end) // e.itemsize + 1, False)
            for e in self.launch
        ]
        return min(gaps, key=lambda gap: gap[1], default=None)


@contextlib.contextmanager
def watch_memory():
    """Yield a list that collects a Stray per kernel and op whose lanes left its arguments."""
    if not is_interpreting():
        yield []
        return
    from triton.runtime import interpreter

    watch = MemoryWatch(interpreter)
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    init_args = executor._init_args_hst
    load, store = builder.create_masked_load, builder.create_masked_store

    def watched_init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        watch.started(self, args_hst, kwargs_hst)
        return args_hst, kwargs_hst

    def watched_load(self, ptrs, mask, other, cache_policy, is_volatile):
        mask = watch.checked("load", ptrs, mask)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def watched_store(self, ptrs, value, mask, cache_policy):
        return store(self, ptrs, value, watch.checked("store", ptrs, mask), cache_policy)

    executor._init_args_hst = watched_init_args
    builder.create_masked_load, builder.create_masked_store = watched_load, watched_store
    try:
        yield watch.strays
    finally:
        executor._init_args_hst = init_args
        builder.create_masked_load, builder.create_masked_store = load, store


EMPTY_FACTORIES = ("empty", "empty_like", "empty_strided")
INT_POISON = 0x5A5A5A5A  # what an integer tensor nobody wrote holds (or its dtype's max)


def poison(tensor: torch.Tensor) -> torch.Tensor:
    """tensor filled in place with NaN (floating), True (bool) or INT_POISON (integers)."""
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.fill_(float("nan"))
    if tensor.dtype == torch.bool:
        return tensor.fill_(True)
    return tensor.fill_(min(INT_POISON, torch.iinfo(tensor.dtype).max))


@contextlib.contextmanager
def empty_is_poison():
    """While inside, torch.empty, empty_like, empty_strided and Tensor.new_empty return tensors
    full of poison: what nobody writes reads the same wrong value on every run."""

    def poisoned(make):
        def make_poisoned(*args, **kwargs):
            return poison(make(*args, **kwargs))

        return make_poisoned

    originals = {name: getattr(torch, name) for name in EMPTY_FACTORIES}
    new_empty = torch.Tensor.new_empty
    for name, make in originals.items():
        setattr(torch, name, poisoned(make))
    torch.Tensor.new_empty = poisoned(new_empty)
    try:
        yield
    finally:
        for name, make in originals.items():
            setattr(torch, name, make)
        torch.Tensor.new_empty = new_empty
