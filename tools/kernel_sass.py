"""What a GPU would run: a paged attention kernel compiled for an H100/H200 (sm_90) on a CPU.

    PYTHONPATH=src python3 tools/kernel_sass.py                      # bfloat16 pool and e4m3
    PYTHONPATH=src python3 tools/kernel_sass.py --dtype float16      # a float16 model
    PYTHONPATH=src python3 tools/kernel_sass.py --kv e4m3 --block-n 64,128 --warps 4,8
    PYTHONPATH=src python3 tools/kernel_sass.py --kernel prefill                # prompts of 1,024
    PYTHONPATH=src python3 tools/kernel_sass.py --kernel store --kv e4m3       # the e4m3 store
    PYTHONPATH=src python3 tools/kernel_sass.py --kv e4m3 --dump /tmp/decode   # .ttgir .ptx .sass

No GPU is needed: Triton's wheel carries ptxas and cuobjdump, so the kernel is compiled exactly
as a launch on the H200 would compile it (same arguments, same specialization: pointers and
strides known to be multiples of 16 bytes, `do_not_specialize` honoured) and the machine code
is read back. For each tile set it prints the registers per thread, the bytes spilled to local
memory, the shared memory, and how many instructions of each kind the kernel holds:

- `cvt`: conversions (F2F, F2FP, I2F, F2I). On Hopper these issue at 16 results per clock per
  SM, a quarter of integer and an eighth of float32 arithmetic (CUDA programming guide,
  "Arithmetic instructions"): a kernel that converts every K/V element can be bound by them.
- `ld.global`, `ld.global->shared` (cp.async, what software pipelining issues), `ld.shared`
  (LDS, LDSM), `mma` (HMMA; HGMMA, Hopper's warpgroup mma, in prefill), `spill` (STL, LDL).
- `loop`: the instructions between each backward branch and its target, the loops' bodies
  (one for decode; prefill's two, summed): what one tile of keys costs a thread. Divided by the
  K/V bytes a thread reads per tile, it gives instructions a byte (docs/benchmarks.md).

It counts instructions in the binary, not instructions executed: each loop's body appears once
(prefill has two: the diagonal's masked tiles, then the full ones), so the counts
compare variants of one kernel, they are not times. Launch arguments are those of
Qwen3-0.6B's heads (16 query, 8 KV, 128 wide), blocks of 16 tokens, contexts of 1,024: decode
steps, or whole prompts with `--kernel prefill`; `--kernel store` (with `--kv e4m3`) compiles
the e4m3 store as a decode step launches it.
A measuring tool for docs/benchmarks.md, never a test; the Triton version matters (printed).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import pathlib
import re
import subprocess
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns unless it is set

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanoserve.cache.fp8_pool import Fp8KVPool
from nanoserve.kernels import paged_decode, paged_prefill, store_fp8

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16
WRAPPERS = {
    "decode": (paged_decode, "_decode_partition_kernel"),
    "prefill": (paged_prefill, "_prefill_kernel"),
    "store": (store_fp8, "_store_kvcache_fp8_kernel"),  # e4m3 only; no key tiles (--block-n)
}
KINDS = {
    "cvt": re.compile(r"^(F2F|F2FP|I2F|F2I)\b"),
    "ld.global": re.compile(r"^LDG\b"),
    "ld.global->shared": re.compile(r"^LDGSTS\b"),
    "ld.shared": re.compile(r"^(LDS|LDSM)\b"),
    "mma": re.compile(r"^(HMMA|HGMMA)\b"),
    "spill": re.compile(r"^(STL|LDL)\b"),
}
# what precedes an opcode in cuobjdump's listing: its address in a comment (the group), then an
# optional predicate such as @!P0
ADDRESS = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?"
TORCH_TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
    torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64",
}  # fmt: skip


def capture_launch(
    kernel_name: str, kv: str, block_n: int, dtype=torch.bfloat16
) -> tuple[object, dict, dict]:
    """Call the kernel's wrapper on small CPU tensors with the kernel swapped for a recorder:
    the wrapper computes every launch argument as it would on the GPU; nothing runs. Returns the
    kernel, its arguments by name and the launch's keywords."""
    torch.manual_seed(0)
    batch, blocks_per_seq = 4, 64  # context 1,024: one decode partition, as at batch 256
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), blocks_per_seq * BLOCK, dtype=torch.int32)
    if kv == "e4m3":
        num_blocks = batch * blocks_per_seq
        pool = Fp8KVPool(num_blocks, BLOCK, 1, KV_HEADS, HEAD_DIM, dtype, "cpu")
        (k, v), scales = pool.layer_caches(0), pool.layer_scales(0)
    else:
        shape = (batch * blocks_per_seq, BLOCK, KV_HEADS, HEAD_DIM)
        k, v = (torch.zeros(shape, dtype=dtype) for _ in range(2))
        scales = {}
    module, name = WRAPPERS[kernel_name]
    kernel, launches = getattr(module, name), []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((args, kwargs))

    setattr(module, name, Recorder())
    try:
        if kernel_name == "store":  # a decode step's: one new token a sequence
            key, value = (torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2))
            slots = (tables[:, -1] * BLOCK + BLOCK - 1).contiguous()
            module.store_kvcache_fp8(key, value, k, v, slots, **scales)
        elif kernel_name == "decode":
            q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype)
            module.paged_attention_decode(q, k, v, lens, tables, 0.088, block_n=block_n, **scales)
        else:  # whole prompts of 1,024 tokens
            q = torch.randn(int(lens.sum()), HEADS, HEAD_DIM, dtype=dtype)
            cu_seqlens = torch.arange(batch + 1, dtype=torch.int32) * int(lens[0])
            module.paged_attention_prefill(q, k, v, cu_seqlens, lens, tables, int(lens[0]), 0.088,
                                           block_n=block_n, **scales)  # fmt: skip
    finally:
        setattr(module, name, kernel)
    ((args, kwargs),) = launches  # one launch: the kernel's
    if "FP8_HARDWARE" in kernel.arg_names:  # the attention kernels' (the store has no such flag)
        # A GPU with fp8 instructions converts the codes in hardware; a CPU launch says it cannot.
        kwargs["FP8_HARDWARE"] = kv == "e4m3"
    return kernel, dict(zip(kernel.arg_names, args)), kwargs


def compile_for_sm90(kernel, values: dict, kwargs: dict):
    """Specialize as Triton's launcher does, then compile for compute capability 9.0."""
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages", "maxnreg")
               if name in kwargs}  # fmt: skip
    values = {**values, **kwargs}
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        value = values[name]
        param = kernel.params[index]
        if param.is_constexpr or value is None:
            signature[name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TORCH_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]  # torch's allocations are aligned
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1 and not param.do_not_specialize:  # the launcher folds a 1 in
            signature[name] = "constexpr"
            constexprs[(index,)] = 1
        else:
            signature[name] = "i32"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def read_binary(compiled, dump: pathlib.Path | None) -> dict:
    """Registers, spill bytes and an instruction count per kind, from cuobjdump."""
    tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as folder:
        cubin = pathlib.Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = run(tools / "cuobjdump", "--dump-resource-usage", cubin)
        sass = run(tools / "cuobjdump", "-sass", cubin)
    if dump is not None:
        for kind in ("ttgir", "ptx"):
            dump.with_suffix(f".{kind}").write_text(compiled.asm[kind])
        dump.with_suffix(".sass").write_text(sass)
    opcodes = [op for _, op in re.findall(ADDRESS + r"([A-Z][A-Z0-9_.]*)", sass)]
    counts = collections.Counter(opcodes)
    row = {"registers": int(re.search(r"REG:(\d+)", usage)[1]),
           "stack bytes": int(re.search(r"STACK:(\d+)", usage)[1]),
           "shared KiB": compiled.metadata.shared / 1024,
           "instructions": len(opcodes),
           "loop": loop_instructions(sass)}  # fmt: skip
    for kind, pattern in KINDS.items():
        row[kind] = sum(n for op, n in counts.items() if pattern.match(op))
    row["conversions"] = ", ".join(
        f"{n} {op}" for op, n in counts.most_common() if KINDS["cvt"].match(op)
    )
    return row


def loop_instructions(sass: str) -> int:
    """Instructions inside the loops: for each branch back to an earlier address, the span from
    its target to it (16 bytes an instruction on sm_90). The trap at the kernel's end, a branch
    to itself, spans nothing."""
    branches = re.findall(ADDRESS + r"BRA\s+0x([0-9a-f]+)", sass)
    spans = [(int(at, 16), int(to, 16)) for at, to in branches]
    return sum((at - to) // 16 + 1 for at, to in spans if to < at)


def run(*command) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", choices=sorted(WRAPPERS), default="decode")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                        help="the model's dtype: queries, and the pool's unless e4m3")  # fmt: skip
    parser.add_argument("--kv", default="auto,e4m3",
                        help="pools: auto (the model's dtype), e4m3, or both")  # fmt: skip
    parser.add_argument("--block-n", default="64,128", help="keys per tile, comma-separated")
    parser.add_argument("--warps", default="4", help="warps per program, comma-separated")
    parser.add_argument("--stages", default="2", help="pipeline stages, comma-separated")
    parser.add_argument("--dump", type=pathlib.Path, help="write .ttgir .ptx .sass (one set)")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, target sm_90; paged {args.kernel}, {HEADS} query heads, "
          f"{KV_HEADS} KV heads, {HEAD_DIM} wide, blocks of {BLOCK}\n")  # fmt: skip
    pools = args.kv.split(",")
    if not set(pools) <= {"auto", "e4m3"}:
        parser.error(f"argument --kv: expected auto, e4m3 or both, got {args.kv!r}")
    if args.kernel == "store" and pools != ["e4m3"]:
        parser.error("argument --kv: --kernel store is the e4m3 pool's store, pass --kv e4m3")
    try:
        numbers = [list(map(int, a.split(","))) for a in (args.block_n, args.warps, args.stages)]
    except ValueError:
        parser.error("arguments --block-n, --warps, --stages: comma-separated integers")
    if args.kernel == "store":  # no key tiles: one row, whatever --block-n says
        numbers[0] = numbers[0][:1]
    dtype = getattr(torch, args.dtype)
    header = None
    for kv, block_n, warps, stages in itertools.product(pools, *numbers):
        kernel, values, kwargs = capture_launch(args.kernel, kv, block_n, dtype)
        kwargs.update(num_warps=warps, num_stages=stages)
        row = read_binary(compile_for_sm90(kernel, values, kwargs), args.dump)
        pool = args.dtype if kv == "auto" else kv
        row = {"pool": pool, "keys, warps, stages": f"{block_n}, {warps}, {stages}", **row}
        if header is None:
            header = list(row)
            print("| " + " | ".join(header) + " |")
            print("|" + "---|" * len(header))
        print("| " + " | ".join(f"{row[h]:g}" if isinstance(row[h], float) else str(row[h])
                                for h in header) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
