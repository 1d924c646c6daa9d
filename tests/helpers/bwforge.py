#!/usr/bin/env python3
"""bwforge: read and forge bulwark pools offline, as an attacker with the device
files would (issue 20, decision 0011).

Written from docs/format.md alone (never from the Rust codecs): the superblock
slots, block pointers, the sealed volume table, map nodes and records. It
recomputes every unkeyed checksum, so what it forges is exactly what an attacker
holding the devices can make; given the pool key (DIR/pool.key) it also computes
the format 2 key check and superblock MAC, which only the host can, and which the
tests use as the control: the same forgery, sealed with the key, is accepted, so
a refusal without the key is the MAC's doing and nothing else's.

Pure Python: blake3 (hash, keyed hash), HKDF-SHA256, LZ4 blocks (a decompressor,
and a compressor that emits literal-only blocks, which are valid LZ4). Only the
volume table's AES-256-GCM needs `cryptography` (Debian python3-cryptography).

CLI (python3 bwforge.py ...):
  selftest                         blake3 against the BLAKE3 spec's test vectors
  show DEV...                      the newest superblock of each device, as JSON
  volumes DEV...                   the volume table (needs cryptography)
  map DEV... --volume NAME         (lba, pointer) of every mapped block
  nonces DEV...                    (volume uuid, key generation, salt, nonce) of every
                                   encrypted record reachable from the newest superblock
  log DEV...                       the intent log chain the newest superblock names
Every DEV list may be given as --pool DIR instead (device files from pool.json).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

KiB = 1024
MiB = 1024 * KiB

# --------------------------------------------------------------------------
# blake3 (https://github.com/BLAKE3-team/BLAKE3-specs), hash and keyed_hash

_IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
       0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
_PERM = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
_CHUNK_START, _CHUNK_END, _PARENT, _ROOT, _KEYED = 1, 2, 4, 8, 16
_M32 = 0xFFFFFFFF
_BLOCK = 64
_CHUNK = 1024


def _compress(cv, m, counter, block_len, flags):
    s = [cv[0], cv[1], cv[2], cv[3], cv[4], cv[5], cv[6], cv[7],
         _IV[0], _IV[1], _IV[2], _IV[3],
         counter & _M32, (counter >> 32) & _M32, block_len, flags]
    m = list(m)

    def g(a, b, c, d, x, y):
        sa, sb, sc, sd = s[a], s[b], s[c], s[d]
        sa = (sa + sb + x) & _M32
        sd ^= sa
        sd = ((sd >> 16) | (sd << 16)) & _M32
        sc = (sc + sd) & _M32
        sb ^= sc
        sb = ((sb >> 12) | (sb << 20)) & _M32
        sa = (sa + sb + y) & _M32
        sd ^= sa
        sd = ((sd >> 8) | (sd << 24)) & _M32
        sc = (sc + sd) & _M32
        sb ^= sc
        sb = ((sb >> 7) | (sb << 25)) & _M32
        s[a], s[b], s[c], s[d] = sa, sb, sc, sd

    for r in range(7):
        g(0, 4, 8, 12, m[0], m[1])
        g(1, 5, 9, 13, m[2], m[3])
        g(2, 6, 10, 14, m[4], m[5])
        g(3, 7, 11, 15, m[6], m[7])
        g(0, 5, 10, 15, m[8], m[9])
        g(1, 6, 11, 12, m[10], m[11])
        g(2, 7, 8, 13, m[12], m[13])
        g(3, 4, 9, 14, m[14], m[15])
        if r < 6:
            m = [m[i] for i in _PERM]
    for i in range(8):
        s[i] ^= s[i + 8]
        s[i + 8] ^= cv[i]
    return s


def _words(block: bytes):
    return struct.unpack("<16I", block.ljust(_BLOCK, b"\0"))


def _chunk_output(key_words, chunk: bytes, counter: int, flags: int):
    """(cv, last block words, block len, flags) of a chunk, the last block not yet compressed."""
    cv = list(key_words)
    nblocks = max(1, (len(chunk) + _BLOCK - 1) // _BLOCK)
    for i in range(nblocks):
        block = chunk[i * _BLOCK:(i + 1) * _BLOCK]
        f = flags
        if i == 0:
            f |= _CHUNK_START
        if i == nblocks - 1:
            f |= _CHUNK_END
            return cv, _words(block), counter, len(block), f
        cv = _compress(cv, _words(block), counter, _BLOCK, f)[:8]


def _blake3(data: bytes, key_words, flags: int) -> bytes:
    data = bytes(data)
    chunks = [data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
    # Each "output" is (cv, words, counter, len, flags): compressing it gives a CV, or the root.
    stack = []  # chaining values of complete subtrees, the usual merge discipline
    out = None
    for idx, ch in enumerate(chunks):
        out = _chunk_output(key_words, ch, idx, flags)
        if idx < len(chunks) - 1:
            cv = _compress(*out)[:8]
            total = idx + 1
            while total & 1 == 0:
                left = stack.pop()
                cv = _compress(key_words, _words(_pack(left) + _pack(cv)), 0, _BLOCK, flags | _PARENT)[:8]
                total >>= 1
            stack.append(cv)
    # Fold the stack into the last chunk's output, right to left.
    while stack:
        left = stack.pop()
        right = _compress(*out)[:8]
        out = (key_words, _words(_pack(left) + _pack(right)), 0, _BLOCK, flags | _PARENT)
    cv, words, counter, blen, f = out
    return _pack(_compress(cv, words, 0, blen, f | _ROOT)[:8])


def _pack(words) -> bytes:
    return struct.pack("<8I", *words[:8])


def blake3(data: bytes) -> bytes:
    """blake3-256 of data."""
    return _blake3(data, _IV, 0)


def blake3_keyed(key: bytes, data: bytes) -> bytes:
    """blake3::keyed_hash(key, data), 32 bytes."""
    assert len(key) == 32, "a blake3 key is 32 bytes"
    return _blake3(data, struct.unpack("<8I", key), _KEYED)


# From test_vectors/test_vectors.json of the BLAKE3 repository (first 32 bytes of
# each output; input = bytes i % 251, key "whats the Elvish word for friend").
BLAKE3_VECTORS = [
    (0, "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
        "92b2b75604ed3c761f9d6f62392c8a9227ad0ea3f09573e783f1498a4ed60d26"),
    (1, "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213",
        "6d7878dfff2f485635d39013278ae14f1454b8c0a3a2d34bc1ab38228a80c95b"),
    (1023, "10108970eeda3eb932baac1428c7a2163b0e924c9a9e25b35bba72b28f70bd11",
           "c951ecdf03288d0fcc96ee3413563d8a6d3589547f2c2fb36d9786470f1b9d6e"),
    (1024, "42214739f095a406f3fc83deb889744ac00df831c10daa55189b5d121c855af7",
           "75c46f6f3d9eb4f55ecaaee480db732e6c2105546f1e675003687c31719c7ba4"),
    (1025, "d00278ae47eb27b34faecf67b4fe263f82d5412916c1ffd97c8cb7fb814b8444",
           "357dc55de0c7e382c900fd6e320acc04146be01db6a8ce7210b7189bd664ea69"),
    (2048, "e776b6028c7cd22a4d0ba182a8bf62205d2ef576467e838ed6f2529b85fba24a",
           "879cf1fa2ea0e79126cb1063617a05b6ad9d0b696d0d757cf053439f60a99dd1"),
    (2049, "5f4d72f40d7a5f82b15ca2b2e44b1de3c2ef86c426c95c1af0b6879522563030",
           "9f29700902f7c86e514ddc4df1e3049f258b2472b6dd5267f61bf13983b78dd5"),
    (3072, "b98cb0ff3623be03326b373de6b9095218513e64f1ee2edd2525c7ad1e5cffd2",
           "044a0e7b172a312dc02a4c9a818c036ffa2776368d7f528268d2e6b5df191770"),
    (3073, "7124b49501012f81cc7f11ca069ec9226cecb8a2c850cfe644e327d22d3e1cd3",
           "68dede9bef00ba89e43f31a6825f4cf433389fedae75c04ee9f0cf16a427c95a"),
    (4096, "015094013f57a5277b59d8475c0501042c0b642e531b0a1c8f58d2163229e969",
           "befc660aea2f1718884cd8deb9902811d332f4fc4a38cf7c7300d597a081bfc0"),
    (4097, "9b4052b38f1c5fc8b1f9ff7ac7b27cd242487b3d890d15c96a1c25b8aa0fb995",
           "00df940cd36bb9fa7cbbc3556744e0dbc8191401afe70520ba292ee3ca80abbc"),
    (6145, "f1323a8631446cc50536a9f705ee5cb619424d46887f3c376c695b70e0f0507f",
           "9ac301e9e39e45e3250a7e3b3df701aa0fb6889fbd80eeecf28dbc6300fbc539"),
    (7169, "a003fc7a51754a9b3c7fae0367ab3d782dccf28855a03d435f8cfe74605e7817",
           "ed9b1a922c046fdb3d423ae34e143b05ca1bf28b710432857bf738bcedbfa511"),
]
BLAKE3_TEST_KEY = b"whats the Elvish word for friend"


def lz4_selftest() -> None:
    # One literal, an overlapping match of 4 + 15 + 0 bytes at offset 1, then 5 literals.
    block = b"\x1f" + b"a" + b"\x01\x00" + b"\x00" + b"\x50" + b"aaaaa"
    assert lz4_block_decompress(block) == b"a" * 25
    for n in (0, 1, 14, 15, 16, 269, 270, 271, 4112):
        data = os.urandom(n)
        assert lz4_block_decompress(lz4_block_compress(data)) == data, n
        assert lz4_unpack(lz4_pack(data, True))[0] == data, n


def blake3_selftest() -> None:
    for n, h, kh in BLAKE3_VECTORS:
        data = bytes(i % 251 for i in range(n))
        got = blake3(data).hex()
        assert got == h, f"blake3 of {n} bytes: {got}, expected {h}"
        got = blake3_keyed(BLAKE3_TEST_KEY, data).hex()
        assert got == kh, f"keyed blake3 of {n} bytes: {got}, expected {kh}"


# --------------------------------------------------------------------------
# HKDF-SHA256 (RFC 5869), pure


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    out, t, i = b"", b"", 1
    while len(out) < length:
        t = hmac.new(prk, t + info + bytes([i]), hashlib.sha256).digest()
        out += t
        i += 1
    return out[:length]


# --------------------------------------------------------------------------
# LZ4 block format (no frame); bulwark's records may carry the uncompressed size
# as a u32 prefix (lz4_flex's "prepend size"): lz4_unpack tells which by trying.


class LZ4Error(ValueError):
    pass


def lz4_block_decompress(src: bytes, max_out: int = 64 * MiB) -> bytes:
    out = bytearray()
    i, n = 0, len(src)
    while i < n:
        token = src[i]
        i += 1
        lit = token >> 4
        if lit == 15:
            while True:
                if i >= n:
                    raise LZ4Error("truncated literal length")
                b = src[i]
                i += 1
                lit += b
                if b != 255:
                    break
        if i + lit > n:
            raise LZ4Error("literals past the input")
        out += src[i:i + lit]
        i += lit
        if i == n:
            break  # the last sequence has literals only
        if i + 2 > n:
            raise LZ4Error("truncated offset")
        off = src[i] | (src[i + 1] << 8)
        i += 2
        if off == 0 or off > len(out):
            raise LZ4Error(f"bad match offset {off}")
        ml = token & 15
        if ml == 15:
            while True:
                if i >= n:
                    raise LZ4Error("truncated match length")
                b = src[i]
                i += 1
                ml += b
                if b != 255:
                    break
        ml += 4
        if len(out) + ml > max_out:
            raise LZ4Error("output too large")
        start = len(out) - off
        if off >= ml:
            out += out[start:start + ml]
        else:
            for k in range(ml):
                out.append(out[start + k])
    return bytes(out)


def lz4_block_compress(data: bytes) -> bytes:
    """A valid LZ4 block of literals only (one sequence, no match)."""
    n = len(data)
    if n < 15:
        return bytes([n << 4]) + data
    rest = n - 15
    ext = b"\xff" * (rest // 255) + bytes([rest % 255])
    return b"\xf0" + ext + data


def lz4_unpack(stored: bytes, expect_len: int | None = None) -> tuple[bytes, bool]:
    """Decompress a record: (bytes, size_prefixed). Tries the u32 size prefix first."""
    if len(stored) >= 4:
        want = struct.unpack_from("<I", stored)[0]
        try:
            out = lz4_block_decompress(stored[4:], max_out=want + 1)
            if len(out) == want and (expect_len is None or want == expect_len):
                return out, True
        except LZ4Error:
            pass
    out = lz4_block_decompress(stored)
    if expect_len is not None and len(out) != expect_len:
        raise LZ4Error(f"decompressed {len(out)} bytes, expected {expect_len}")
    return out, False


def lz4_pack(data: bytes, size_prefixed: bool) -> bytes:
    body = lz4_block_compress(data)
    return (struct.pack("<I", len(data)) + body) if size_prefixed else body


# --------------------------------------------------------------------------
# superblock (docs/format.md, "Superblock")

SB_BYTES = 4 * KiB
SB_MAGIC = b"BWSUPER1"
SLOT_OFFSETS = (0, 256 * KiB)
DATA_AT = 1 * MiB
SEG = 1 * MiB
NONE = (1 << 64) - 1
MAC_AT = 4064
KEYCHECK_AT = 1024
# format 2: blake3 of bytes 0..1056 (every field and the key check), checked by readers
# without the key; and the commit's random chain id, repeated by its intent log blocks
UNKEYED_SUM_AT = 1056
CHAIN_ID_AT = 608
KEYCHECK_LABEL = b"bulwark superblock key check v2"

# name: (offset, struct format)
SB_FIELDS = {
    "version": (8, "<I"),
    "layout": (12, "<B"),
    "copies": (13, "<B"),
    "parity": (14, "<B"),
    "state": (15, "<B"),
    "member_index": (48, "<I"),
    "member_count": (52, "<I"),
    "generation": (56, "<Q"),
    "bytes_used": (64, "<Q"),
    "segments_per_device": (72, "<Q"),
    "nonce_reserved": (80, "<Q"),
    "high_water": (88, "<I"),
    "log_version": (520, "<I"),
}


def superblock_key(pool_key: bytes, pool_id: bytes) -> bytes:
    return hkdf_sha256(pool_key, pool_id, b"bulwark2 superblock")


def log_key(pool_key: bytes, pool_id: bytes) -> bytes:
    return hkdf_sha256(pool_key, pool_id, b"bulwark2 log")


class Superblock:
    """One 4 KiB slot, editable; `seal()` recomputes its checksum or MAC."""

    def __init__(self, raw: bytes, device: str = "", offset: int = 0):
        assert len(raw) == SB_BYTES
        self.raw = bytearray(raw)
        self.device = device
        self.offset = offset

    def __getattr__(self, name):
        if name in SB_FIELDS:
            off, fmt = SB_FIELDS[name]
            return struct.unpack_from(fmt, self.raw, off)[0]
        raise AttributeError(name)

    def set(self, name, value) -> "Superblock":
        off, fmt = SB_FIELDS[name]
        struct.pack_into(fmt, self.raw, off, value)
        return self

    @property
    def magic_ok(self) -> bool:
        return bytes(self.raw[:8]) == SB_MAGIC

    @property
    def pool_id(self) -> bytes:
        return bytes(self.raw[16:32])

    @property
    def member_id(self) -> bytes:
        return bytes(self.raw[32:48])

    @property
    def member_ids(self) -> list[bytes]:
        return [bytes(self.raw[160 + 16 * i:176 + 16 * i]) for i in range(self.member_count)]

    @property
    def table_ptr(self) -> "Pointer":
        return Pointer(bytes(self.raw[96:160]))

    @table_ptr.setter
    def table_ptr(self, p: "Pointer"):
        self.raw[96:160] = p.encode()

    @property
    def table_key(self) -> bytes:
        return bytes(self.raw[416:448])

    @property
    def name(self) -> str:
        n = self.raw[448]
        return bytes(self.raw[449:449 + n]).decode(errors="replace")

    @property
    def mac(self) -> bytes:
        return bytes(self.raw[MAC_AT:MAC_AT + 32])

    @property
    def key_check(self) -> bytes:
        return bytes(self.raw[KEYCHECK_AT:KEYCHECK_AT + 32])

    # -- checks

    def checksum_ok_v1(self) -> bool:
        return blake3(bytes(self.raw[:MAC_AT])) == self.mac

    def key_check_ok(self, pool_key: bytes) -> bool:
        k = superblock_key(pool_key, self.pool_id)
        return blake3_keyed(k, KEYCHECK_LABEL + self.pool_id) == self.key_check

    def mac_ok(self, pool_key: bytes) -> bool:
        k = superblock_key(pool_key, self.pool_id)
        return blake3_keyed(k, bytes(self.raw[:MAC_AT])) == self.mac

    def valid(self, pool_key: bytes | None = None) -> bool:
        """Whether the slot would be read: format 1 by its blake3; format 2 by its MAC
        (with the key), or, without the key, at least not a format 1 checksum."""
        if not self.magic_ok:
            return False
        if self.version == 1:
            return self.checksum_ok_v1()
        if pool_key is not None:
            return self.mac_ok(pool_key)
        return True  # cannot tell without the key: taken as written by the host

    # -- sealing

    def seal_unkeyed(self) -> "Superblock":
        """What a device-only attacker can compute: every unkeyed checksum (format 2's
        blake3 of 0..1056 at 1056; blake3 of 0..4064 at 4064, format 1's checksum), every
        other byte (the key check included) as it is."""
        if self.version != 1:
            self.raw[UNKEYED_SUM_AT:UNKEYED_SUM_AT + 32] = blake3(bytes(self.raw[:UNKEYED_SUM_AT]))
        self.raw[MAC_AT:MAC_AT + 32] = blake3(bytes(self.raw[:MAC_AT]))
        return self

    def seal_with_key(self, pool_key: bytes) -> "Superblock":
        """The format 2 key check and MAC: what only the host (pool.key) can compute."""
        k = superblock_key(pool_key, self.pool_id)
        self.raw[KEYCHECK_AT:KEYCHECK_AT + 32] = blake3_keyed(k, KEYCHECK_LABEL + self.pool_id)
        self.raw[UNKEYED_SUM_AT:UNKEYED_SUM_AT + 32] = blake3(bytes(self.raw[:UNKEYED_SUM_AT]))
        self.raw[MAC_AT:MAC_AT + 32] = blake3_keyed(k, bytes(self.raw[:MAC_AT]))
        return self

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in SB_FIELDS}
        d.update(device=self.device, offset=self.offset, pool_id=self.pool_id.hex(),
                 member_id=self.member_id.hex(), name=self.name,
                 member_ids=[m.hex() for m in self.member_ids],
                 table=self.table_ptr.to_json(), mac=self.mac.hex(),
                 key_check=self.key_check.hex())
        return d


def read_slots(path) -> list[Superblock]:
    """The four slots of a device (front 0, front 1, back 0, back 1) that carry the magic."""
    out = []
    with open(path, "rb") as f:
        front = []
        for off in SLOT_OFFSETS:
            f.seek(off)
            front.append(Superblock(f.read(SB_BYTES), str(path), off))
        segs = {s.segments_per_device for s in front if s.magic_ok}
        slots = list(front)
        for s in segs:
            back = DATA_AT + s * SEG
            for off in SLOT_OFFSETS:
                f.seek(back + off)
                raw = f.read(SB_BYTES)
                if len(raw) == SB_BYTES:
                    slots.append(Superblock(raw, str(path), back + off))
    return [s for s in slots if s.magic_ok]


def newest_slot(path, pool_key: bytes | None = None) -> Superblock:
    slots = [s for s in read_slots(path) if s.valid(pool_key)]
    if not slots:
        raise ValueError(f"{path}: no valid superblock slot")
    return max(slots, key=lambda s: s.generation)


# --------------------------------------------------------------------------
# block pointers (docs/format.md, "Block pointer")

FLAG_LZ4 = 1
FLAG_AEAD = 2
SALT_TAG = b"xxh3+slt"
XXH128_TAG = b"xxh3-128/bulwark"


@dataclass
class Pointer:
    raw: bytes = b"\0" * 64

    def __post_init__(self):
        assert len(self.raw) == 64, len(self.raw)
        (self.addr1, self.addr2, self.nonce, self.length, self.flags,
         self.key_gen) = struct.unpack_from("<QQQIHH", self.raw)
        self.checksum = self.raw[32:64]

    @classmethod
    def make(cls, addr1, addr2=NONE, nonce=0, length=0, flags=0, key_gen=0, checksum=b"\0" * 32):
        return cls(struct.pack("<QQQIHH", addr1, addr2, nonce, length, flags, key_gen) + checksum)

    def encode(self) -> bytes:
        return struct.pack("<QQQIHH", self.addr1, self.addr2, self.nonce, self.length,
                           self.flags, self.key_gen) + self.checksum

    @property
    def hole(self) -> bool:
        return self.length == 0

    @property
    def checksum_kind(self) -> str:
        if self.checksum[24:] == SALT_TAG:
            return "xxh3+salt"
        if self.checksum[16:] == XXH128_TAG:
            return "xxh3-128"
        return "blake3"

    @property
    def salt(self) -> bytes | None:
        return self.checksum[8:24] if self.checksum_kind == "xxh3+salt" else None

    def to_json(self) -> dict:
        return dict(addr1=self.addr1, addr2=None if self.addr2 == NONE else self.addr2,
                    nonce=self.nonce, length=self.length, flags=self.flags, key_gen=self.key_gen,
                    checksum=self.checksum.hex(), kind=self.checksum_kind,
                    salt=self.salt.hex() if self.salt else None)


# --------------------------------------------------------------------------
# the pool's devices

NODE_MAGIC = b"BWMN"
NODE_RAW = 16 + 64 * 64
TABLE_AAD = b"bulwark volume table v1"


class Image:
    """A pool as its device files: the newest superblock, records by pool address.

    `pool_key` (bytes) only decides which slots count (format 2 MACs); reading
    needs no key but for the volume table's `cryptography` import."""

    def __init__(self, devices, pool_key: bytes | None = None):
        self.pool_key = pool_key
        newest = [newest_slot(d, pool_key) for d in devices]
        gen = max(s.generation for s in newest)
        tops = [s for s in newest if s.generation == gen]
        self.sb = tops[0]
        self.S = self.sb.segments_per_device
        self.layout = self.sb.layout
        self.devices: dict[int, str] = {}  # member index -> path
        for s in newest:
            self.devices[s.member_index] = s.device
        self.size_prefixed: bool | None = None

    @classmethod
    def of_pool_dir(cls, pool_dir, use_key=True) -> "Image":
        return cls(pool_devices(pool_dir), read_pool_key(pool_dir) if use_key else None)

    # -- addresses

    def locations(self, addr: int) -> list[tuple[str, int]]:
        seg, off = divmod(addr, SEG)
        if self.layout == 0:
            dev, s = divmod(seg, self.S)
            return [(self.devices[dev], DATA_AT + s * SEG + off)]
        if self.layout == 1:
            return [(p, DATA_AT + seg * SEG + off) for _, p in sorted(self.devices.items())]
        raise NotImplementedError("parity layouts are not supported by bwforge")

    def read_at(self, addr: int, n: int) -> bytes:
        path, off = self.locations(addr)[0]
        with open(path, "rb") as f:
            f.seek(off)
            return f.read(n)

    def write_at(self, addr: int, data: bytes) -> None:
        for path, off in self.locations(addr):
            with open(path, "r+b") as f:
                f.seek(off)
                f.write(data)

    def read_record(self, p: Pointer, verify=True) -> bytes:
        for a in (p.addr1, p.addr2):
            if a == NONE:
                continue
            b = self.read_at(a, p.length)
            if not verify or p.checksum_kind != "blake3" or blake3(b) == p.checksum:
                return b
        raise ValueError(f"no copy of the record at {p.addr1:#x} verifies")

    # -- records

    def unpack(self, stored: bytes, expect_len=None) -> bytes:
        out, pref = lz4_unpack(stored, expect_len)
        if self.size_prefixed is None:
            self.size_prefixed = pref
        return out

    def pack(self, raw: bytes) -> bytes:
        return lz4_pack(raw, bool(self.size_prefixed))

    def read_table(self) -> dict:
        p = self.sb.table_ptr
        stored = self.read_record(p)
        return json.loads(open_table(stored, p.flags, self.sb.table_key, self))

    def read_node(self, p: Pointer) -> tuple[int, int, list[Pointer]]:
        raw = self.read_record(p)
        if p.flags & FLAG_LZ4:
            raw = self.unpack(raw, NODE_RAW)
        assert raw[:4] == NODE_MAGIC, f"not a map node: {raw[:8]!r}"
        level = raw[4]
        index = struct.unpack_from("<Q", raw, 8)[0]
        ptrs = [Pointer(raw[16 + 64 * i:80 + 64 * i]) for i in range(64)]
        return level, index, ptrs

    def volume(self, table: dict, name_or_uuid: str) -> dict:
        for v in table["volumes"]:
            if name_or_uuid in (v["name"], v["uuid"]):
                return v
        raise KeyError(f"no volume {name_or_uuid!r} in the table")

    def walk(self, root: Pointer, blocks: int):
        """Yield (lba, pointer) of every non-hole data pointer under a volume root."""
        depth = map_depth(blocks)
        if root.hole:
            return
        if depth == 0:
            yield 0, root
            return
        stack = [(root, depth - 1, 0)]
        while stack:
            p, level, index = stack.pop()
            lvl, idx, ptrs = self.read_node(p)
            assert (lvl, idx) == (level, index), f"node says level {lvl} index {idx}, expected {level} {index}"
            for k, c in enumerate(ptrs):
                if c.hole:
                    continue
                if level == 0:
                    yield 64 * index + k, c
                else:
                    stack.append((c, level - 1, 64 * index + k))

    def volume_map(self, table: dict, name: str) -> list[tuple[int, Pointer]]:
        v = self.volume(table, name)
        blocks = v["size_bytes"] // v["block_size"]
        return sorted(self.walk(Pointer(bytes.fromhex(v["root"])), blocks), key=lambda t: t[0])

    def nonces(self) -> list[dict]:
        """Every encrypted record reachable from the newest superblock (each volume's
        root, every snapshot's root, the entries of the intent log it names): volume
        uuid, key generation, salt, nonce (and lba, address, checksum)."""
        table = self.read_table()
        out, seen = [], set()
        for v in table["volumes"]:
            blocks = v["size_bytes"] // v["block_size"]
            roots = [v["root"]] + [s["root"] for s in v.get("snapshots", [])]
            for r in roots:
                for lba, p in self.walk(Pointer(bytes.fromhex(r)), blocks):
                    if not p.flags & FLAG_AEAD:
                        continue
                    k = (p.addr1, p.nonce, p.checksum)
                    if k in seen:
                        continue  # the same record shared by a snapshot
                    seen.add(k)
                    out.append(dict(volume=v["uuid"], name=v["name"], lba=lba,
                                    key_generation=p.key_gen,
                                    salt=p.salt.hex() if p.salt else None,
                                    nonce=p.nonce, addr=p.addr1, checksum=p.checksum.hex()))
        # Records only the intent log names yet (flushed since the last commit).
        by_id = {v["id"]: v for v in table["volumes"]}
        for blk in read_log(self):
            for vid, lba, p in blk.entries():
                v = by_id.get(vid)
                if v is None or not p.flags & FLAG_AEAD or p.hole:
                    continue
                k = (p.addr1, p.nonce, p.checksum)
                if k in seen:
                    continue
                seen.add(k)
                out.append(dict(volume=v["uuid"], name=v["name"], lba=lba, key_generation=p.key_gen,
                                salt=p.salt.hex() if p.salt else None, nonce=p.nonce,
                                addr=p.addr1, checksum=p.checksum.hex(), from_log=True))
        return out


def map_depth(blocks: int) -> int:
    d = 0
    while 64 ** d < blocks:
        d += 1
    return d


def open_table(stored: bytes, flags: int, table_key: bytes, img: Image | None = None) -> str:
    """The JSON of a stored volume table: tried as lz4(nonce ‖ GCM) and nonce ‖ GCM(lz4)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    aead = AESGCM(table_key)
    errors = []

    def unl(b):
        if img is not None:
            return img.unpack(b)
        return lz4_unpack(b)[0]

    # order 1: lz4 outside
    for order in ("lz4-outside", "lz4-inside"):
        try:
            if order == "lz4-outside":
                sealed = unl(stored) if flags & FLAG_LZ4 else stored
                plain = aead.decrypt(sealed[:12], sealed[12:], TABLE_AAD)
            else:
                plain = aead.decrypt(stored[:12], stored[12:], TABLE_AAD)
                if flags & FLAG_LZ4:
                    plain = unl(plain)
            json.loads(plain)
            if img is not None:
                img.table_order = order
            return plain.decode()
        except Exception as e:  # noqa: BLE001 - try the other order
            errors.append(f"{order}: {e!r}")
            if img is not None:
                img.size_prefixed = None
    raise ValueError("volume table does not open: " + "; ".join(errors))


def seal_table(js: str, table_key: bytes, order: str, size_prefixed: bool, flags: int) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    nonce = os.urandom(12)
    aead = AESGCM(table_key)
    if not flags & FLAG_LZ4:
        return nonce + aead.encrypt(nonce, js.encode(), TABLE_AAD)
    if order == "lz4-outside":
        return lz4_pack(nonce + aead.encrypt(nonce, js.encode(), TABLE_AAD), size_prefixed)
    return nonce + aead.encrypt(nonce, lz4_pack(js.encode(), size_prefixed), TABLE_AAD)


def pool_devices(pool_dir) -> list[str]:
    pool_dir = Path(pool_dir)
    meta = json.loads((pool_dir / "pool.json").read_text())
    return [str(d if os.path.isabs(d) else pool_dir / d) for d in meta["devices"]]


def read_pool_key(pool_dir) -> bytes | None:
    p = Path(pool_dir) / "pool.key"
    return p.read_bytes() if p.exists() else None


# --------------------------------------------------------------------------
# forging


class Forger:
    """Edits a pool offline: new records go to segments at and above the high-water
    segment (never written, so nothing live is overwritten); `commit()` writes a new
    superblock at generation + 1 on every device.

        f = Forger(devices)                       # device-only attacker
        f = Forger(devices, pool_key=key)         # holds DIR/pool.key (the control)
        f.set_data_pointer("vol", lba, pointer)   # rewrites leaf, path, table
        f.commit()                                # seals: MAC with the key, else unkeyed blake3
    """

    def __init__(self, devices, pool_key: bytes | None = None, read_key: bytes | None = None):
        # Which slots are current is decided with whatever key is at hand (read_key
        # defaults to pool_key): a device-only attacker reads the newest slot as found.
        self.img = Image(devices, read_key if read_key is not None else pool_key)
        self.pool_key = pool_key
        self.table = self.img.read_table()
        self.table_order = getattr(self.img, "table_order", "lz4-outside")
        self.next_seg = self.img.sb.high_water
        self.next_off = 0
        self.sb_edits: list = []
        self.table_dirty = False
        self.devices = list(devices)

    # -- allocation

    def alloc(self, n: int, avoid_seg: int | None = None) -> int:
        n16 = (n + 15) // 16 * 16
        if self.next_off + n16 > SEG or self.next_seg == avoid_seg:
            self.next_seg += 1
            self.next_off = 0
        if self.next_seg == avoid_seg:
            self.next_seg += 1
            self.next_off = 0
        addr = self.next_seg * SEG + self.next_off
        self.next_off += n16
        limit = self.img.S * (len(self.img.devices) if self.img.layout == 0 else 1)
        assert self.next_seg < limit, "pool full: no unused segment left to forge into"
        return addr

    def write_record(self, stored: bytes, copies: int = 1, flags: int = 0, nonce: int = 0,
                     key_gen: int = 0, checksum: bytes | None = None) -> Pointer:
        """Write stored bytes (copies 1 or 2, in different segments); the pointer to them
        carries blake3(stored) unless `checksum` is given."""
        a1 = self.alloc(len(stored))
        self.img.write_at(a1, stored)
        a2 = NONE
        if copies == 2:
            a2 = self.alloc(len(stored), avoid_seg=a1 // SEG)
            self.img.write_at(a2, stored)
        return Pointer.make(a1, a2, nonce, len(stored), flags, key_gen,
                            checksum if checksum is not None else blake3(stored))

    def write_plain_data(self, data: bytes) -> Pointer:
        """A data record flagged unencrypted, uncompressed, with a right blake3."""
        return self.write_record(data, copies=1, flags=0)

    def write_node(self, level: int, index: int, ptrs: list[Pointer]) -> Pointer:
        raw = NODE_MAGIC + bytes([level, 0, 0, 0]) + struct.pack("<Q", index) + \
            b"".join(p.encode() for p in ptrs)
        assert len(raw) == NODE_RAW
        return self.write_record(self.img.pack(raw), copies=2, flags=FLAG_LZ4)

    # -- the map

    def data_pointer(self, volume: str, lba: int) -> Pointer:
        """The current pointer of a logical block (a hole pointer if unmapped)."""
        v = self.img.volume(self.table, volume)
        blocks = v["size_bytes"] // v["block_size"]
        depth = map_depth(blocks)
        p = Pointer(bytes.fromhex(v["root"]))
        for level in range(depth - 1, -1, -1):
            if p.hole:
                return Pointer()
            _, _, ptrs = self.img.read_node(p)
            p = ptrs[(lba // 64 ** level) % 64]
        return p

    def set_data_pointer(self, volume: str, lba: int, new: Pointer) -> None:
        """Point logical block `lba` of `volume` at `new`: rewrites every node on its
        path (new copies in unused segments) and the volume's root in the table."""
        v = self.img.volume(self.table, volume)
        blocks = v["size_bytes"] // v["block_size"]
        depth = map_depth(blocks)
        root = Pointer(bytes.fromhex(v["root"]))
        if depth == 0:
            v["root"] = new.encode().hex()
            self.table_dirty = True
            return
        # Read the path top-down: (level, index, pointers) of every node.
        path = []
        p = root
        for level in range(depth - 1, -1, -1):
            index = lba // 64 ** (level + 1)
            if p.hole:
                ptrs = [Pointer() for _ in range(64)]
            else:
                lvl, idx, ptrs = self.img.read_node(p)
                assert (lvl, idx) == (level, index), (lvl, idx, level, index)
            path.append((level, index, ptrs))
            p = ptrs[(lba // 64 ** level) % 64]
        # Rewrite bottom-up.
        child = new
        for level, index, ptrs in reversed(path):
            ptrs = list(ptrs)
            ptrs[(lba // 64 ** level) % 64] = child
            child = self.write_node(level, index, ptrs)
        v["root"] = child.encode().hex()
        self.table_dirty = True

    # -- the table

    def edit_table(self, fn) -> None:
        """fn(table dict) edits the table in place."""
        fn(self.table)
        self.table_dirty = True

    # -- the commit

    def commit(self, edit_sb=None, all_slots: bool = False, keep_generation: bool = False,
               delete_anchor: str | os.PathLike | None = None) -> int:
        """Write the table (if edited) and a superblock at generation + 1 into slot
        (g + 1) mod 2, front and back, of every device; `edit_sb(sb)` may change any field
        first. Sealed with the pool key if this forger holds one, else with the unkeyed
        blake3 a device-only attacker can compute. `all_slots`: also overwrite the other
        slot (front and back) with the same forged superblock at generation g, so no
        slot the host wrote is left to fall back on. `delete_anchor`: the pool directory
        whose pool.anchor to delete (only a host-side forger can). Returns the generation."""
        old = self.img.sb
        if self.table_dirty:
            js = json.dumps(self.table, separators=(",", ":"))
            stored = seal_table(js, old.table_key, self.table_order, bool(self.img.size_prefixed),
                                old.table_ptr.flags)
            tp = self.write_record(stored, copies=2, flags=old.table_ptr.flags)
        else:
            tp = old.table_ptr
        gen = old.generation if keep_generation else old.generation + 1
        high = max(old.high_water, self.next_seg + (1 if self.next_off else 0))
        for d in self.devices:
            base = newest_slot(d, self.img.pool_key)
            for g in ([gen, gen - 1] if all_slots else [gen]):
                sb = Superblock(bytes(base.raw), d, 0)
                sb.set("generation", g)
                sb.set("high_water", high)
                sb.table_ptr = tp
                if edit_sb is not None:
                    edit_sb(sb)
                if self.pool_key is not None:
                    sb.seal_with_key(self.pool_key)
                else:
                    sb.seal_unkeyed()
                slot = SLOT_OFFSETS[g % 2]
                with open(d, "r+b") as f:
                    for off in (slot, DATA_AT + base.segments_per_device * SEG + slot):
                        f.seek(off)
                        f.write(sb.raw)
                    f.flush()
                    os.fsync(f.fileno())
        if delete_anchor is not None:
            a = Path(delete_anchor) / "pool.anchor"
            if a.exists():
                a.unlink()
        return gen


# --------------------------------------------------------------------------
# the intent log (docs/format.md, "Intent log block")

LOG_MAGIC = b"BWINTENT"
LOG_BYTES = 4096
LOG_MAC_AT = 4032
LOG_SUM_AT = 4064
LOG_ENTRIES_AT = 64
LOG_ENTRY = 80
LOGDEV_RING_AT = 1 << 20


@dataclass
class LogBlock:
    raw: bytearray
    addrs: tuple  # (copy 1, copy 2) pool addresses

    @property
    def generation(self) -> int:
        return struct.unpack_from("<Q", self.raw, 24)[0]

    @property
    def sequence(self) -> int:
        return struct.unpack_from("<Q", self.raw, 32)[0]

    @property
    def count(self) -> int:
        return struct.unpack_from("<I", self.raw, 40)[0]

    @property
    def next_slot(self) -> tuple:
        return struct.unpack_from("<QQ", self.raw, 48)

    def entries(self) -> list[tuple[int, int, Pointer]]:
        out = []
        for i in range(self.count):
            o = LOG_ENTRIES_AT + LOG_ENTRY * i
            vid, lba = struct.unpack_from("<QQ", self.raw, o)
            out.append((vid, lba, Pointer(bytes(self.raw[o + 16:o + 80]))))
        return out

    def set_entry(self, i: int, vid: int, lba: int, p: Pointer) -> None:
        o = LOG_ENTRIES_AT + LOG_ENTRY * i
        self.raw[o:o + 80] = struct.pack("<QQ", vid, lba) + p.encode()

    def checksum_ok(self) -> bool:
        return blake3(bytes(self.raw[:LOG_SUM_AT])) == bytes(self.raw[LOG_SUM_AT:])

    def mac_ok(self, pool_key: bytes, pool_id: bytes) -> bool:
        k = log_key(pool_key, pool_id)
        return blake3_keyed(k, bytes(self.raw[:LOG_MAC_AT])) == bytes(self.raw[LOG_MAC_AT:LOG_SUM_AT])

    def seal(self, pool_key: bytes | None, pool_id: bytes) -> "LogBlock":
        """The MAC (with the key; without it, left as it was) and the unkeyed blake3."""
        if pool_key is not None:
            k = log_key(pool_key, pool_id)
            self.raw[LOG_MAC_AT:LOG_SUM_AT] = blake3_keyed(k, bytes(self.raw[:LOG_MAC_AT]))
        self.raw[LOG_SUM_AT:] = blake3(bytes(self.raw[:LOG_SUM_AT]))
        return self


def read_log(img: Image) -> list[LogBlock]:
    """The intent log chain named by the newest superblock: blocks in sequence while
    each carries the magic, the pool id, the superblock's generation and a right blake3."""
    sb = img.sb
    if sb.log_version != 1:
        return []
    slot = struct.unpack_from("<QQ", sb.raw, 528)
    out = []
    for seq in range(100000):
        blk = None
        for a in slot:
            if a == NONE:
                continue
            raw = bytearray(img.read_at(a, LOG_BYTES))
            b = LogBlock(raw, slot)
            if raw[:8] == LOG_MAGIC and raw[8:24] == sb.pool_id and b.checksum_ok() \
                    and b.generation == sb.generation and b.sequence == seq:
                blk = b
                break
        if blk is None:
            break
        out.append(blk)
        slot = blk.next_slot
    return out


def read_logdev_chain(path, sb: "Superblock") -> list[tuple[int, bytes]]:
    """The chain on a log device (docs/format.md, "Log device"): (slot, block bytes) from
    the superblock's head slot (offset 600), each next at the slot its block names, while
    each carries the magic, the generation, its sequence (its distance in slots from the
    head) and a right blake3."""
    head = struct.unpack_from("<Q", sb.raw, 600)[0]
    if head == NONE:
        return []
    out, slot = [], head
    with open(path, "rb") as f:
        for _ in range(100000):
            f.seek(LOGDEV_RING_AT + slot * LOG_BYTES)
            raw = bytearray(f.read(LOG_BYTES))
            b = LogBlock(raw, (NONE, NONE))
            if raw[:8] != LOG_MAGIC or not b.checksum_ok() or b.generation != sb.generation:
                break
            out.append((slot, bytes(raw)))
            slot = b.next_slot[0]
    return out


def write_logdev_slot(path, slot: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(LOGDEV_RING_AT + slot * LOG_BYTES)
        f.write(data)


def read_log_reach(pool_dir) -> dict | None:
    """The host's record of how far the intent log reached (pool.anchor, offset 1024;
    crates/engine/src/pool/anchor.rs): not an attacker's input, a test's way to wait
    until the host has written it."""
    p = Path(pool_dir) / "pool.anchor"
    b = p.read_bytes()[1024:1536]
    if len(b) != 512 or b[:8] != b"BWLOGRCH" or blake3(b[:480]) != b[480:]:
        return None
    gen, = struct.unpack_from("<Q", b, 24)
    blocks, = struct.unpack_from("<Q", b, 48)
    return dict(generation=gen, chain=b[32:48], blocks=blocks)


def write_log_block(img: Image, blk: LogBlock) -> None:
    for a in blk.addrs:
        if a != NONE:
            img.write_at(a, bytes(blk.raw))


def reseal_all_slots(devices, edit_sb, pool_key: bytes | None = None) -> None:
    """Edit every slot of every device in place (`edit_sb(sb)`), then seal it (MAC with
    the key, else unkeyed blake3): a label edit with no new generation."""
    for d in devices:
        for sb in read_slots(d):
            edit_sb(sb)
            if pool_key is not None:
                sb.seal_with_key(pool_key)
            else:
                sb.seal_unkeyed()
            with open(d, "r+b") as f:
                f.seek(sb.offset)
                f.write(sb.raw)


# --------------------------------------------------------------------------
# CLI


def _devices(args) -> list[str]:
    if args.pool:
        return pool_devices(args.pool)
    return args.devices


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("selftest")
    for name in ("show", "volumes", "map", "nonces", "log"):
        sp = sub.add_parser(name)
        sp.add_argument("devices", nargs="*")
        sp.add_argument("--pool", help="pool directory (devices from pool.json, key from pool.key)")
        sp.add_argument("--pool-key", help="pool key file (slots are then chosen by their MAC)")
        if name == "map":
            sp.add_argument("--volume", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "selftest":
        blake3_selftest()
        lz4_selftest()
        print("blake3: all test vectors pass; lz4: round trips pass")
        return 0
    devs = _devices(args)
    key = Path(args.pool_key).read_bytes() if args.pool_key else (
        read_pool_key(args.pool) if args.pool else None)
    if args.cmd == "show":
        out = []
        for d in devs:
            out.append([dict(s.to_json(), valid=s.valid(key)) for s in read_slots(d)])
        print(json.dumps(out, indent=1))
        return 0
    img = Image(devs, key)
    if args.cmd == "volumes":
        print(json.dumps(img.read_table(), indent=1))
    elif args.cmd == "map":
        for lba, p in img.volume_map(img.read_table(), args.volume):
            print(json.dumps(dict(lba=lba, **p.to_json())))
    elif args.cmd == "nonces":
        for n in img.nonces():
            print(json.dumps(n))
    elif args.cmd == "log":
        for blk in read_log(img):
            mac = blk.mac_ok(key, img.sb.pool_id) if key else None
            print(json.dumps(dict(sequence=blk.sequence, generation=blk.generation, mac_ok=mac,
                                  entries=[dict(volume_id=v, lba=l, **p.to_json())
                                           for v, l, p in blk.entries()])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
