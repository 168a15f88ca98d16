"""dreamstage.client against a live server: sync and async, chat and completions, streaming or not."""
import asyncio

import pytest
from background_server import BackgroundServer

from dreamstage.client import AsyncClient, Client, DreamstageError
from dreamstage.server.settings import ServerSettings

MSGS = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(ServerSettings(ctx=1024, parallel=2, threads=1, max_queue=4)) as srv:
        yield srv


def test_sync_chat_and_stream_agree(server):
    with Client(server.url) as c:
        done = c.chat(MSGS, max_tokens=12, temperature=0)
        assert done.text and done.adapter_version == 0
        assert done.usage["completion_tokens"] <= 12
        pieces = list(c.chat(MSGS, max_tokens=12, temperature=0, stream=True))
        assert len(pieces) > 1
        assert "".join(pieces) == done.text
        assert c.last_stream.finish_reason == done.finish_reason
        assert c.last_stream.adapter_version == 0


def test_sync_completion_and_stream_agree(server):
    with Client(server.url) as c:
        done = c.complete("The first three letters are", max_tokens=8, temperature=0)
        assert done.finish_reason == "length" and done.text
        assert "".join(c.complete("The first three letters are", max_tokens=8, temperature=0, stream=True)) == done.text


def test_errors_carry_status_and_field(server):
    with Client(server.url) as c:
        with pytest.raises(DreamstageError) as e:
            c.chat(MSGS, max_tokens=-3)
        assert e.value.status == 400 and e.value.param == "max_tokens"
        with pytest.raises(DreamstageError) as e:
            list(c.chat([{"role": "nobody", "content": "x"}], stream=True))
        assert e.value.status == 400 and e.value.param == "messages[0].role"


def test_async_client_chat_stream_and_completion(server):
    async def main():
        async with AsyncClient(server.url) as c:
            done, other = await asyncio.gather(c.chat(MSGS, max_tokens=10, temperature=0),
                                               c.complete("Once upon a time", max_tokens=6, temperature=0))
            streamed = [p async for p in c.chat_stream(MSGS, max_tokens=10, temperature=0)]
            completion_stream = [p async for p in c.complete_stream("Once upon a time", max_tokens=6, temperature=0)]
            with pytest.raises(DreamstageError) as e:
                await c.complete("x", top_p=5)
            return done, other, streamed, completion_stream, e.value, await c.health()

    done, other, streamed, completion_stream, err, health = asyncio.run(main())
    assert "".join(streamed) == done.text and done.text
    assert "".join(completion_stream) == other.text and other.finish_reason == "length"
    assert err.status == 400 and err.param == "top_p"
    assert health["status"] == "ok" and health["slots"] == 2
