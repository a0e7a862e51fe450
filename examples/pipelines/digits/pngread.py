"""A minimal PNG reader for 8-bit grayscale images (zlib and NumPy only), for hosts without
Pillow: non-interlaced, colour type 0 (grey) or 4 (grey + alpha, alpha dropped), bit depth 8,
every scanline filter (None, Sub, Up, Average, Paeth)."""

from __future__ import annotations

import struct
import zlib

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_gray8(data: bytes) -> np.ndarray:
    """PNG bytes -> uint8 array [height, width]; ValueError naming what is not supported."""
    if not data.startswith(SIGNATURE):
        raise ValueError("not a PNG image (the 8-byte PNG signature is missing)")
    pos, header, idat = len(SIGNATURE), b"", bytearray()
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = chunk
        elif kind == b"IDAT":
            idat += chunk
        elif kind == b"IEND":
            break
    if len(header) != 13:
        raise ValueError("the PNG has no valid IHDR chunk")
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    if depth != 8 or colour not in (0, 4) or interlace:
        raise ValueError(
            f"PNG of bit depth {depth}, colour type {colour}, interlace {interlace}: this reader "
            "takes 8-bit grayscale, non-interlaced images (install Pillow for the rest)"
        )
    channels = 1 if colour == 0 else 2
    stride = width * channels
    raw = zlib.decompress(bytes(idat))
    if len(raw) != height * (stride + 1):
        raise ValueError(f"PNG image data holds {len(raw)} bytes, not {height * (stride + 1)}")
    out = np.zeros((height, stride), dtype=np.uint8)
    previous = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        row = _unfilter(kind, line, previous, channels)
        out[y] = row
        previous = row
    return out[:, ::channels]


def _unfilter(kind: int, line: np.ndarray, up: np.ndarray, bpp: int) -> np.ndarray:
    if kind == 0:
        return line
    if kind == 2:
        return (line + up) & 0xFF
    row = np.zeros_like(line)
    for x in range(len(line)):
        left = int(row[x - bpp]) if x >= bpp else 0
        upper_left = int(up[x - bpp]) if x >= bpp else 0
        if kind == 1:
            predictor = left
        elif kind == 3:
            predictor = (left + int(up[x])) // 2
        elif kind == 4:
            predictor = _paeth(left, int(up[x]), upper_left)
        else:
            raise ValueError(f"unknown PNG filter type {kind}")
        row[x] = (int(line[x]) + predictor) & 0xFF
    return row


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    if pa <= pb and pa <= pc:
        return a
    return b if pb <= pc else c
