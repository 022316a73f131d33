"""``envbuild.serve.formdata``: a multipart body's parts read back whole however the
connection splits it, boundaries straddling pieces included; a broken body refused."""

from __future__ import annotations

import asyncio
import random

import pytest

from envbuild.serve.formdata import MAX_HEAD, BrokenBody, FormData

pytestmark = pytest.mark.fast
B = "b0undary"


class Pieces:
    def __init__(self, data: bytes, sizes: list[int]) -> None:
        self.data, self.sizes = data, sizes

    async def readany(self) -> bytes:
        n = self.sizes.pop(0) if self.sizes else len(self.data)
        piece, self.data = self.data[:n], self.data[n:]
        return piece


def body(files: list[tuple[str, bytes]], preamble: bytes = b"") -> bytes:
    out = preamble
    for name, data in files:
        out += (f"--{B}\r\nContent-Disposition: form-data; name=\"file\"; "
                f"filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
                ).encode() + data + b"\r\n"
    return out + f"--{B}--\r\n".encode()


def parts(data: bytes, sizes: list[int]) -> list[tuple[dict[str, str], bytes]]:
    async def main() -> list[tuple[dict[str, str], bytes]]:
        form, got = FormData(Pieces(data, sizes), B), []
        while (headers := await form.next_part()) is not None:
            content = b""
            while piece := await form.read():
                content += bytes(piece)
            got.append((headers, content))
        return got

    return asyncio.run(main())


def tricky(n: int, rng: random.Random) -> bytes:
    """Bytes full of near-boundaries: CRLFs, dashes, the boundary and its prefixes."""
    words = [b"\r\n", b"--", b"\r\n--", f"\r\n--{B[:-1]}".encode(), B.encode(), b"x" * 7]
    out = b""
    while len(out) < n:
        out += rng.choice(words) if rng.random() < 0.5 else rng.randbytes(rng.randint(1, 40))
    delim = f"\r\n--{B}".encode()
    while delim in out:  # a client picks a boundary its data does not hold
        out = out.replace(delim, delim[:-1] + b"X")
    return out[:n]


@pytest.mark.parametrize("seed", range(40))
def test_parts_come_back_whole_however_the_body_is_split(seed):
    rng = random.Random(seed)
    files = [(f"/tmp/f{i}", tricky(rng.choice([0, 1, 5, 300, 5000]), rng))
             for i in range(rng.randint(1, 4))]
    data = body(files, preamble=rng.choice([b"", b"ignored preamble\r\n"]))
    sizes = [rng.randint(1, 64) for _ in range(len(data))]
    got = parts(data, sizes)
    assert [c for _, c in got] == [d for _, d in files]
    assert [h["content-disposition"].split('filename="')[1][:-1] for h, _ in got] == \
        [n for n, _ in files]


def test_large_pieces_are_handed_on_as_slices_not_copies():
    data = body([("/tmp/big", bytes(range(256)) * 4096)])
    piece = data[: len(data) // 2]

    async def main() -> list[object]:
        form = FormData(Pieces(data, [len(piece)]), B)
        await form.next_part()
        return [await form.read()]

    (first,) = asyncio.run(main())
    assert isinstance(first, memoryview) and first.obj is not None
    assert len(first) > 400_000


@pytest.mark.parametrize("data", [
    body([("/tmp/a", b"cut")])[:-12],                         # ends inside the last part
    b"no boundary at all " * 2000,                            # nothing multipart
    f"--{B}\r\n".encode() + b"h" * (MAX_HEAD + 10),            # a header block never ending
])
def test_a_broken_body_is_refused(data):
    with pytest.raises(BrokenBody):
        parts(data, [1000] * (len(data) // 1000 + 1))


def test_a_boundary_that_cannot_be_used_is_refused():
    with pytest.raises(BrokenBody):
        FormData(Pieces(b"", []), "")
