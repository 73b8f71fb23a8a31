"""client/websocket_transport.py: what the client's websocket asks of a server."""
import asyncio

from websockets.asyncio.server import serve

from client.websocket_transport import connect_websocket


def test_the_client_offers_no_compression_to_a_server_that_would_take_it():
    negotiated = []

    async def handler(ws):
        negotiated.append(ws.protocol.extensions)  # websockets' server accepts permessage-deflate by default
        await ws.wait_closed()

    async def main():
        async with serve(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            connection = await connect_websocket(f"ws://127.0.0.1:{port}", open_timeout=5)
            while not negotiated:
                await asyncio.sleep(0.01)
            await connection.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert negotiated == [[]]
