"""A bare NBD client on a unix socket, for tests that must misbehave in
ways real clients never do (crawl a payload, never read replies)."""

import socket
import struct

NBD_MAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
OPT_EXPORT_NAME = 1
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
CMD_READ, CMD_WRITE = 0, 1


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("server closed the connection")
        out += chunk
    return out


def attach(path, name: str, timeout: float = 60) -> tuple[socket.socket, int]:
    """Connects and opens export `name` (NBD_OPT_EXPORT_NAME, no zeroes);
    returns the socket and the export's size."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(str(path))
    magic, opt, _flags = struct.unpack(">QQH", recv_exact(s, 18))
    assert (magic, opt) == (NBD_MAGIC, IHAVEOPT), "not an NBD fixed-newstyle server"
    s.sendall(struct.pack(">I", 3))  # FIXED_NEWSTYLE | NO_ZEROES
    data = name.encode()
    s.sendall(struct.pack(">QII", IHAVEOPT, OPT_EXPORT_NAME, len(data)) + data)
    size, _ = struct.unpack(">QH", recv_exact(s, 10))
    return s, size


def header(kind: int, handle: int, offset: int, length: int) -> bytes:
    return struct.pack(">IHHQQI", REQUEST_MAGIC, 0, kind, handle, offset, length)


def reply(s: socket.socket, data_len: int = 0) -> tuple[int, int, bytes]:
    """One simple reply: (error, handle, data)."""
    magic, error, handle = struct.unpack(">IIQ", recv_exact(s, 16))
    assert magic == SIMPLE_REPLY_MAGIC, hex(magic)
    return error, handle, recv_exact(s, data_len) if error == 0 and data_len else b""
