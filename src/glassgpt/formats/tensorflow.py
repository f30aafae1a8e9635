"""Read a TensorFlow checkpoint without TensorFlow: the format of OpenAI's GPT-2 release.

A checkpoint `PREFIX` (e.g. `gpt2/124M/model.ckpt`) is two files:

    PREFIX.index                  a sorted table (LevelDB's SSTable) from each tensor's name to a
                                  BundleEntryProto: dtype, shape, shard, offset, size, crc32c; the
                                  empty name holds the BundleHeaderProto (shards, byte order)
    PREFIX.data-00000-of-00001    the tensors' raw little-endian bytes, one after the other

`read_tensors(prefix)` yields `(name, tensor)` in name order, each tensor memory-mapped
from the data file after its CRC-32C is checked; a truncated or corrupt file raises
CheckpointError naming it. Dense tensors of numeric dtypes only: partitioned (sliced)
variables, compressed index blocks and big-endian bundles are refused by name.

Follows TensorFlow's tensor_bundle.proto and lib/io/table format (LevelDB's
table_format.md); protobuf messages are decoded by hand from the wire format.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..errors import CheckpointError
from .files import read_limited

TABLE_MAGIC = 0xDB4775248B80FB57  # the last 8 bytes of every LevelDB/TensorFlow table
FOOTER_BYTES = 48                 # two block handles (varints), zero padding, the magic
BLOCK_TRAILER_BYTES = 5           # after every block: compression type (1 byte), masked crc32c (4)

# TensorFlow's DataType enum (types.proto) -> torch dtype, for the types a checkpoint of weights holds.
TF_DTYPES = {1: torch.float32, 2: torch.float64, 3: torch.int32, 4: torch.uint8, 5: torch.int16,
             6: torch.int8, 9: torch.int64, 10: torch.bool, 14: torch.bfloat16, 19: torch.float16}


@dataclass(frozen=True)
class BundleEntry:
    """Where one tensor's bytes are: a decoded BundleEntryProto."""
    dtype: int          # TensorFlow's DataType number (1 is float32)
    shape: tuple[int, ...]
    shard_id: int
    offset: int         # bytes into the shard's data file
    size: int           # bytes
    crc32c: int         # masked CRC-32C of those bytes
    sliced: bool        # a partitioned variable, stored as slices elsewhere


def read_index(prefix: str | Path) -> tuple[int, dict[str, BundleEntry]]:
    """(number of data shards, {tensor name: BundleEntry}) from `PREFIX.index`."""
    path = Path(f"{prefix}.index")
    try:
        data = read_limited(path, "index", CheckpointError)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) < FOOTER_BYTES or struct.unpack_from("<Q", data, len(data) - 8)[0] != TABLE_MAGIC:
        raise CheckpointError(f"{path} is truncated or not a TensorFlow checkpoint index "
                              "(no table footer): copy or download it again")
    try:
        shards, entries = _parse_index(data, path)
    except (IndexError, struct.error, UnicodeDecodeError):  # a varint or field runs off its block
        raise CheckpointError(f"{path} is corrupt (a record runs past its block): copy or download it again") from None
    return shards, entries


def _parse_index(data: bytes, path: Path) -> tuple[int, dict[str, BundleEntry]]:
    _, pos = _varint(data, len(data) - FOOTER_BYTES)  # the metaindex handle: TensorFlow leaves it empty
    _, pos = _varint(data, pos)
    index_offset, pos = _varint(data, pos)
    index_size, _ = _varint(data, pos)
    shards, big_endian, entries = 1, False, {}
    # The index block maps a separator key to each data block; data blocks hold the records.
    for _, handle in _block_records(_read_block(data, index_offset, index_size, path)):
        offset, at = _varint(handle, 0)
        size, _ = _varint(handle, at)
        for key, value in _block_records(_read_block(data, offset, size, path)):
            name = key.decode("utf-8")
            if name == "":  # BundleHeaderProto: num_shards = 1, endianness = 2 (0 little, 1 big)
                fields = dict((f, v) for f, _, v in _fields(value))
                shards, big_endian = fields.get(1, 1), fields.get(2, 0) == 1
            else:
                entries[name] = _bundle_entry(value)
    if big_endian:
        raise CheckpointError(f"{path} was written on a big-endian machine; re-save it on a little-endian one")
    return shards, entries


def read_tensors(prefix: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint `prefix`, in name order, memory-mapped and CRC-checked.
    The whole index is checked against the data files' sizes before the first tensor is read."""
    shards, entries = read_index(prefix)
    for name, entry in entries.items():
        _check_entry(prefix, name, entry, shards)
    mapped: dict[int, torch.Tensor] = {}
    for name, entry in entries.items():
        if entry.shard_id not in mapped:
            mapped[entry.shard_id] = _map_shard(prefix, entry.shard_id, shards)
        yield name, _tensor(mapped[entry.shard_id], entry, name, f"{prefix}.data-{entry.shard_id:05d}-of-{shards:05d}")


def _check_entry(prefix: str | Path, name: str, entry: BundleEntry, shards: int) -> None:
    """Refuse an index entry whose bytes the data files cannot hold, before anything is read."""
    if entry.sliced:
        raise CheckpointError(f"{prefix}.index: {name!r} is a partitioned variable (stored as slices); "
                              "re-save the checkpoint with whole tensors")
    if entry.dtype not in TF_DTYPES:
        raise CheckpointError(f"{prefix}.index: {name!r} has TensorFlow dtype number {entry.dtype}, "
                              "which is not a numeric type glassgpt reads")
    if entry.shard_id >= shards:
        raise CheckpointError(f"{prefix}.index: {name!r} is in shard {entry.shard_id}, but the header says "
                              f"there are {shards}: the index is corrupt")
    numel, itemsize = math.prod(entry.shape), TF_DTYPES[entry.dtype].itemsize
    if entry.size != numel * itemsize:
        raise CheckpointError(f"{prefix}.index: {name!r} {list(entry.shape)} should be {numel * itemsize:,} bytes, "
                              f"the index says {entry.size:,}: the index is corrupt")
    data = Path(f"{prefix}.data-{entry.shard_id:05d}-of-{shards:05d}")
    size = data.stat().st_size if data.is_file() else None
    if size is None:
        raise CheckpointError(f"{data} is missing: a checkpoint needs its .index and every .data file")
    if entry.offset + entry.size > size:
        raise CheckpointError(f"{data} is truncated: {name!r} needs bytes up to {entry.offset + entry.size:,}, "
                              f"the file has {size:,}: copy or download it again")


def _map_shard(prefix: str | Path, shard: int, shards: int) -> torch.Tensor:
    path = Path(f"{prefix}.data-{shard:05d}-of-{shards:05d}")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: a checkpoint needs its .index and every .data file")
    if path.stat().st_size == 0:
        return torch.empty(0, dtype=torch.uint8)
    # Copy-on-write: the tensors share the page cache with the file and never write to it.
    return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))


def _tensor(raw: torch.Tensor, entry: BundleEntry, name: str, source: str) -> torch.Tensor:
    dtype = TF_DTYPES[entry.dtype]
    data = raw[entry.offset:entry.offset + entry.size]
    if unmask_crc(entry.crc32c) != crc32c(data):
        raise CheckpointError(f"{source} is corrupt: the bytes of {name!r} fail their CRC-32C check: "
                              "copy or download it again")
    if entry.offset % dtype.itemsize:
        data = data.clone()  # a view as float32 needs 4-byte-aligned storage
    return data.view(dtype).reshape(entry.shape)


# --- the table format: blocks of prefix-compressed records ------------------------------------

def _read_block(data: bytes, offset: int, size: int, path: Path) -> bytes:
    end = offset + size
    if end + BLOCK_TRAILER_BYTES > len(data):
        raise CheckpointError(f"{path} is truncated (a block ends past the file): copy or download it again")
    block, kind = data[offset:end], data[end]
    if kind != 0:
        raise CheckpointError(f"{path} has compressed blocks (type {kind}); glassgpt reads uncompressed "
                              "indexes, as TensorFlow writes them")
    stored = struct.unpack_from("<I", data, end + 1)[0]
    if unmask_crc(stored) != crc32c(block + bytes([kind])):
        raise CheckpointError(f"{path} is corrupt (a block fails its CRC-32C check): copy or download it again")
    return block


def _block_records(block: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) records of one block. Each key shares a prefix with the one before it:
    a record is (shared length, new length, value length, new key bytes, value)."""
    n_restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    end = len(block) - 4 - 4 * n_restarts  # the restart offsets only speed up seeking: skipped
    pos, key = 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        fresh, pos = _varint(block, pos)
        size, pos = _varint(block, pos)
        key = key[:shared] + block[pos:pos + fresh]
        pos += fresh
        yield key, block[pos:pos + size]
        pos += size


# --- protobuf wire format ---------------------------------------------------------------------

def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """A base-128 varint at `pos`: (value, position after it)."""
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(message: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of every field of a serialized protobuf message."""
    pos = 0
    while pos < len(message):
        tag, pos = _varint(message, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(message, pos)
        elif wire == 1:
            value, pos = struct.unpack_from("<Q", message, pos)[0], pos + 8
        elif wire == 2:
            size, pos = _varint(message, pos)
            value, pos = message[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = struct.unpack_from("<I", message, pos)[0], pos + 4
        else:
            raise struct.error(f"wire type {wire}")
        yield number, wire, value


def _bundle_entry(message: bytes) -> BundleEntry:
    """BundleEntryProto: dtype = 1, shape = 2, shard_id = 3, offset = 4, size = 5, crc32c = 6, slices = 7."""
    fields = {1: 0, 3: 0, 4: 0, 5: 0, 6: 0}
    shape: tuple[int, ...] = ()
    sliced = False
    for number, _, value in _fields(message):
        if number == 2:  # TensorShapeProto: dim = 2, each a Dim with size = 1
            shape = tuple(dict((f, v) for f, _, v in _fields(dim)).get(1, 0)
                          for f, _, dim in _fields(value) if f == 2)
        elif number == 7:
            sliced = True
        else:
            fields[number] = value
    return BundleEntry(fields[1], shape, fields[3], fields[4], fields[5], fields[6], sliced)


# --- CRC-32C ---------------------------------------------------------------------------------

CRC32C_POLY = 0x82F63B78  # Castagnoli's polynomial, bit-reversed
CRC_MASK_DELTA = 0xA282EAD8


def unmask_crc(masked: int) -> int:
    """LevelDB stores crc32c rotated right by 15 bits plus a constant ("masked"), so that
    the CRC of data that itself holds CRCs stays well mixed; this undoes it."""
    rot = (masked - CRC_MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def crc32c(data: bytes | torch.Tensor) -> int:
    """CRC-32C of bytes (or a uint8 tensor), e.g. crc32c(b"123456789") == 0xE3069283.

    A CRC register is linear over GF(2): feeding it k zero bytes is a fixed 32x32 bit
    matrix, the "zeros operator" Z(k), and feeding it bytes B is Z(len B) of the register
    XOR the register that B alone (from zero) leaves. So, instead of one byte at a time in
    Python (minutes for GPT-2's 500 MB), the bytes are cut into about sqrt(n) stretches
    whose registers advance together, 4 bytes per numpy step (register = Z(4) of register
    XOR word, as two 65,536-entry tables), and the stretches are then joined with
    Z(stretch length). The start value 0xFFFFFFFF is carried through all n bytes by Z(n).
    """
    buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data.numpy()
    n = buf.size
    words = -(-n // 4)
    width = max(1, math.isqrt(words))        # 4-byte words per stretch
    lanes = -(-words // width)
    padded = np.zeros(lanes * width * 4, dtype=np.uint8)
    padded[padded.size - n:] = buf          # zeros in front of a zero register leave it zero
    grid = padded.view("<u4").reshape(lanes, width)
    low, high = _word_tables()
    reg = np.zeros(lanes, dtype=np.uint32)
    for j in range(width):
        x = reg ^ grid[:, j]
        reg = low[x & 0xFFFF] ^ high[x >> 16]
    join = _byte_tables(_zeros_operator(4 * width))
    acc = 0
    for stretch in reg.tolist():
        acc = _apply(join, acc) ^ stretch
    start = _apply(_byte_tables(_zeros_operator(n)), 0xFFFFFFFF)
    return acc ^ start ^ 0xFFFFFFFF


@lru_cache(maxsize=64)
def _zeros_operator(n_bytes: int) -> tuple[int, ...]:
    """Z(n_bytes) as the images of the 32 single-bit registers."""
    # One zero bit: the register shifts right, and the polynomial comes in when a 1 falls out.
    step = [CRC32C_POLY] + [1 << (bit - 1) for bit in range(1, 32)]
    result = [1 << bit for bit in range(32)]  # the identity
    k = 8 * n_bytes
    while k:  # by squaring: Z(2m) is Z(m) after Z(m)
        if k & 1:
            result = [_apply_bits(step, r) for r in result]
        step = [_apply_bits(step, r) for r in step]
        k >>= 1
    return tuple(result)


def _apply_bits(op: list[int], reg: int) -> int:
    out = 0
    for bit in range(32):
        if reg >> bit & 1:
            out ^= op[bit]
    return out


@lru_cache(maxsize=64)
def _byte_tables(op: tuple[int, ...]) -> tuple[list[int], ...]:
    """`op` as four 256-entry tables, one per byte of the register, so applying it is 4 lookups."""
    tables = []
    for byte in range(4):
        t = [0] * 256
        for value in range(1, 256):
            low = value & -value
            t[value] = t[value ^ low] ^ op[8 * byte + low.bit_length() - 1]
        tables.append(t)
    return tuple(tables)


def _apply(tables: tuple[list[int], ...], reg: int) -> int:
    t0, t1, t2, t3 = tables
    return t0[reg & 0xFF] ^ t1[reg >> 8 & 0xFF] ^ t2[reg >> 16 & 0xFF] ^ t3[reg >> 24]


@lru_cache(maxsize=1)
def _word_tables() -> tuple[np.ndarray, np.ndarray]:
    """Z(4) split by the register's low and high 16 bits: [65536] uint32 each."""
    t0, t1, t2, t3 = (np.array(t, dtype=np.uint32) for t in _byte_tables(_zeros_operator(4)))
    low = (t1[:, None] ^ t0[None, :]).reshape(-1)   # index hi_byte * 256 + lo_byte
    high = (t3[:, None] ^ t2[None, :]).reshape(-1)
    return low, high
