"""--limit-concurrency with several API keys: no tenant holds every slot."""

import asyncio
import json

from redknot.serve.http import ConcurrencyLimit


def _scope(key):
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return {"type": "http", "path": "/v1/completions", "method": "POST", "headers": headers}


def test_admission_keeps_a_slot_for_each_idle_key():
    lim = ConcurrencyLimit(None, limit=4, api_keys=("a", "b", "c"))
    assert lim.admits(0)
    lim.in_flight, lim.held = 2, [2, 0, 0]
    assert not lim.admits(0)  # a third for key a would leave one slot for b and c together
    assert lim.admits(1) and lim.admits(2)
    lim.in_flight, lim.held = 3, [2, 1, 0]
    assert not lim.admits(0) and not lim.admits(1) and lim.admits(2)
    lim.in_flight, lim.held = 4, [2, 1, 1]
    assert not lim.admits(2)  # full is full
    alone = ConcurrencyLimit(None, limit=4, api_keys=("a",))
    alone.in_flight, alone.held = 3, [3]
    assert alone.admits(0)  # one key: every slot is its


def test_more_keys_than_slots_each_key_still_gets_one():
    lim = ConcurrencyLimit(None, limit=2, api_keys=("a", "b", "c", "d"))
    lim.in_flight, lim.held = 1, [1, 0, 0, 0]
    assert not lim.admits(0) and lim.admits(3)


def test_one_tenant_cannot_take_every_slot_end_to_end():
    """Key a's requests beyond its share get a JSON 503 naming the key's share; key b still gets in."""
    release = asyncio.Event()

    async def app(scope, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    lim = ConcurrencyLimit(app, limit=3, api_keys=("a", "b"))

    async def call(key):
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(m):
            sent.append(m)
        await lim(_scope(key), receive, send)
        return sent

    async def main():
        held = [asyncio.create_task(call("a")) for _ in range(2)]
        await asyncio.sleep(0.01)
        refused = await call("a")
        assert refused[0]["status"] == 503
        assert "this API key" in json.loads(refused[1]["body"])["error"]["message"]
        b = asyncio.create_task(call("b"))
        await asyncio.sleep(0.01)
        assert lim.held == [2, 1]
        release.set()
        for t in held + [b]:
            assert (await t)[0]["status"] == 200
        assert lim.in_flight == 0 and lim.held == [0, 0]

    asyncio.run(main())
