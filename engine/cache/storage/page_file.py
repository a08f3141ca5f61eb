"""On-disk format of one L3 page file (the ``file`` backend): a fixed header, then the page's bytes.

Header (little-endian): magic ``KVFLPG02``, the 32-byte page key digest, KV dtype (16 bytes,
NUL-padded ASCII), host layout (24 bytes), page size in tokens (u32), payload bytes (u64), xxh3_64 of
the payload (u64), zero padding to ``HEADER_SIZE`` = 4096 so the payload is page-aligned in the file
(aligned copies from the OS page cache). The payload is the page's flat bytes in the writer's layout
order (``host_pool.get_page_buffer_views`` concatenated).

Payload bytes go through the CPU in 256 KiB pieces, each hashed right after the kernel copied it (into
the page cache on write, into the caller's buffers on read), while it is still in the CPU cache: the
hash never reads memory a second time, so it costs about 5 ms per 189 MB next to a 40-80 ms copy. Any
mismatch raises :class:`PageFileError` with the reason.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"KVFLPG02"
HEADER = struct.Struct("<8s32s16s24sIQQ")
HEADER_SIZE = 4096
PIECE = 256 << 10


class PageFileError(Exception):
    """A page file that must not be served: truncated, mismatched header or bad checksum.

    ``damaged`` is False when the file itself is intact but holds a page of another size than the
    reader's buffers (same key, other KV geometry), so it must not be deleted.
    """

    def __init__(self, reason: str, damaged: bool = True) -> None:
        super().__init__(reason)
        self.damaged = damaged


@dataclass(frozen=True)
class PageIdentity:
    """What a page file must say about itself: its key (64 hex) and the writer's KV geometry."""

    key: str
    dtype: str
    layout: str
    page_size: int


def pack_header(page: PageIdentity, nbytes: int, checksum: int, size: int = HEADER_SIZE) -> bytes:
    """The header naming ``page``, its payload bytes and xxh3_64 ``checksum``, zero-padded to ``size``."""
    fields = (MAGIC, bytes.fromhex(page.key), page.dtype.encode(), page.layout.encode(), page.page_size)
    return HEADER.pack(*fields, nbytes, checksum).ljust(size, b"\0")


def unpack_header(raw: bytes | bytearray | memoryview) -> tuple[PageIdentity, int, int]:
    """(identity, payload bytes, checksum) from a header; ``PageFileError`` if it is not one."""
    if len(raw) < HEADER.size or bytes(raw[: len(MAGIC)]) != MAGIC:
        raise PageFileError("bad or truncated header")
    _, key, dtype, layout, page_size, nbytes, checksum = HEADER.unpack_from(raw)
    try:
        page = PageIdentity(key.hex(), dtype.rstrip(b"\0").decode(), layout.rstrip(b"\0").decode(), page_size)
    except UnicodeDecodeError as exc:
        raise PageFileError("bad or truncated header") from exc
    return page, nbytes, checksum


def _pieces(buffers: Sequence[memoryview]) -> list[memoryview]:
    return [buf[start : start + PIECE] for buf in buffers for start in range(0, buf.nbytes, PIECE)]


def _readv_full(fd: int, bufs: list, total: int) -> int:
    """``readv`` into ``bufs`` (``total`` bytes) until full or the file ends; returns the bytes read."""
    n = os.readv(fd, bufs)
    if n == total or n == 0:
        return n
    views, done = [memoryview(b) for b in bufs], n
    while True:  # a short read before the end of the file: go on from where it stopped
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if not views:
            return done
        views[0] = views[0][n:]
        n = os.readv(fd, views)
        if n == 0:
            return done
        done += n


def write_header(fd: int, page: PageIdentity, nbytes: int, checksum: int) -> None:
    """Write the header of a page of ``nbytes`` payload bytes with xxh3_64 ``checksum`` at the start of
    ``fd`` (for writers that put the payload at ``HEADER_SIZE`` by other means, e.g. NIXL)."""
    _write_all(fd, pack_header(page, nbytes, checksum), 0)


def check_file(fd: int, expected: PageIdentity, want: int) -> int:
    """The payload checksum of the page file ``fd`` once its header matches ``expected`` and its size is
    the header's plus ``want`` payload bytes (for readers that fetch the payload by other means and check
    it afterwards); else :class:`PageFileError` with the reason :func:`read_page` would give."""
    raw = os.pread(fd, HEADER_SIZE, 0)
    checksum = _check_header(fd, raw if len(raw) >= HEADER_SIZE else b"", expected, want)
    have = os.fstat(fd).st_size - HEADER_SIZE
    if have < want:
        raise PageFileError(f"file has {have} payload bytes, header says {want}")
    if have > want:
        raise PageFileError(f"file has over {want} payload bytes, header says {want}")
    return checksum


def _write_all(fd: int, buf, offset: int) -> None:
    """Write every byte of ``buf`` at ``offset``, retrying short writes."""
    done = os.pwrite(fd, buf, offset)
    if done < len(buf):
        view = memoryview(buf)
        while done < view.nbytes:
            done += os.pwrite(fd, view[done:], offset + done)


def write_page(fd: int, page: PageIdentity, buffers: Sequence[memoryview]) -> int:
    """Write header + payload of ``buffers`` to the new, empty file ``fd``; returns payload bytes."""
    hasher, offset = xxhash.xxh3_64(), HEADER_SIZE
    for piece in _pieces(buffers):
        _write_all(fd, piece, offset)
        hasher.update(piece)  # right after the copy, while the piece is still in the CPU cache
        offset += piece.nbytes
    nbytes = offset - HEADER_SIZE
    _write_all(fd, pack_header(page, nbytes, hasher.intdigest()), 0)
    return nbytes


def read_page(fd: int, expected: PageIdentity, buffers: Sequence[memoryview]) -> int:
    """Fill ``buffers`` from the page file ``fd`` and verify it; returns payload bytes.

    Raises :class:`PageFileError` naming the first problem: bad header, a header field other than
    ``expected``, a payload size other than ``sum(buffers)``, a short or too-long file, a bad checksum.
    The buffers may hold partial data afterwards; the caller decides what to do with them. One
    ``readv`` per piece: the header comes with the first, a 1-byte sentinel (filled only by a too-long
    file) with the last.
    """
    header, sentinel = bytearray(HEADER_SIZE), bytearray(1)
    pieces = _pieces(buffers)
    want = sum(b.nbytes for b in buffers)
    hasher, got, last, checksum = xxhash.xxh3_64(), 0, len(pieces) - 1, 0
    bufs: list[memoryview | bytearray]
    for index, piece in enumerate(pieces or [memoryview(b"")]):
        bufs, size = [piece], piece.nbytes
        if index == 0:
            bufs, size = [header, piece], size + HEADER_SIZE
        if index >= last:
            bufs, size = [*bufs, sentinel], size + 1
        n = _readv_full(fd, bufs, size)
        if index == 0:
            checksum = _check_header(fd, header if n >= HEADER_SIZE else b"", expected, want)
            n -= HEADER_SIZE
        got += min(n, piece.nbytes)
        if n < piece.nbytes:
            raise PageFileError(f"file has {got} payload bytes, header says {want}")
        if n > piece.nbytes:
            raise PageFileError(f"file has over {got} payload bytes, header says {want}")
        hasher.update(piece)
    if hasher.intdigest() != checksum:
        raise PageFileError("checksum mismatch")
    return want


def check_identity(raw, expected: PageIdentity) -> tuple[int, int]:
    """(payload bytes, checksum) of a header whose key and KV geometry match ``expected``; else
    ``PageFileError`` naming the first field that differs."""
    page, nbytes, checksum = unpack_header(raw)
    for name in ("key", "dtype", "layout", "page_size"):
        if getattr(page, name) != getattr(expected, name):
            raise PageFileError(
                f"header {name} {getattr(page, name)!r} != expected {getattr(expected, name)!r}"
            )
    return nbytes, checksum


def checksum(buffers: Sequence[memoryview]) -> int:
    """xxh3_64 of ``buffers`` concatenated (the payload checksum the header carries)."""
    hasher = xxhash.xxh3_64()
    for piece in _pieces(buffers):
        hasher.update(piece)
    return hasher.intdigest()


def _check_header(fd: int, raw, expected: PageIdentity, want: int) -> int:
    """The header's checksum once its fields match ``expected`` and ``want``; else ``PageFileError``."""
    nbytes, checksum = check_identity(raw, expected)
    if nbytes != want:
        intact = os.fstat(fd).st_size == HEADER_SIZE + nbytes  # a whole page of another KV geometry
        raise PageFileError(f"header nbytes {nbytes} != expected {want}", damaged=not intact)
    return checksum


def read_payload_size(path: str) -> int:
    """Payload bytes a page file's header claims; 0 when missing or unreadable."""
    try:
        with open(path, "rb") as f:
            return unpack_header(f.read(HEADER_SIZE))[1]
    except (OSError, PageFileError):
        return 0
