"""`bench --workload repeat`: requests whose answers repeat or edit text given in the prompt,
where a proposer that looks the next tokens up in the sequence (stage 12's n-gram) can hit.

Introduced in stage 12. nano-vLLM's workload (random ids, random weights) gives a proposer
nothing to find; this one asks a real model to copy, fix or continue a text it was given, the
way an editor assistant or a code model is asked. The texts are fixed, so every run and every
engine gets the same requests; the chat template and the tokenizer are the model's own.
"""

from __future__ import annotations

from nanoserve.bench.workload import Workload
from nanoserve.llm_arguments import chat_prompt

TEXTS = (
    "The block table maps each logical position of a sequence to a physical slot in the pool. "
    "A block holds sixteen tokens; a sequence of forty tokens holds three blocks, the last one "
    "half empty. When the sequence grows past a boundary, one more block is taken from the free "
    "list, and when it finishes, every block goes back.",
    "def pack(seqs, block_size):\n    ids, positions, slots = [], [], []\n    for seq in seqs:\n"
    "        start = seq.num_cached_tokens\n        for p in range(start, len(seq)):\n"
    "            ids.append(seq.token_ids[p])\n            positions.append(p)\n"
    "            block = seq.block_table[p // block_size]\n"
    "            slots.append(block * block_size + p % block_size)\n"
    "    return ids, positions, slots",
    "Dear team, the meeting on Thursday moves to Friday at ten. Please bring the notes from the "
    "last review, the list of open questions and the draft of the plan. If you cannot come, "
    "send your comments by Thursday evening so that we can read them before we start.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl. Add the warm "
    "water and stir until a rough dough forms. Knead it for ten minutes, cover it and let it "
    "rise for an hour. Shape the loaf, let it rise again, and bake it for forty minutes.",
)
ASKS = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Rewrite the following text with every sentence on its own line, changing nothing else:"
    "\n\n{text}",
    "Copy the following text and then continue it with one more sentence:\n\n{text}",
)


def repeat_workload(tokenizer, num_seqs: int, max_tokens: int) -> Workload:
    """num_seqs chat requests cycling through every (ask, text) pair; max_tokens each."""
    pairs = [(ask, text) for ask in ASKS for text in TEXTS]
    prompts = []
    for i in range(num_seqs):
        ask, text = pairs[i % len(pairs)]
        conversation = [{"role": "user", "content": ask.format(text=text)}]
        text = chat_prompt(tokenizer, conversation)  # as LLM.chat renders it
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return Workload(prompts, [max_tokens] * num_seqs)
