"""The OpenAI-compatible HTTP API over a ``Scheduler``: a Starlette application.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` and ``POST
/v1/chat/completions``, with ``stream`` (server-sent events: ``data:`` chunks, then ``data:
[DONE]``; ``stream_options.include_usage`` adds a last chunk with the usage) or without.
Parameters: ``max_tokens`` (chat: or ``max_completion_tokens``), ``stop`` (a string or up to four),
``temperature``, ``top_p``, ``seed``, ``n`` (1 only). Errors have OpenAI's shape ``{"error":
{"message", "type", "param", "code"}}``: 400 for a bad request (naming the parameter), 429 with
``Retry-After`` when the queue is full (the ``openai`` client waits and retries), 500 when the
engine failed. A client that disconnects (streaming or not) cancels its request, which releases its pages.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from butter_core.errors import ButterError
from butter_core.sampling import Sampler
from butter_core.serving.scheduler import QueueFull, Scheduler, Ticket, Token

RETRY_AFTER_SECONDS = 1
"""What a 429 answer asks the client to wait."""

DISCONNECT_POLL_SECONDS = 0.25
"""How often a request answered whole checks that its client is still connected."""

UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "tools": (None, []), "functions": (None, []), "best_of": (None, 1),
}
"""OpenAI parameters butter does not implement, with the values that ask for nothing (accepted)."""


class RequestError(Exception):
    """A request the API refuses: its status, message, the parameter at fault and OpenAI's code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if self.status == 429 else None
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


def make_app(scheduler: Scheduler, model_id: str, *, default_max_tokens: int = 512) -> Starlette:
    """The application serving ``scheduler``'s model under the name ``model_id``; a chat request that
    gives no ``max_tokens`` generates at most ``default_max_tokens`` (a completion: 16, as OpenAI's)."""
    api = _Api(scheduler, model_id, default_max_tokens)
    return Starlette(
        routes=[
            Route("/health", api.health, methods=["GET"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        ],
        exception_handlers={404: _not_found, 405: _not_allowed},
    )


async def _not_found(request: Request, exc) -> JSONResponse:
    return RequestError(404, f"no route {request.method} {request.url.path}", code="not_found").response()


async def _not_allowed(request: Request, exc) -> JSONResponse:
    return RequestError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed").response()


class _Api:
    def __init__(self, scheduler: Scheduler, model_id: str, default_max_tokens: int):
        self.scheduler, self.model_id, self.default_max_tokens = scheduler, model_id, default_max_tokens
        self.tokenizer = scheduler.model.tokenizer
        self.created = int(time.time())

    async def health(self, request: Request) -> JSONResponse:
        ledger = self.scheduler.ledger()
        return JSONResponse({"status": "ok", "model": self.model_id, "waiting": ledger.waiting, "running": ledger.running,
                             "pages_reserved": ledger.pages_reserved, "pages_held": ledger.pages_held, "pages": ledger.pages,
                             "bytes_reserved": ledger.bytes_reserved, "bytes_total": ledger.bytes_total,
                             "prefix_cache_entries": ledger.prefix_cache_entries,
                             "prefix_cache_bytes": ledger.prefix_cache_bytes})  # fmt: skip

    async def models(self, request: Request) -> JSONResponse:
        model = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "butter"}
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await _json_body(request)
            parsed = self._parse(body, chat=chat)
            ticket = self.scheduler.submit(parsed.prompt, max_tokens=parsed.max_tokens, sampler=parsed.sampler)
        except RequestError as exc:
            return exc.response()
        except QueueFull as exc:
            return RequestError(429, f"{exc}; retry later", code="queue_full", kind="rate_limit_error").response()
        except ButterError as exc:
            return RequestError(400, str(exc), param="messages" if chat else "prompt",
                                code="context_length_exceeded").response()  # fmt: skip
        completion = _Completion(self, parsed, ticket, chat=chat)
        if parsed.stream:
            return StreamingResponse(completion.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        whole = asyncio.ensure_future(completion.whole())
        try:
            while not (await asyncio.wait({whole}, timeout=DISCONNECT_POLL_SECONDS))[0]:
                if await request.is_disconnected():  # nobody will read the answer: stop generating it
                    whole.cancel()
                    return Response(status_code=499)
            return JSONResponse(whole.result())
        except RequestError as exc:
            return exc.response()
        finally:
            self.scheduler.cancel(ticket)

    def _parse(self, body: dict, *, chat: bool) -> _Parsed:
        n = body.get("n", 1)
        if n != 1:
            raise RequestError(400, f"n must be 1 (one choice per request), got {n!r}", param="n")
        for unsupported, harmless in UNSUPPORTED.items():
            if body.get(unsupported) not in harmless:
                raise RequestError(400, f"{unsupported} is not supported by butter serve", param=unsupported)
        param = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        limit = body.get(param)
        max_tokens = _positive_int(limit, param) if limit is not None else (self.default_max_tokens if chat else 16)
        temperature = _number(body.get("temperature", 1.0), "temperature", 0.0, 2.0)
        top_p = _number(body.get("top_p", 1.0), "top_p", 0.0, 1.0)
        if top_p == 0.0:
            raise RequestError(400, "top_p must be in (0, 1]", param="top_p")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise RequestError(400, f"seed must be an integer, got {seed!r}", param="seed")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise RequestError(400, "stop must be a non-empty string or a list of up to 4 of them", param="stop")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(400, f"stream must be true or false, got {stream!r}", param="stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError(400, "stream_options must be an object", param="stream_options")
        prompt = self._chat_prompt(body.get("messages")) if chat else self._text_prompt(body.get("prompt"))
        return _Parsed(prompt, max_tokens, Sampler(temperature, top_p, seed), stops, stream,
                       bool(options.get("include_usage")))  # fmt: skip

    def _text_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
            if not all(0 <= t < self.tokenizer.vocab_size for t in ids):
                raise RequestError(400, f"prompt token ids must lie in 0..{self.tokenizer.vocab_size - 1}", param="prompt")
        else:
            raise RequestError(400, "prompt must be a string, a list of one string, or a list of token ids", param="prompt")
        if not ids:
            raise RequestError(400, "prompt is empty", param="prompt")
        return ids

    def _chat_prompt(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
        turns = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError(400, f"messages[{i}] must be an object with a role", param=f"messages[{i}]")
            content = message.get("content")
            if isinstance(content, list):
                parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                    raise RequestError(400, f"messages[{i}].content: only text parts are supported",
                                       param=f"messages[{i}].content")  # fmt: skip
                content = "".join(parts)
            if not isinstance(content, str):
                raise RequestError(400, f"messages[{i}].content must be a string or text parts", param=f"messages[{i}].content")
            turns.append({"role": message["role"], "content": content})
        try:
            rendered = self.tokenizer.apply_chat_template(turns)
        except ButterError as exc:
            raise RequestError(400, str(exc), param="messages") from exc
        return self.tokenizer.encode(rendered, add_special_tokens=False)


class _Parsed:
    def __init__(self, prompt: list[int], max_tokens: int, sampler: Sampler, stops: list[str], stream: bool,
                 include_usage: bool):  # fmt: skip
        self.prompt, self.max_tokens, self.sampler = prompt, max_tokens, sampler
        self.stops, self.stream, self.include_usage = stops, stream, include_usage


class _Completion:
    """One request's generation turned into OpenAI's objects: text deltas (held back while they may
    still begin a stop string), the finish reason and the usage."""

    def __init__(self, api: _Api, parsed: _Parsed, ticket: Ticket, *, chat: bool):
        self.api, self.parsed, self.ticket, self.chat = api, parsed, ticket, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.detokenizer = api.tokenizer.detokenizer()
        self.text = ""
        self.sent = 0
        self.tokens = 0

    async def deltas(self) -> AsyncIterator[tuple[str, str | None]]:
        """``(text, None)`` pieces, then ``(rest, finish_reason)``."""
        hold = max((len(s) for s in self.parsed.stops), default=1) - 1
        async for event in self.ticket.events():
            if isinstance(event, Token):
                self.tokens += 1
                self.text += self.detokenizer.add(event.token_id)
                stopped = self._cut_at_stop()
                if stopped:
                    self.api.scheduler.cancel(self.ticket)
                    yield self._take(len(self.text)), "stop"
                    return
                ready = len(self.text) - hold
                if ready > self.sent:
                    yield self._take(ready), None
                continue
            if event.reason == "error":
                raise RequestError(500, f"the engine failed: {event.error}", code="engine_error", kind="server_error")
            self.text += self.detokenizer.flush()
            reason = "stop" if self._cut_at_stop() else ("length" if event.reason == "length" else "stop")
            yield self._take(len(self.text)), reason
            return

    def _cut_at_stop(self) -> bool:
        hits = [self.text.find(s, max(0, self.sent - len(s))) for s in self.parsed.stops]
        hits = [h for h in hits if h >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def _take(self, end: int) -> str:
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        return piece

    def usage(self) -> dict:
        prompt = self.ticket.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens, "total_tokens": prompt + self.tokens,
                "prompt_tokens_details": {"cached_tokens": self.ticket.cached_tokens}}  # fmt: skip

    async def whole(self) -> dict:
        reason = "stop"
        async for _, finish in self.deltas():
            reason = finish or reason
        choice = ({"index": 0, "message": {"role": "assistant", "content": self.text}, "logprobs": None,
                   "finish_reason": reason} if self.chat else
                  {"index": 0, "text": self.text, "logprobs": None, "finish_reason": reason})  # fmt: skip
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.api.model_id, "choices": [choice], "usage": self.usage()}  # fmt: skip

    async def sse(self) -> AsyncIterator[str]:
        """The stream: a chat's first chunk gives the role; a chunk per text piece; the finish reason;
        the usage if asked; ``[DONE]``. Cancelled (the client went away) or done, the request ends."""
        chunk = self._chunk
        try:
            if self.chat:
                yield _event(chunk({"role": "assistant", "content": ""}, None))
            try:
                async for piece, reason in self.deltas():
                    if piece:
                        yield _event(chunk({"content": piece} if self.chat else piece, None))
                    if reason is not None:
                        yield _event(chunk({} if self.chat else "", reason))
            except RequestError as exc:
                yield _event({"error": {"message": exc.message, "type": exc.kind, "param": None, "code": exc.code}})
                return
            if self.parsed.include_usage:
                yield _event({**chunk(None, None), "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
        finally:
            self.api.scheduler.cancel(self.ticket)

    @property
    def _chunk(self) -> Callable[[dict | str | None, str | None], dict]:
        def chunk(delta, reason):
            if self.chat:
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
            return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.api.model_id, "choices": [choice]}  # fmt: skip

        return chunk


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as exc:
        raise RequestError(400, f"the request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


def _positive_int(value, param: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise RequestError(400, f"{param} must be a positive integer, got {value!r}", param=param)
    return value


def _number(value, param: str, low: float, high: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(400, f"{param} must be a number in [{low}, {high}], got {value!r}", param=param)
    return float(value)
