"""Stage 12 mutants: the n-gram lookup (propose_ngram), the rejection rule (num_accepted,
residual), and a guess's bookkeeping in the one scheduler (SpeculativeScheduler.make_room before
the verify step, land and settle_guesses after it), one learner bug each."""

from __future__ import annotations

from tests.mutants import maker
from tests.mutants.stage_11 import FINISH as FINISHED  # land's finish, stage 11's text

RESERVE = "return self.room.reserve(seq, len(seq) + budget) - len(seq)"
KEPT_KV = """
if len(gained) > 1 and seq.status is SequenceStatus.RUNNING:
    seq.num_cached_tokens += len(gained) - 1
    if self.prefix_manager is not None:
        self.prefix_manager.hash_blocks(seq)
"""
HASH = "if self.prefix_manager is not None:\n    self.prefix_manager.hash_blocks(seq)"
JUDGED = "self.speculation.judged(landed.plan, landed.tokens)"
GIVE_BACK = "self.give_back(seq, seq.num_cached_tokens)"
KEEP_IN_FLIGHT = "self.give_back(seq, len(seq) + later[seq])"
LATER = "later = dict(zip(in_flight.seqs, in_flight.guesses or [0] * len(in_flight.seqs)))"


mutant = maker(12)


MUTANTS = (
    # ---- the n-gram lookup ----
    mutant(
        "ngram_matches_itself",
        "the search runs to the end of the sequence: the suffix finds itself, the newest match, "
        "with nothing after it, and nothing is ever proposed",
        "propose_ngram",
        ("ids[last - 1 :: -1]", "ids[last::-1]"),
        ("last - 1 - found", "last - found"),
    ),
    mutant(
        "ngram_oldest_occurrence",
        "of the longest matches, the oldest wins instead of the newest",
        "propose_ngram",
        ("n > best_n", "n >= best_n"),
        ("best_n < max_n", "True"),
    ),
    mutant(
        "ngram_followers_one_early",
        "the proposal starts at the match's last token instead of the token after it",
        "propose_ngram",
        ("ids[best_end + 1 : best_end + 1 + k]", "ids[best_end : best_end + k]"),
    ),
    mutant(
        "ngram_shortest_first",
        "the newest match of any length wins: a one-token suffix beats a longer, likelier one",
        "propose_ngram",
        ("n > best_n", "best_n == 0"),
    ),
    mutant(
        "ngram_ignores_min_n",
        "n runs down to 1 whatever min_n says",
        "propose_ngram",
        ("best_n < max(min_n, 1)", "best_n < 1"),
    ),
    mutant(
        "ngram_whole_history",
        "the whole sequence is searched, not the newest 2,048 tokens: a suffix seen only long ago "
        "proposes, and the host's work grows with the sequence",
        "propose_ngram",
        ("token_ids[-LOOKUP_WINDOW:]", "token_ids"),
    ),
    mutant(
        "ngram_window_before_the_suffix",
        "the window is the 2,048 tokens before the newest one: it reaches one token too far back",
        "propose_ngram",
        ("token_ids[-LOOKUP_WINDOW:]", "token_ids[-LOOKUP_WINDOW - 1 :]"),
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
    # ---- room before the verify step ----
    mutant(
        "room_from_stored",
        "make_room counts from the stored tokens, not from all of them: the newest token's slot "
        "is counted as a guess's, and the last guess has no slot",
        "SpeculativeScheduler.make_room",
        (
            RESERVE,
            "return self.room.reserve(seq, seq.num_cached_tokens + budget) - seq.num_cached_tokens",
        ),
    ),
    mutant(
        "room_claimed_not_found",
        "make_room reserves what it can but answers the whole budget: with few free blocks the "
        "plan has guesses with no slot",
        "SpeculativeScheduler.make_room",
        (RESERVE, "self.room.reserve(seq, len(seq) + budget)\nreturn budget"),
    ),
    mutant(
        "room_for_the_drawn_token",
        "make_room reserves a slot for the drawn token too and counts it out: with a full table "
        "the plan asks for a negative number of guesses",
        "SpeculativeScheduler.make_room",
        (RESERVE, "return self.room.reserve(seq, len(seq) + budget + 1) - len(seq) - 1"),
    ),
    mutant(
        "room_by_preempting",
        "make_room preempts the newest other request until the whole budget fits: a guess "
        "pushes a request out of memory",
        "SpeculativeScheduler.make_room",
        (
            RESERVE,
            "others = [s for s in self.running if s is not seq]\n"
            "while others and self.room.reserve(seq, len(seq) + budget) < len(seq) + budget:\n"
            "    victim = others.pop()\n"
            "    self.running.remove(victim)\n"
            "    self.preempt(victim)\n" + RESERVE,
        ),
    ),
    # ---- the verdict lands ----
    mutant(
        "kept_guesses_not_stored",
        "land appends the kept guesses but does not count their K/V as stored: the next step "
        "computes them again, and the room past the stored tokens is cut under them",
        "SpeculativeScheduler.land",
        (
            KEPT_KV,
            "if len(gained) > 1 and self.prefix_manager is not None:\n"
            "    self.prefix_manager.hash_blocks(seq)",
        ),
    ),
    mutant(
        "preempted_in_flight_hashed",
        "land counts and hashes the kept guesses of a sequence preempted while its step ran: "
        "it holds no blocks, and the prefix manager raises KeyError",
        "SpeculativeScheduler.land",
        (KEPT_KV, KEPT_KV.replace(" and seq.status is SequenceStatus.RUNNING", "")),
    ),
    mutant(
        "drawn_token_stored",
        "land counts the drawn token's K/V as stored too: it is never computed",
        "SpeculativeScheduler.land",
        ("seq.num_cached_tokens += len(gained) - 1", "seq.num_cached_tokens += len(gained)"),
    ),
    mutant(
        "stored_past_the_finish",
        "land counts the kept guesses as stored before it appends them: a request that ends "
        "inside its kept run counts K/V past its last token",
        "SpeculativeScheduler.land",
        (
            KEPT_KV,
            "if len(gained) > 1 and self.prefix_manager is not None:\n"
            "    self.prefix_manager.hash_blocks(seq)",
        ),
        ("seq.num_pending -= 1", "seq.num_pending -= 1\nseq.num_cached_tokens += len(gained) - 1"),
    ),
    mutant(
        "kept_blocks_not_hashed",
        "land never hashes: blocks that kept guesses filled are shareable only a step later",
        "SpeculativeScheduler.land",
        (HASH, "pass"),
    ),
    mutant(
        "hashed_before_stored",
        "land hashes before it counts the kept guesses as stored: the blocks they filled are "
        "shareable only a step later",
        "SpeculativeScheduler.land",
        (
            KEPT_KV,
            "if len(gained) > 1:\n    "
            + HASH.replace("\n", "\n    ")
            + "\n    seq.num_cached_tokens += len(gained) - 1",
        ),
    ),
    mutant(
        "past_the_stop",
        "every gained token is appended: a stop token inside the kept run does not end the request",
        "SpeculativeScheduler.land",
        ("if reason is not None:\n    break", ""),
    ),
    mutant(
        "token_after_the_end",
        "a request that finished while its step ran still gains that step's tokens",
        "SpeculativeScheduler.land",
        ("not gained or seq.is_finished", "not gained"),
    ),
    mutant(
        "token_still_owed",
        "land never pays the owed token back (num_pending): the request counts one token too many",
        "SpeculativeScheduler.land",
        ("seq.num_pending -= 1", ""),
    ),
    mutant(
        "finished_blocks_kept",
        "a request that finishes inside its kept run keeps its blocks",
        "SpeculativeScheduler.land",
        ("self.manager.deallocate(seq)", ""),
    ),
    mutant(
        "finished_row_kept",
        "a request that finishes inside its kept run never frees its row",
        "SpeculativeScheduler.land",
        ("self.release(seq)", ""),
    ),
    mutant(
        "preempted_deallocated_again",
        "a request preempted while its last token was in flight is deallocated again when it "
        "finishes (it holds nothing: the manager fails) and stays in the waiting queue",
        "SpeculativeScheduler.land",
        (FINISHED, "self.manager.deallocate(seq)\nself.running.remove(seq)\nself.release(seq)"),
    ),
    # ---- the room given back ----
    mutant(
        "room_never_given_back",
        "settle_guesses gives nothing back: the blocks of rejected guesses leak until the "
        "request ends",
        "SpeculativeScheduler.settle_guesses",
        (GIVE_BACK, "pass"),
        (KEEP_IN_FLIGHT, "pass"),
    ),
    mutant(
        "room_cut_under_the_step_in_flight",
        "settle_guesses always keeps only the stored K/V: the step launched after the verdict's "
        "writes its newest token and guesses into blocks given back (another request may take "
        "them)",
        "SpeculativeScheduler.settle_guesses",
        (
            "if seq in later:\n    " + KEEP_IN_FLIGHT + "\nelse:\n    " + GIVE_BACK,
            GIVE_BACK,
        ),
    ),
    mutant(
        "in_flight_guesses_room_cut",
        "settle_guesses keeps the newest token of the step in flight but not its guesses' room",
        "SpeculativeScheduler.settle_guesses",
        (KEEP_IN_FLIGHT, "self.give_back(seq, len(seq))"),
    ),
    mutant(
        "plain_step_in_flight_missed",
        "settle_guesses reads the step in flight's budgets only: a step in flight that guesses "
        "nothing (its guesses are ()) runs nobody, and its newest token's block is given back",
        "SpeculativeScheduler.settle_guesses",
        (LATER, "later = dict(zip(in_flight.seqs, in_flight.guesses))"),
    ),
    mutant(
        "given_back_to_the_length",
        "settle_guesses keeps len(seq) tokens, not the stored ones: the drawn token's block is "
        "held for a step that may never come",
        "SpeculativeScheduler.settle_guesses",
        (GIVE_BACK, "self.give_back(seq, len(seq))"),
    ),
    mutant(
        "finished_given_back",
        "settle_guesses truncates every sequence with a budget, a finished one too: its table "
        "is gone, and the manager fails",
        "SpeculativeScheduler.settle_guesses",
        ("not budget or seq.status is not SequenceStatus.RUNNING", "not budget"),
    ),
    mutant(
        "back_off_never_told",
        "settle_guesses never tells the speculation policy: a request whose guesses always miss "
        "keeps guessing at every step",
        "SpeculativeScheduler.settle_guesses",
        ("if self.speculation is not None:\n    " + JUDGED, ""),
    ),
    mutant(
        "every_guess_missed",
        "settle_guesses tells the policy nothing was gained: a request that kept its guesses "
        "backs off",
        "SpeculativeScheduler.settle_guesses",
        (JUDGED, "self.speculation.judged(landed.plan, None)"),
    ),
)
