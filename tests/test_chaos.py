"""The served path end to end under faults: the project's server and the runtime playing the tiny model through a
link that drops connections at seeded points (mid-frame, either way), in either protocol. Whatever the timing, every
request is answered once, right (the fp32 reference's targets), no state is stepped twice, and the client's own
count of what was scored agrees with the server's."""
import asyncio
import collections
import random

import pytest

from client.engine.reference import ReferenceEngine
from client.model import load_model
from client.runtime import COMPLETE, StreamingClient
from server import ScoringServer, ServerConfig
from server.limits import Limits
from team.example_model import ExampleModel

REQUESTS = 300


class FaultyLink:
    """A TCP relay to the server whose first connections are each cut, both ways at once (no close of either
    protocol), once `bytes` have passed in their direction: the last chunk's first part is relayed, the rest lost."""

    def __init__(self, port, faults):
        self.port, self.faults = port, list(faults)  # [(direction "down" or "up", bytes)], one per connection
        self.cuts = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _relay(self, client_reader, client_writer):
        fault = self.faults.pop(0) if self.faults else None
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.port)
        writers = (client_writer, server_writer)

        async def pump(reader, writer, direction):
            passed = 0
            while data := await reader.read(4096):
                if fault is not None and fault[0] == direction and passed + len(data) > fault[1]:
                    writer.write(data[:fault[1] - passed])
                    self.cuts += 1
                    for each in writers:
                        each.transport.abort()
                    return
                writer.write(data)
                passed += len(data)
                await writer.drain()
            writer.close()

        await asyncio.gather(pump(client_reader, server_writer, "up"), pump(server_reader, client_writer, "down"),
                             return_exceptions=True)
        for each in writers:
            each.transport.abort()


class Counting(ExampleModel):
    """The example client, counting how often each request is stepped."""

    def __init__(self, engine):
        super().__init__(engine)
        self.stepped = collections.Counter()

    def submit_batch(self, requests_by_symbol):
        self.stepped.update(uid for queued in requests_by_symbol.values() for uid, _ in queued)
        return super().submit_batch(requests_by_symbol)


@pytest.mark.parametrize("scheme", ["ws", "tcp"])
def test_connections_cut_at_seeded_points_lose_nothing_and_step_nothing_twice(scheme, tmp_path):
    rng = random.Random(42)
    # small cuts end a connection before its welcome, its resent scores or its backlog are read (each is reached as
    # soon as requests flow); larger ones mid-play, where the stream lasts long enough
    faults = [(rng.choice(["down", "up"]), rng.randint(1, 600)) for _ in range(6)]
    faults += [(rng.choice(["down", "up"]), rng.randint(600, 30_000)) for _ in range(6)]

    async def main():
        server = ScoringServer(ServerConfig(preset="tiny", seed=1, symbols=4, requests=REQUESTS, rate=200.0,
                                            timeout_s=30.0, cache_dir=str(tmp_path),
                                            limits=Limits(registration_burst=100)))
        link = FaultyLink(await server.start(), faults)
        team = Counting(ReferenceEngine(load_model("tiny", seed=1)[0]))
        client = StreamingClient(team, f"{scheme}://127.0.0.1:{await link.start()}", "chaos", leave_at_end=True,
                                 backoff_s=0.01, backoff_max_s=0.05, give_up_repeats=len(faults) + 1,
                                 timeout_s=30.0)
        summary = await asyncio.wait_for(client.run(), 120)
        [team_summary] = server.summaries()
        await server.stop()
        link.server.close()
        return summary, team_summary, team, link, client

    summary, team_summary, team, link, client = asyncio.run(main())
    assert link.cuts >= 4 and summary["connections"] > 4  # (a cut may end a probe, or come after the stream's end)
    assert summary["outcome"] == COMPLETE, summary["detail"]
    assert team_summary["responses"] == REQUESTS and team_summary["accuracy"] == 1.0
    assert team_summary["duplicates"] == team_summary["errors"] == team_summary["missed"] == 0
    assert sorted(team.stepped) == list(range(REQUESTS)) and set(team.stepped.values()) == {1}
    # every score reached the client, even those a drop took twice: it counts what the server counted
    assert summary["responses"] == REQUESTS and summary["accuracy"] == 1.0
    assert not client._send_tasks
