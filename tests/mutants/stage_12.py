"""Stage 12 mutants: the n-gram lookup (propose_ngram), the rejection rule (num_accepted,
residual), the guesses and the rollback (SpeculativeScheduler.add_proposal / accept) and the loop
(SpeculativeEngine.step), one learner bug each."""

from __future__ import annotations

from tests.mutants import Mutant

NO_ROOM = "if not self.manager.can_append(seq):\n    return False"
DROP_GUESSES = "del seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]"
EMPTY_BATCH = (
    "if finished or self.scheduler.is_finished():\n    return finished\n"
    "raise RuntimeError('scheduler produced an empty batch with requests pending')"
)


def mutant(name: str, bug: str, target: str, *edits: tuple[str, str]) -> Mutant:
    return Mutant(12, name, bug, target, edits)


MUTANTS = (
    # ---- the n-gram lookup ----
    mutant(
        "ngram_matches_itself",
        "the search runs to the end of the sequence: the suffix finds itself, the newest match, "
        "with nothing after it, and nothing is ever proposed",
        "propose_ngram",
        ("np.flatnonzero(ids[:-1] == ids[-1])", "np.flatnonzero(ids == ids[-1])"),
    ),
    mutant(
        "ngram_oldest_occurrence",
        "the first occurrence of the suffix wins instead of the newest",
        "propose_ngram",
        ("int(ends[lengths == lengths.max()][-1])", "int(ends[lengths == lengths.max()][0])"),
    ),
    mutant(
        "ngram_followers_one_early",
        "the proposal starts at the match's last token instead of the token after it",
        "propose_ngram",
        ("ids[end + 1 : end + 1 + k]", "ids[end : end + k]"),
    ),
    mutant(
        "ngram_shortest_first",
        "the newest match of any length wins: a one-token suffix beats a longer, likelier one",
        "propose_ngram",
        ("int(ends[lengths == lengths.max()][-1])", "int(ends[lengths >= min_n][-1])"),
    ),
    mutant(
        "ngram_ignores_min_n",
        "n runs down to 1 whatever min_n says",
        "propose_ngram",
        ("lengths.max() < min_n", "lengths.max() < 1"),
    ),
    mutant(
        "ngram_whole_history",
        "the whole sequence is searched, not the newest 2,048 tokens: a suffix seen only long ago "
        "proposes, and the host's work grows with the sequence",
        "propose_ngram",
        ("np.asarray(token_ids[-LOOKUP_WINDOW:])", "np.asarray(token_ids)"),
    ),
    mutant(
        "ngram_window_before_the_suffix",
        "the window is the 2,048 tokens before the newest one: it reaches one token too far back",
        "propose_ngram",
        ("np.asarray(token_ids[-LOOKUP_WINDOW:])", "np.asarray(token_ids[-LOOKUP_WINDOW - 1 :])"),
    ),
    # ---- the rule ----
    mutant(
        "accept_after_a_rejection",
        "every passing proposal counts (a sum, not the run from the left): a guess after a "
        "rejected one is kept",
        "num_accepted",
        ("kept.long().cumprod(dim=1).sum(dim=1)", "kept.long().sum(dim=1)"),
    ),
    mutant(
        "accept_without_q",
        "a proposal is kept when p > u: the proposer's own probability q is left out",
        "num_accepted",
        ("uniforms * draft_probs <= target_probs", "target_probs > uniforms"),
    ),
    mutant(
        "padding_kept",
        "the columns past num_draft are judged too: padding counts as kept proposals",
        "num_accepted",
        (
            "(uniforms * draft_probs <= target_probs) & (columns < num_draft[:, None])",
            "uniforms * draft_probs <= target_probs",
        ),
    ),
    mutant(
        "residual_unclamped",
        "the residual is p - q, negative where q > p",
        "residual",
        ("(target - draft).clamp_(min=0)", "target - draft"),
    ),
    mutant(
        "residual_unnormalised",
        "the residual is max(0, p - q) without normalising it",
        "residual",
        ("mass / mass.sum(dim=-1, keepdim=True)", "mass"),
    ),
    # ---- guesses in ----
    mutant(
        "proposal_ignores_room",
        "add_proposal never asks can_append: a guess at a full pool runs the allocator dry",
        "SpeculativeScheduler.add_proposal",
        (NO_ROOM, ""),
    ),
    mutant(
        "proposal_preempts",
        "add_proposal preempts the newest other request to make room for a guess",
        "SpeculativeScheduler.add_proposal",
        (
            NO_ROOM,
            "while not self.manager.can_append(seq):\n"
            "    others = [s for s in self.running if s is not seq]\n"
            "    if not others:\n"
            "        return False\n"
            "    self.running.remove(others[-1])\n"
            "    self.preempt(others[-1])",
        ),
    ),
    mutant(
        "proposal_not_scheduled",
        "a guess is appended but not scheduled: the verify step computes the newest token only",
        "SpeculativeScheduler.add_proposal",
        ("seq.num_scheduled_tokens += 1", ""),
    ),
    # ---- rollback out ----
    mutant(
        "guesses_kept",
        "accept appends what the step gained after the guesses instead of in their place",
        "SpeculativeScheduler.accept",
        (DROP_GUESSES, ""),
    ),
    mutant(
        "no_truncate",
        "the blocks grown for rejected guesses are never given back: they leak until the "
        "request ends",
        "SpeculativeScheduler.accept",
        ("self.manager.truncate(seq, seq.num_cached_tokens)", ""),
    ),
    mutant(
        "drawn_token_cached",
        "num_cached_tokens = len(seq): the drawn token counts as stored, and its K/V is never "
        "computed",
        "SpeculativeScheduler.accept",
        ("seq.num_cached_tokens = len(seq) - 1", "seq.num_cached_tokens = len(seq)"),
    ),
    mutant(
        "past_the_stop",
        "every gained token is appended: a stop token inside the kept run does not end the request",
        "SpeculativeScheduler.accept",
        ("if reason is not None:\n    break", ""),
    ),
    mutant(
        "guesses_hashed",
        "the verify step is committed as stage 11 commits a step before the guesses are dropped: "
        "a block holding a rejected guess joins the prefix cache",
        "SpeculativeScheduler.accept",
        (
            DROP_GUESSES,
            "seq.num_cached_tokens += seq.num_scheduled_tokens\n"
            "if self.prefix_manager is not None:\n"
            "    self.prefix_manager.hash_blocks(seq)\n" + DROP_GUESSES,
        ),
    ),
    mutant(
        "finished_row_kept",
        "a request that finishes inside its kept run never frees its row",
        "SpeculativeScheduler.accept",
        ("self.release(seq)", ""),
    ),
    mutant(
        "finished_blocks_kept",
        "a request that finishes inside its kept run keeps its blocks",
        "SpeculativeScheduler.accept",
        ("self.manager.deallocate(seq)", ""),
    ),
    # ---- the loop ----
    mutant(
        "prefill_verified",
        "a prefill batch gets guesses too, and is verified as if it were a decode",
        "SpeculativeEngine.step",
        ("not batch.is_prefill", "True"),
    ),
    mutant(
        "always_verified",
        "a decode batch is verified even when nobody guessed: never a plain step",
        "SpeculativeEngine.step",
        ("any(seq.num_draft_tokens for seq in batch.seqs)", "True"),
    ),
    mutant(
        "uncounted_verify",
        "the runner's verify is called directly: no speculation stats, no step counted",
        "SpeculativeEngine.step",
        (
            "self.verify(batch, draft_probs, num_preempted_before)",
            "self.runner.verify(batch, draft_probs, self.rule)",
        ),
    ),
    mutant(
        "guessing_step_not_drained",
        "a guessing step after an overlapped one does not resolve the step in flight: guesses "
        "are appended while a token is still owed, and that token lands after them",
        "SpeculativeEngine.step",
        ("finished = self.drain()", "finished = []"),
    ),
    mutant(
        "drained_tokens_lost",
        "the sequences the drain finished are not returned: their requests never complete",
        "SpeculativeEngine.step",
        (
            "return finished + self.scheduler.accept(batch, verified.token_ids, self.eos_ids)",
            "return self.scheduler.accept(batch, verified.token_ids, self.eos_ids)",
        ),
    ),
    mutant(
        "empty_batch_always_raises",
        "an empty batch always raises, as stage 09's loop did: the call whose drain finished the "
        "last request raises instead of returning it",
        "SpeculativeEngine.step",
        (EMPTY_BATCH, "raise RuntimeError('scheduler produced an empty batch')"),
    ),
    mutant(
        "empty_batch_never_raises",
        "an empty batch returns what the drain finished, even nothing while requests wait: an "
        "engine that can run nothing spins forever instead of failing",
        "SpeculativeEngine.step",
        (EMPTY_BATCH, "return finished"),
    ),
)
