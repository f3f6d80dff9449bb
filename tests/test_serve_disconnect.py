"""A non-streamed answer waits for its whole output while its client may leave (cli/api_schema.while_connected):
the wait ends with the work's result, or with a 499 and the work cancelled once the client has gone, checked on a
clock even while the work keeps running (tokens coming faster than the poll)."""
import asyncio

import pytest

from vkformers.cli import api_schema
from vkformers.cli.api_schema import ApiError, while_connected


class Client:
    def __init__(self, leaves_after: int | None):
        self.polls, self.leaves_after = 0, leaves_after

    async def is_disconnected(self) -> bool:
        self.polls += 1
        return self.leaves_after is not None and self.polls > self.leaves_after


def test_the_result_comes_back_while_the_client_stays(monkeypatch):
    monkeypatch.setattr(api_schema, "DISCONNECT_POLL_S", 0.01)

    async def work():
        await asyncio.sleep(0.05)
        return "answer"
    client = Client(leaves_after=None)
    assert asyncio.run(while_connected(client, work())) == "answer"
    assert client.polls >= 2  # it was asked meanwhile


def test_a_client_that_leaves_ends_busy_work_with_499(monkeypatch):
    monkeypatch.setattr(api_schema, "DISCONNECT_POLL_S", 0.01)
    state = {"steps": 0, "cancelled": False}

    async def busy():  # never done: yields to the loop between tokens, as the scheduler's updates come
        try:
            while True:
                state["steps"] += 1
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    async def run():
        with pytest.raises(ApiError) as raised:
            await while_connected(Client(leaves_after=2), busy())
        await asyncio.sleep(0)  # the cancellation lands
        return raised.value
    error = asyncio.run(run())
    assert (error.status, error.code) == (499, "client_closed_request")
    assert state["cancelled"] and state["steps"] > 3


def test_a_failing_work_raises_its_own_error(monkeypatch):
    monkeypatch.setattr(api_schema, "DISCONNECT_POLL_S", 0.01)

    async def fails():
        raise ApiError(500, "the batch failed")
    with pytest.raises(ApiError, match="the batch failed"):
        asyncio.run(while_connected(Client(leaves_after=None), fails()))
