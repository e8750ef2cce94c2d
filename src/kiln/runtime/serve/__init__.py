"""`kiln serve`: one program behind OpenAI's HTTP API, torch-free (Starlette on uvicorn).

app.py builds the ASGI app for a program of any servable kind; llm.py serves language models on engine.py's
continuous batching over a slotted KV cache (the engine on a thread, or in a process of its own:
engine_process.py); embeddings.py and speech.py serve embedding and speech programs; protocol.py is the OpenAI
request checking and error shape; metrics.py the Prometheus text; server.py runs it.
Needs `pip install "kiln[serve]"` (starlette, uvicorn, python-multipart).
"""

from __future__ import annotations

from kiln.runtime.serve.app import create_app, program_kind
from kiln.runtime.serve.engine import Event, Generation, LLMEngine, QueueFullError
from kiln.runtime.serve.server import Server

__all__ = ["Event", "Generation", "LLMEngine", "QueueFullError", "Server", "create_app", "program_kind"]
