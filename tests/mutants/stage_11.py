"""Stage 11 mutants: the persistent batch's rows and deltas (PersistentBatch) and the scheduler's
update split at the step in flight (OverlapScheduler.commit / land, whose reference is the one
Scheduler's), one learner bug each."""

from __future__ import annotations

from tests.mutants import maker

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
FINISH = """
if seq in self.waiting:
    self.waiting.remove(seq)
else:
    self.manager.deallocate(seq)
    self.running.remove(seq)
    self.release(seq)
"""
APPEND = """
for token_id in gained:
    seq.append_token(token_id)
    reason = finish_reason(seq, token_id, self.eos_ids, self.config.max_model_len)
    if reason is not None:
        break
"""


mutant = maker(11)


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
    # ---- commit ----
    mutant(
        "pending_not_counted",
        "commit never counts the owed token: len(seq) misses it, and the next step feeds the "
        "token before it at the wrong position",
        "OverlapScheduler.commit",
        ("seq.num_pending += i in sampling", ""),
    ),
    mutant(
        "chunk_owes_a_token",
        "every sequence of a step owes a token, a prefill chunk too: its length runs one ahead",
        "OverlapScheduler.commit",
        ("seq.num_pending += i in sampling", "seq.num_pending += 1"),
    ),
    mutant(
        "cached_not_advanced",
        "commit clears the scheduled tokens without counting them as stored: every step "
        "recomputes the whole sequence as a prefill",
        "OverlapScheduler.commit",
        (COMMIT, COMMIT.replace("seq.num_cached_tokens += seq.num_scheduled_tokens\n", "")),
    ),
    mutant(
        "commit_finished",
        "a sequence that ended when the step before landed is still committed: it owes the "
        "discarded step's token and counts its K/V",
        "OverlapScheduler.commit",
        ("if seq.is_finished:\n    seq.num_scheduled_tokens = 0\n    continue", "pass"),
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
    # ---- land ----
    mutant(
        "finished_in_reverse",
        "the finished sequences come back last first (each put at the front of the list)",
        "OverlapScheduler.land",
        ("finished.append(seq)", "finished.insert(0, seq)"),
    ),
    mutant(
        "pending_not_landed",
        "land appends the owed token but never stops owing it: len(seq) counts it twice",
        "OverlapScheduler.land",
        ("seq.num_pending -= 1", ""),
    ),
    mutant(
        "discarded_token_kept",
        "the token sampled in the step after a sequence's end is appended to it",
        "OverlapScheduler.land",
        ("not gained or seq.is_finished", "not gained"),
    ),
    mutant(
        "chunk_lands_a_token",
        "a prefill chunk's empty landing is taken for a token: it stops owing one it never owed",
        "OverlapScheduler.land",
        ("not gained or seq.is_finished", "seq.is_finished"),
    ),
    mutant(
        "tokens_past_the_finish",
        "every landed token is appended, even those after the one that finished the sequence",
        "OverlapScheduler.land",
        (
            APPEND,
            "for token_id in gained:\n    seq.append_token(token_id)\n"
            "    reason = reason or finish_reason(seq, token_id, self.eos_ids, "
            "self.config.max_model_len)",
        ),
    ),
    mutant(
        "first_token_only",
        "land appends only the first token of each landing: stage 12's kept guesses are lost",
        "OverlapScheduler.land",
        (
            APPEND,
            "token_id = gained[0]\nseq.append_token(token_id)\n"
            "reason = finish_reason(seq, token_id, self.eos_ids, self.config.max_model_len)",
        ),
    ),
    mutant(
        "guesses_not_stored",
        "kept guesses are appended but their K/V is not counted as stored",
        "OverlapScheduler.land",
        ("seq.num_cached_tokens += len(gained) - 1", ""),
    ),
    mutant(
        "landed_guesses_not_hashed",
        "land counts kept guesses as stored but never hashes them: the blocks they fill join the "
        "prefix cache only when a later step's commit hashes",
        "OverlapScheduler.land",
        (
            "if self.prefix_manager is not None:\n    self.prefix_manager.hash_blocks(seq)",
            "",
        ),
    ),
    mutant(
        "preempted_hashed",
        "land hashes after every landing, also that of a sequence preempted while its token "
        "was in flight: it holds no blocks (the prefix manager fails)",
        "OverlapScheduler.land",
        (
            "if len(gained) > 1 and seq.status is SequenceStatus.RUNNING:\n"
            "    seq.num_cached_tokens += len(gained) - 1\n"
            "    if self.prefix_manager is not None:\n        self.prefix_manager.hash_blocks(seq)",
            "seq.num_cached_tokens += len(gained) - 1\nif self.prefix_manager is not None:\n"
            "    self.prefix_manager.hash_blocks(seq)",
        ),
    ),
    mutant(
        "length_past_max_model_len",
        "land ends a request when it grows past max_model_len, not when it reaches it: the "
        "request that fills its last position is scheduled again",
        "OverlapScheduler.land",
        (
            "finish_reason(seq, token_id, self.eos_ids, self.config.max_model_len)",
            "finish_reason(seq, token_id, self.eos_ids, self.config.max_model_len + 1)",
        ),
    ),
    mutant(
        "finish_without_reason",
        "a finished sequence is marked FINISHED by hand: no finish reason",
        "OverlapScheduler.land",
        ("seq.finish(reason)", "seq.status = SequenceStatus.FINISHED"),
    ),
    mutant(
        "finished_not_returned",
        "land finishes and frees sequences but returns none of them: the engine never hands "
        "them back",
        "OverlapScheduler.land",
        ("finished.append(seq)", ""),
    ),
    mutant(
        "finished_row_kept",
        "a finished sequence never frees its row",
        "OverlapScheduler.land",
        ("self.release(seq)", ""),
    ),
    mutant(
        "finished_blocks_kept",
        "a finished sequence leaves running but its blocks are never given back",
        "OverlapScheduler.land",
        ("self.manager.deallocate(seq)", ""),
    ),
    mutant(
        "finished_stays_running",
        "a finished sequence gives its blocks and row back but stays in the running queue",
        "OverlapScheduler.land",
        ("self.running.remove(seq)", ""),
    ),
    mutant(
        "preempted_finish_stays_waiting",
        "a sequence preempted while its last token was in flight finishes, but stays in the "
        "waiting queue: it is admitted again",
        "OverlapScheduler.land",
        (FINISH, FINISH.replace("    self.waiting.remove(seq)", "    pass")),
    ),
    mutant(
        "preempted_deallocated_again",
        "a sequence preempted while its last token was in flight is freed again when it "
        "finishes (it holds nothing, and is not running)",
        "OverlapScheduler.land",
        (FINISH, "self.manager.deallocate(seq)\nself.running.remove(seq)\nself.release(seq)"),
    ),
)
