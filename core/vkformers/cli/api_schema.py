"""OpenAI's API as the routes of ``vkformers serve`` share it (cli/serve.py and the modules beside it that read
requests and shape answers, cli/responses.py, cli/rerank.py): the error object they answer, the checks of a
request's numeric and true-or-false fields, a whole answer's wait for a client that may leave, and the Prometheus
text of /metrics."""
from __future__ import annotations

import asyncio

DISCONNECT_POLL_S = 0.5  # how often a request waiting for its whole output checks that its client is there


class ApiError(Exception):
    """An OpenAI-style error response: HTTP ``status`` and the error object's fields."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


async def while_connected(request, work):
    """The result of the coroutine ``work`` (a non-streamed answer being made), run while ``request``'s client
    stays: checked every DISCONNECT_POLL_S, however fast the work's tokens come; when the client has left, the work
    is cancelled and ApiError 499 raised."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ApiError(499, "the client closed the request", code="client_closed_request")
    finally:
        task.cancel()  # (nothing where it has finished)


def number_field(body: dict, name: str, default, kind=float, low=None, high=None):
    """``body[name]`` checked as a number (``kind`` int: an integer) within [low, high]; ``default`` where it is
    missing or null. Raises a 400 ApiError naming the field."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}",
                       param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ApiError(400, f"'{name}' must be {span}, got {value}", param=name)
    return kind(value)


def prometheus_text(rows, label: str) -> str:
    """Prometheus' text format of (name, kind, help, value) rows under one label set."""
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP vkformers_{name} {help_text}", f"# TYPE vkformers_{name} {kind}",
                  f"vkformers_{name}{label} {value}"]
    return "\n".join(lines) + "\n"


def flag_field(body: dict, name: str, default: bool) -> bool:
    """``body[name]`` checked as true or false; ``default`` where it is missing or null. Raises a 400 ApiError
    naming the field."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {value!r}", param=name)
    return value
