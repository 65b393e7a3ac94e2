"""Stage 10's incremental decoding and stop strings, now in `nanoserve.detokenizer`.

Introduced in stage 10; the code moved below `llm` when offline `SamplingParams` gained stop
strings, so `LLM.generate` and the server stop the same way. This name stays for the stage 10
lesson and the server's imports; it adds nothing.
"""

from __future__ import annotations

from nanoserve.detokenizer import INCOMPLETE, IncrementalDecoder, TextStream

__all__ = ["INCOMPLETE", "IncrementalDecoder", "TextStream"]
