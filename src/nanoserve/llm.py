"""`LLM`, the public entry point, shaped like vLLM's: load a model once, then generate or chat.

Introduced in stage 00. It keeps the tokenizer and the engine: it tokenizes, builds the engine of
the requested stage (whose model runner builds the model), drives the loop and detokenizes; n
completions, stop strings and outputs are completions.py's; all the mechanism lives in
`nanoserve.engine`, `nanoserve.cache` and `nanoserve.kernels`.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

from tqdm import tqdm

from nanoserve.completions import CompletionOutput, Logprob, RequestOutput, RequestRun
from nanoserve.config import engine_config_for
from nanoserve.llm_arguments import (
    chat_prompt,
    checked_conversations,
    checked_ids,
    prefix_caching_components,
    resolve_device,
    resolve_dtype,
)
from nanoserve.models.loader import load_model_config, load_tokenizer, model_source
from nanoserve.models.registry import DEFAULT_MODEL
from nanoserve.parallel.group import start_engine
from nanoserve.recipes.assemble import build_engine
from nanoserve.sampling import SamplingParams, child_params
from nanoserve.stages import latest_stage, require_implemented
from nanoserve.types import ModelSpec

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput"]


class LLM:
    """A model plus the engine of one stage."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        stage: int | None = None,
        device=None,
        dtype=None,
        components: dict | None = None,
        **engine_options,
    ):
        """Load `model` and build the engine as of `stage` (default: the newest).

        `components` replaces pieces of the stage's reference with your own, by their API names
        (e.g. {"BlockTable": MyBlockTable}); `engine_options` are `EngineConfig` fields
        (`enable_prefix_caching=False` runs a stage 07+ engine without sharing prefix blocks).
        """
        self.stage = latest_stage() if stage is None else require_implemented(stage)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        source = model_source(model)  # resolved once: a Hub id is looked up a single time
        self.model_config = load_model_config(source)
        self.tokenizer = load_tokenizer(source)
        self.config = engine_config_for(self.model_config, self.device, **engine_options)
        spec = ModelSpec(source, self.dtype, self.device)
        components = prefix_caching_components(
            self.stage.number, self.config.enable_prefix_caching, components
        )
        build = build_engine if self.config.tensor_parallel_size == 1 else start_engine
        self.engine = build(self.stage.number, self.config, spec, self.eos_ids(), components)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit; one rank: nothing to do)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    @property
    def model(self):
        """The model the engine's runner built."""
        return self.engine.runner.model

    def eos_ids(self) -> set[int]:
        """Token ids that end a completion: the config's and the tokenizer's EOS."""
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of the prompts, each with
        `SamplingParams.n` completions."""
        texts, prompt_ids = self._tokenize_all(prompts)
        params = self._params_per_prompt(sampling_params, len(prompt_ids))
        for i, (ids, p) in enumerate(zip(prompt_ids, params)):  # check all before queueing any
            try:
                self._check_request(ids, p)
            except ValueError as err:
                raise ValueError(f"prompts[{i}]: {err}") from None
        runs: list[RequestRun] = []
        try:  # the call owns its requests: however it ends, none is left queued or holding memory
            for text, ids, p in zip(texts, prompt_ids, params):
                runs.append(RequestRun(self.engine, text, ids, p, self.tokenizer))
            bar = tqdm(total=len(runs), desc="generate", disable=not use_tqdm or len(runs) < 2)
            with bar:
                active = runs
                while active:
                    self.engine.step()
                    for run in active:  # stop strings, and the children queued a step later
                        run.advance()
                    unfinished = [run for run in active if not run.is_finished]
                    bar.update(len(active) - len(unfinished))
                    active = unfinished
        finally:
            self.engine.abort([seq for run in runs for seq in run.seqs])
        return [run.output() for run in runs]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"}) or a list of them."""
        conversations = checked_conversations(messages)
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict]) -> str:
        """The prompt text for a conversation, ending where the assistant's turn begins."""
        self._need_tokenizer()
        return chat_prompt(self.tokenizer, conversation)

    def stream(
        self, prompt: str, sampling_params: SamplingParams | None = None
    ) -> Generator[str, None, RequestOutput]:
        """Yield pieces of the completion text as tokens are produced, one per step (maybe
        empty); the generator then returns the finished request's RequestOutput (`yield from` or
        StopIteration.value carries it). One completion: `SamplingParams.n` must be 1."""
        (text,), (ids,) = self._tokenize_all([prompt])
        (params,) = self._params_per_prompt(sampling_params, 1)
        if params.n != 1:
            raise ValueError(
                f"SamplingParams.n = {params.n}: stream yields one completion; use generate"
            )
        self._check_request(ids, params)
        run = RequestRun(self.engine, text, ids, params, self.tokenizer, streamed=True)
        (completion,) = run.completions
        try:  # closing the generator early (or an interrupt) aborts the request
            while not run.is_finished:
                self.engine.step()
                (piece,) = run.advance()
                if run.is_finished and not completion.is_stopped:
                    piece += completion.stream.finish()  # what was held back for a stop string
                yield piece
        finally:
            self.engine.abort(run.seqs)
        return run.output()

    def _tokenize_all(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a string, a list of strings or a list of id lists")
        texts: list[str | None] = []
        ids: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                self._need_tokenizer()
                texts.append(prompt)
                ids.append(self.tokenizer.encode(prompt, add_special_tokens=False))
            elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
                texts.append(None)
                ids.append(checked_ids(prompt, i))
            else:
                raise ValueError(
                    f"prompts[{i}] is a {type(prompt).__name__}; expected a str or a list of int "
                    "token ids"
                )
        return texts, ids

    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):
            raise ValueError(
                f"sampling_params is a {type(sampling_params).__name__}; pass one SamplingParams "
                "or a list with one per prompt"
            )
        if len(sampling_params) != n:
            raise ValueError(
                f"sampling_params has {len(sampling_params)} entries for {n} prompts; "
                "pass one SamplingParams or one per prompt"
            )
        for i, params in enumerate(sampling_params):
            if not isinstance(params, SamplingParams):
                raise ValueError(
                    f"sampling_params[{i}] is a {type(params).__name__}; expected SamplingParams"
                )
        return list(sampling_params)

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's checks, and stop strings need a tokenizer (n is expanded here)."""
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"SamplingParams.stop = {params.stop!r} needs text; this model has no tokenizer "
                "(use stop_token_ids)"
            )
        self.engine.check_request(prompt_ids, child_params(params)[0])  # they differ in seed
