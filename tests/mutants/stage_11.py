"""Stage 11 mutants: the persistent batch's rows and deltas (PersistentBatch), the split
postprocess (OverlapScheduler.commit / resolve) and the loop (OverlapEngine.step), one learner
bug each."""

from __future__ import annotations

from tests.mutants import Mutant

NEW_ROW = """
row = self.rows[seq.seq_id] = self.free_rows.pop()
self.num_sent[row] = 0
self.write_params(row, seq.params)
"""
DELTA = """
changed_rows += [row] * (len(table) - sent)
columns += range(sent, len(table))
blocks += table[sent:]
self.num_sent[row] = len(table)
"""
COMMIT = """
seq.num_cached_tokens += seq.num_scheduled_tokens
seq.num_scheduled_tokens = 0
if self.prefix_manager is not None:
    self.prefix_manager.hash_blocks(seq)
"""
LOOP = """
finished = []
if self.in_flight is not None:
    done, self.in_flight = self.in_flight, None
    finished = self.scheduler.resolve(done, done.token_ids(), self.eos_ids)
if launched is not None:
    self.scheduler.commit(launched)
    self.in_flight = launched
"""


def mutant(name: str, bug: str, target: str, *edits: tuple[str, str]) -> Mutant:
    return Mutant(11, name, bug, target, edits)


MUTANTS = (
    # ---- rows ----
    mutant(
        "row_by_count",
        "a new request's row is the number of requests holding one: after a release, two "
        "requests share a row",
        "PersistentBatch.row_of",
        (NEW_ROW, NEW_ROW.replace("self.free_rows.pop()", "len(self.rows)")),
    ),
    mutant(
        "params_not_written",
        "a new row keeps the last owner's sampling parameters (or zeros: greedy)",
        "PersistentBatch.row_of",
        ("self.write_params(row, seq.params)", ""),
    ),
    mutant(
        "sent_count_kept",
        "a reused row keeps its old owner's count of sent entries: the new table's first "
        "entries are never sent",
        "PersistentBatch.row_of",
        ("self.num_sent[row] = 0", ""),
    ),
    mutant(
        "row_not_freed",
        "release forgets the row but never frees it: rows leak and the batch grows forever",
        "PersistentBatch.release",
        ("self.free_rows.append(row)", "pass"),
    ),
    mutant(
        "release_keeps_mapping",
        "release frees the row but keeps the request's entry: a preempted request comes back "
        "to a row another request now holds",
        "PersistentBatch.release",
        ("self.rows.pop(seq.seq_id, None)", "self.rows.get(seq.seq_id)"),
    ),
    # ---- deltas ----
    mutant(
        "only_last_entry",
        "each step sends the table's last entry: a request admitted with several blocks never "
        "sends the earlier ones",
        "PersistentBatch.send",
        (
            DELTA,
            "changed_rows.append(row)\ncolumns.append(len(table) - 1)\nblocks.append(table[-1])"
            "\nself.num_sent[row] = len(table)",
        ),
    ),
    mutant(
        "resend_everything",
        "the sent count never advances: every step sends every table again (no deltas)",
        "PersistentBatch.send",
        ("self.num_sent[row] = len(table)", ""),
    ),
    mutant(
        "rows_sorted",
        "the rows are sent sorted, not in batch order: sequences read each other's rows",
        "PersistentBatch.send",
        (
            "return self.upload(rows, changed_rows, columns, blocks)",
            "return self.upload(sorted(rows), changed_rows, columns, blocks)",
        ),
    ),
    # ---- commit / resolve ----
    mutant(
        "chunk_owes_a_token",
        "every sequence of a step owes a token, a prefill chunk too: its length runs one ahead",
        "OverlapScheduler.commit",
        ("seq.num_pending += i in sampled", "seq.num_pending += 1"),
    ),
    mutant(
        "commit_finished",
        "a sequence that ended while its next step was launched still owes that step's token",
        "OverlapScheduler.commit",
        (
            "if seq.is_finished:\n    seq.num_scheduled_tokens = 0\n    continue",
            "pass",
        ),
    ),
    mutant(
        "commit_never_hashes",
        "commit forgets the prefix cache: the blocks a step filled are never shareable",
        "OverlapScheduler.commit",
        (COMMIT, "seq.num_cached_tokens += seq.num_scheduled_tokens\nseq.num_scheduled_tokens = 0"),
    ),
    mutant(
        "hashed_before_stored",
        "commit hashes before it counts the step's tokens as stored: each block joins the prefix "
        "cache one step late",
        "OverlapScheduler.commit",
        (
            COMMIT,
            "if self.prefix_manager is not None:\n    self.prefix_manager.hash_blocks(seq)\n"
            "seq.num_cached_tokens += seq.num_scheduled_tokens\nseq.num_scheduled_tokens = 0",
        ),
    ),
    mutant(
        "discarded_token_kept",
        "the token sampled in the step after a sequence's end is appended to it",
        "OverlapScheduler.resolve",
        ("token_id is None or seq.is_finished", "token_id is None"),
    ),
    mutant(
        "finished_row_kept",
        "a finished sequence never frees its row",
        "OverlapScheduler.resolve",
        ("self.release(seq)", ""),
    ),
    mutant(
        "length_past_max_model_len",
        "resolve ends a request when it grows past max_model_len, not when it reaches it: the "
        "request that fills its last position is scheduled again",
        "OverlapScheduler.resolve",
        (
            "finish_reason(seq, token_id, eos_ids, self.config.max_model_len)",
            "finish_reason(seq, token_id, eos_ids, self.config.max_model_len + 1)",
        ),
    ),
    mutant(
        "preempted_deallocated_again",
        "a sequence preempted while its last token was in flight is deallocated again when it "
        "finishes (it holds nothing: the manager fails) and stays in the waiting queue",
        "OverlapScheduler.resolve",
        (
            "if seq in self.waiting:\n    self.waiting.remove(seq)\nelse:\n"
            "    self.manager.deallocate(seq)\n    self.running.remove(seq)\n"
            "    self.release(seq)",
            "self.manager.deallocate(seq)\nself.running.remove(seq)\nself.release(seq)",
        ),
    ),
    # ---- the loop ----
    mutant(
        "no_overlap",
        "the loop waits for the step in flight before it launches the next: correct tokens, "
        "no overlap",
        "OverlapEngine.step",
        (
            "launched = self._launch() if not self.scheduler.is_finished() else None\n"
            "if launched is None and self.in_flight is None:\n"
            "    raise RuntimeError('scheduler produced an empty batch with requests pending')\n"
            + LOOP,
            "finished = []\n"
            "if self.in_flight is not None:\n"
            "    done, self.in_flight = self.in_flight, None\n"
            "    finished = self.scheduler.resolve(done, done.token_ids(), self.eos_ids)\n"
            "launched = self._launch() if not self.scheduler.is_finished() else None\n"
            "if launched is not None:\n"
            "    self.scheduler.commit(launched)\n"
            "    self.in_flight = launched",
        ),
    ),
    mutant(
        "idle_step_returns",
        "a step with nothing to launch and nothing in flight returns no sequences instead of "
        "raising: a loop driving an idle engine spins forever",
        "OverlapEngine.step",
        (
            "raise RuntimeError('scheduler produced an empty batch with requests pending')",
            "return []",
        ),
    ),
    mutant(
        "commit_before_resolve",
        "the new step is committed before the last one resolves: a sequence that ends then "
        "still owes the discarded step's token",
        "OverlapEngine.step",
        (
            LOOP,
            "finished = []\nif launched is not None:\n    self.scheduler.commit(launched)\n"
            "if self.in_flight is not None:\n    done, self.in_flight = self.in_flight, None\n"
            "    finished = self.scheduler.resolve(done, done.token_ids(), self.eos_ids)\n"
            "if launched is not None:\n    self.in_flight = launched",
        ),
    ),
)
