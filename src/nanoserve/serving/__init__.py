"""`nanoserve serve`: an OpenAI-compatible HTTP server over the stage-10 engine loop.

Introduced in stage 10. protocol.py, openai_fields.py and chat_messages.py (requests as clients
send them, errors), responses.py (response shapes), text.py (token deltas to text, stop strings),
metrics.py (Prometheus metrics, one
registry per server), server.py (the FastAPI app and uvicorn), served_model.py,
completion.py and generation.py (a request's way to the engine and back),
connections.py and admission.py (what a request passes on its way in), limits.py and startup.py
(every limit, the API key).
The loop that steps the engine is `nanoserve.serving.async_engine`; nothing here touches the
engine but through it. FastAPI, uvicorn and prometheus_client are the `serve` extra:
`pip install 'nanoserve[serve]'`.
"""
