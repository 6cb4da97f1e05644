"""Counter-based random numbers: a uniform is a pure function of (seed, completion index, position).

No generator state lives anywhere, so a seeded request draws the same numbers alone or in any crowd,
on CPU or CUDA, after preemption or a retried step. The 64-bit stream key of (seed, index) is mixed
on the host once per sequence (splitmix64, exact Python ints, any seed size); each step hashes
(key, counter) on the device with a 32-bit integer hash kept inside int64 lanes whose products stay
below 2**63 (multipliers < 2**31), so no op relies on signed overflow.
"""

from __future__ import annotations

import torch

MASK32 = (1 << 32) - 1
MASK64 = (1 << 64) - 1
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97  # Wellons' low-bias 32-bit hash; both < 2**31


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, index: int) -> int:
    """The 64-bit key of completion `index` of a request seeded `seed` (any int).

    (seed, index) pairs map to keys through two bijective mixes, so completion 1 of seed 5 and
    completion 0 of seed 6 get unrelated streams (`seed + index` would make them equal). A negative
    seed is taken as its two's complement (-1 and 2**64-1 share a stream), so int64 seeds work;
    non-negative seeds wider than 64 bits are folded 64 bits at a time."""
    if seed < 0:
        seed &= MASK64  # shifting a negative int right never reaches 0
    folded = 0
    while True:
        folded = splitmix64(folded ^ (seed & MASK64))
        seed >>= 64
        if not seed:
            break
    return splitmix64(folded ^ splitmix64(index ^ 0x5851F42D4C957F2D))


def hash32(x: torch.Tensor) -> torch.Tensor:
    """x: int64 values in [0, 2**32) -> int64 hashes in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & MASK32
    return x ^ (x >> 15)


def uniforms(key_lo: torch.Tensor, key_hi: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """float32 uniforms strictly inside (0, 1), one per element of the broadcast int64 inputs."""
    h = hash32(key_lo ^ hash32(key_hi ^ hash32(counter & MASK32)))
    h = hash32(h ^ key_hi)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def hash32_py(x: int) -> int:
    """Pure-Python twin of `hash32`, for tests and host-side checks."""
    x ^= x >> 16
    x = (x * _MUL1) & MASK32
    x ^= x >> 15
    x = (x * _MUL2) & MASK32
    return x ^ (x >> 15)
