"""Resident serving: one model answering many clients (``butter serve``).

- ``scheduler``: ``Scheduler``, the model's continuous batching on a thread of its own, with a
  session pool, a bounded FIFO queue and admission by the pages a request needs.
- ``openai_api``: the OpenAI-compatible HTTP API over it (a Starlette application).
- ``server``: the memory budget, and running the application under uvicorn.
"""
