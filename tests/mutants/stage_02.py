"""Stage 02 mutants: the block allocator (BlockAllocator), one realistic learner bug each."""

from __future__ import annotations

from tests.mutants import maker

FREE_LOOP = """
for block_id in block_ids:
    self._used_ids.remove(block_id)
    self._free_ids.append(block_id)
"""


mutant = maker(2, "BlockAllocator")


MUTANTS = (
    mutant(
        "free_stack_not_reversed",
        "the free stack is filled 0..n-1: a fresh pool hands out n-1",
        "__init__",
        ("list(range(num_blocks - 1, -1, -1))", "list(range(num_blocks))"),
    ),
    mutant(
        "fifo_reuse",
        "a queue instead of a stack: freed ids wait behind every other free id",
        "",  # the whole class: __init__ and allocate
        ("list(range(num_blocks - 1, -1, -1))", "list(range(num_blocks))"),
        ("self._free_ids.pop()", "self._free_ids.pop(0)"),
    ),
    mutant(
        "freed_ids_pushed_at_the_bottom",
        "free inserts at the front of the list (the bottom)",
        "free",
        ("self._free_ids.append(block_id)", "self._free_ids.insert(0, block_id)"),
    ),
    mutant(
        "free_in_reverse",
        "free pushes the ids last to first: the first id freed comes back first",
        "free",
        (FREE_LOOP, FREE_LOOP.replace("in block_ids", "in reversed(block_ids)")),
    ),
    mutant(
        "refuses_the_last_block",
        "off by one: asking for exactly what is free raises",
        "allocate",
        ("n > self.num_free_blocks", "n >= self.num_free_blocks"),
    ),
    mutant(
        "not_all_or_nothing",
        "allocate pops what it can, then raises: a refusal strands blocks",
        "allocate",
        (
            "if n > self.num_free_blocks:\n"
            "    raise OutOfBlocks(n, self.num_free_blocks)\n"
            "block_ids = [self._free_ids.pop() for _ in range(n)]",
            "block_ids = [self._free_ids.pop() "
            "for _ in range(min(n, self.num_free_blocks))]\n"
            "if len(block_ids) < n:\n"
            "    raise OutOfBlocks(n, self.num_free_blocks)",
        ),
    ),
    mutant(
        "value_error_when_short",
        "allocate raises ValueError instead of OutOfBlocks",
        "allocate",
        (
            "raise OutOfBlocks(n, self.num_free_blocks)",
            "raise ValueError(f'only {self.num_free_blocks} free')",
        ),
    ),
    mutant(
        "double_free_accepted",
        "free never checks that an id is handed out",
        "_check_can_free",
        (
            "if block_id not in self._used_ids:\n"
            '    raise ValueError(f"block {block_id} is not allocated (double '
            'free?)")',
            "",
        ),
    ),
    mutant(
        "free_not_atomic",
        "free checks each id just before pushing it: a bad id mid-list frees the ones before it",
        "free",
        (
            f"self._check_can_free(block_ids)\n{FREE_LOOP}",
            FREE_LOOP.replace(":\n", ":\n    self._check_can_free([block_id])\n"),
        ),
    ),
    mutant(
        "duplicate_in_one_call_accepted",
        "free checks each id against the held set but not against the rest of the same list",
        "_check_can_free",
        (
            "if block_id in seen:\n"
            '    raise ValueError(f"block {block_id} appears twice in one free() '
            'call")',
            "",
        ),
    ),
    mutant(
        "allocate_zero_refused",
        "allocate(0) raises instead of returning []",
        "allocate",
        ("n < 0", "n <= 0"),
    ),
)
