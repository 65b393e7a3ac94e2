"""Which proposer guesses (stage 12): n-gram lookup, a separate draft model, or the target's
own first layers; the runner builds it (a draft runs on the runner's device batch and packer)."""

from __future__ import annotations

from collections.abc import Callable

from nanoserve.config import EngineConfig
from nanoserve.engine.runner.launched import Proposer
from nanoserve.engine.runner.overlap_runner import OverlapRunner
from nanoserve.engine.speculation.draft_proposer import Draft, DraftProposer
from nanoserve.engine.speculation.ngram_proposer import NgramProposer, propose_ngram


def speculative_method(config: EngineConfig) -> str | None:
    """The proposer a config asks for: its speculative_method, else draft when it names a
    speculative_model, else ngram when it sets num_speculative_tokens (as vLLM infers the
    method from the options given); None when it asks for none: guessing is opt-in."""
    if config.speculative_method is not None:
        return config.speculative_method
    if config.speculative_model is not None:
        return "draft"
    return None if config.num_speculative_tokens is None else "ngram"


def proposer_for(
    config: EngineConfig, lookup=propose_ngram, draft: Draft | None = None
) -> Callable[[OverlapRunner], Proposer] | None:
    """How the runner builds its proposer: n-gram by `lookup` (a learner's, or ours), the
    separate draft model given (its own pages, built by the recipe), or self-speculation (the
    target's first layers on the target's pages: draft_num_layers, else half of them). None
    when the config asks for no guessing: stage 12 then runs stage 11's steps."""
    method = speculative_method(config)
    if method is None:
        return None
    if method == "ngram":
        max_n, min_n = config.prompt_lookup_max, config.prompt_lookup_min
        return lambda runner: NgramProposer(max_n, min_n, lookup)
    if draft is not None:
        separate = draft
        return lambda runner: DraftProposer(runner, separate, shares_pages=False)

    def own_layers(runner: OverlapRunner) -> Proposer:
        num_layers = config.draft_num_layers or runner.model.config.num_hidden_layers // 2
        own = Draft(runner.model, runner.attention, max(1, num_layers))
        return DraftProposer(runner, own, shares_pages=True)

    return own_layers
