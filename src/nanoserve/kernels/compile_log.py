"""Kernel compiles, counted: which Triton kernels compiled while a block of code ran, and for how
long, so start-up can report its compile time and a benchmark can say whether anything compiled
inside its timed run (which would charge the compile to the engine's speed).

Triton compiles a kernel the first time it is launched with a new specialization: new constexpr
values, or an integer argument that newly equals 1 or is newly divisible by 16 (unless the kernel
lists it in `do_not_specialize`). A compile on an H200 takes 0.2 to 1 s; Triton's disk cache
(TRITON_CACHE_DIR) makes a second process skip the lowering, but only for what the first one
compiled. torch.compile's graphs (stage 08's fused small ops) are counted beside them.

    with CompileLog() as log:
        engine.step()
    log.kernels                # [KernelCompile("_prefill_kernel", 0.61, cache_hit=False), ...]
    log.summary()              # "1 Triton kernel built in 0.61 s: _prefill_kernel"

Listens through `triton.knobs.compilation.listener` (Triton >= 3.4); where that knob is missing,
`log.available` is False and nothing is counted. The interpreter compiles nothing.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple


class KernelCompile(NamedTuple):
    """One kernel Triton built: its name, the compiler's seconds, and whether the disk cache
    already held it (then the seconds are those of loading it)."""

    name: str
    seconds: float
    cache_hit: bool


@dataclasses.dataclass
class CompileLog:
    """Counts the Triton compiles and torch.compile graphs made between enter and exit."""

    kernels: list[KernelCompile] = dataclasses.field(default_factory=list)
    graphs: int = 0  # torch.compile graphs built (dynamo's unique graphs)
    available: bool = False
    _knobs: Any = None
    _previous: Any = None
    _graphs_before: int = 0

    def __enter__(self) -> CompileLog:
        try:
            from triton import knobs
        except ImportError:  # no Triton (or one without knobs): nothing to listen to
            knobs = None
        compilation = getattr(knobs, "compilation", None)
        if compilation is not None and hasattr(compilation, "listener"):
            self.available, self._knobs = True, compilation
            self._previous = compilation.listener
            compilation.listener = self._heard
        self._graphs_before = _dynamo_graphs()
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.listener = self._previous
        self.graphs = _dynamo_graphs() - self._graphs_before

    def _heard(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?")
        seconds = getattr(times, "total", 0) / 1e6  # microseconds
        self.kernels.append(KernelCompile(str(name), seconds, bool(cache_hit)))
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group,
                           times=times, cache_hit=cache_hit)  # fmt: skip

    @property
    def compiled(self) -> list[KernelCompile]:
        """The kernels lowered here (not found in the disk cache)."""
        return [k for k in self.kernels if not k.cache_hit]

    @property
    def seconds(self) -> float:
        """The compiler's time over every kernel, disk-cache loads included."""
        return sum(k.seconds for k in self.kernels)

    def summary(self) -> str:
        """One line: how many kernels compiled, how long, which (name x count)."""
        if not self.available:
            return "Triton compiles not counted (this Triton has no compilation listener)"
        names = collections.Counter(k.name for k in self.kernels)
        which = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in sorted(names.items()))
        cached = sum(k.cache_hit for k in self.kernels)
        text = f"{len(self.kernels)} Triton kernel{'s' * (len(self.kernels) != 1)}"
        text += f" built in {self.seconds:.2f} s"
        text += f" ({cached} from the disk cache)" if cached else ""
        text += f": {which}" if which else ""
        if self.graphs:
            text += f"; {self.graphs} torch.compile graph{'s' * (self.graphs != 1)}"
        return text


def _dynamo_graphs() -> int:
    """torch.compile's count of distinct graphs built so far in this process (0 without dynamo)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])
