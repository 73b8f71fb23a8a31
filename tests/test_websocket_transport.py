"""client/websocket_transport.py: what the client's websocket asks of a server."""
import asyncio

import pytest
from websockets.asyncio.server import serve

from client.websocket_transport import connect_websocket


@pytest.mark.parametrize("compression, extensions", [(False, []), (True, ["permessage-deflate"])])
def test_the_client_offers_compression_only_when_asked(compression, extensions):
    negotiated = []

    async def handler(ws):  # websockets' server accepts permessage-deflate by default
        negotiated.append([extension.name for extension in ws.protocol.extensions])
        await ws.wait_closed()

    async def main():
        async with serve(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            connection = await connect_websocket(f"ws://127.0.0.1:{port}", open_timeout=5, compression=compression)
            while not negotiated:
                await asyncio.sleep(0.01)
            await connection.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert negotiated == [extensions]
