"""A TCP proxy that adds a first-byte latency to every request (``benchmarks/shaped_link.py``).

Each client connection gets its own upstream connection. A "request" is the first chunk the
client sends after the server last spoke (or after connecting): that chunk is held for
``--latency`` seconds before it is forwarded, so every HTTP/1.1 request on a keep-alive
connection — one per ranged GET of a lazy loader, one per blob of a full pull — pays one round
trip, as it would across a cell's network. Bytes are otherwise forwarded as they come, in
256 KiB reads. Runs until killed.

Usage: latency_proxy.py --listen 127.0.0.1:PORT --target HOST:PORT --latency SECONDS
"""

from __future__ import annotations

import argparse
import asyncio

CHUNK = 256 * 1024


class _Turn:
    """Whose turn it is: True once the server has spoken, so the client's next bytes are new."""

    def __init__(self) -> None:
        self.server_spoke = True


async def _client_to_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            turn: _Turn, latency: float) -> None:
    while data := await reader.read(CHUNK):
        if turn.server_spoke:
            turn.server_spoke = False
            await asyncio.sleep(latency)
        writer.write(data)
        await writer.drain()
    writer.write_eof() if writer.can_write_eof() else None


async def _server_to_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            turn: _Turn) -> None:
    while data := await reader.read(CHUNK):
        turn.server_spoke = True
        writer.write(data)
        await writer.drain()
    writer.write_eof() if writer.can_write_eof() else None


async def _serve(listen: tuple[str, int], target: tuple[str, int], latency: float) -> None:
    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(*target, limit=CHUNK)
        except OSError:
            c_writer.close()
            return
        turn = _Turn()
        try:
            await asyncio.gather(_client_to_server(c_reader, s_writer, turn, latency),
                                 _server_to_client(s_reader, c_writer, turn))
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (c_writer, s_writer):
                w.close()

    server = await asyncio.start_server(handle, *listen, limit=CHUNK, backlog=1024)
    async with server:
        await server.serve_forever()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--listen", required=True, type=_addr)
    ap.add_argument("--target", required=True, type=_addr)
    ap.add_argument("--latency", required=True, type=float)
    args = ap.parse_args()
    asyncio.run(_serve(args.listen, args.target, args.latency))


if __name__ == "__main__":
    main()
