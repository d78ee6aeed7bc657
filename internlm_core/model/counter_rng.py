"""A counter-based normal generator: element i of a parameter gets a value that depends on (seed, the parameter's
name, i) only, so any rank computes any element of any parameter without drawing the elements before it.

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the known-answer vectors of
Random123 are in tests/unit/test_model_init.py) turns (key, counter) into four 32-bit words: the key comes from the
seed and a 64-bit hash of the name, the counter from i // 4 (and the rest of seed and hash). Box-Muller turns each
pair of words into two standard normals, so one counter gives the normals of elements 4k .. 4k+3.

The arithmetic is elementwise torch ops only: 32-bit products in int64 (wrapping, their bits exact), and in
float64 additions, multiplications, divisions, square roots and frexp, each an IEEE correctly rounded op of its own
kernel. The logarithm, sine and cosine are polynomials written out in those ops instead of torch.log / sin / cos,
whose vectorized and scalar paths (and CPU and CUDA) may round differently: an element's value does not depend on
how many elements are computed with it, in which chunk, by which thread or on which device.
"""

from __future__ import annotations

import hashlib
import math

import torch

M32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key increments (Weyl sequence)
ROUNDS = 10

# ln(m) = 2 s (1 + s^2/3 + s^4/5 + ...), s = (m - 1) / (m + 1), m in [sqrt(1/2), sqrt(2)): |s| <= 0.1716, the terms
# to s^16/17 leave < 1e-15 relative
_LOG_TERMS = [1.0 / (2 * k + 1) for k in range(9)]
# sin and cos on [-pi/4, pi/4]: Taylor terms to x^15 / x^16 (< 1e-15)
_SIN_TERMS = [(-1.0) ** k / math.factorial(2 * k + 1) for k in range(8)]
_COS_TERMS = [(-1.0) ** k / math.factorial(2 * k) for k in range(9)]
_SQRT_HALF = math.sqrt(0.5)


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * m, for `a` holding 32-bit values in int64.

    The product (below 2**64) wraps in int64 as two's complement, as torch's integer kernels do on CPU and CUDA;
    its bits are the unsigned product's, so both halves are exact (Random123's known answers in
    tests/unit/test_model_init.py hold). One multiplication instead of the two of 16-bit halves: Philox 3x faster.
    """
    p = a * m
    hi = p >> 32  # an arithmetic shift: the mask drops the sign's copies
    hi &= M32
    p &= M32
    return hi, p


def philox4x32(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: int, k1: int,
               rounds: int = ROUNDS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 of counters (c0, c1, c2, c3) (int64 tensors of 32-bit values) under key (k0, k1)."""
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, _PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, _PHILOX_M[1])
        hi1 ^= c1
        hi1 ^= k0
        hi0 ^= c3
        hi0 ^= k1
        c0, c1, c2, c3 = hi1, lo1, hi0, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & M32, (k1 + _PHILOX_W[1]) & M32
    return c0, c1, c2, c3


def _horner(x: torch.Tensor, terms: list[float]) -> torch.Tensor:
    """terms[0] + terms[1] x + terms[2] x^2 + ..., one multiplication and one addition per term."""
    p = torch.full_like(x, terms[-1])
    for c in reversed(terms[:-1]):
        p *= x
        p += c
    return p


def _log_unit(u: torch.Tensor) -> torch.Tensor:
    """ln(u) for float64 u in (0, 1]."""
    m, e = torch.frexp(u)  # u = m * 2**e, m in [0.5, 1): exact
    low = m < _SQRT_HALF
    m = torch.where(low, m * 2.0, m)
    e = (e - low.to(e.dtype)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    ln_m = _horner(s * s, _LOG_TERMS)
    ln_m *= s
    ln_m *= 2.0
    e *= math.log(2.0)
    return ln_m + e


def _cos_sin(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of an angle uniform over a full turn, from a 32-bit word: its top two bits the quarter turn,
    the rest an offset x in (-pi/4, pi/4) within it."""
    quarter = word >> 30
    x = ((word & 0x3FFFFFFF).to(torch.float64) + 0.5) * 2.0**-30  # (0, 1)
    x -= 0.5
    x *= math.pi / 2
    x2 = x * x
    sin = _horner(x2, _SIN_TERMS)
    sin *= x
    cos = _horner(x2, _COS_TERMS)
    odd = (quarter & 1).bool()  # a quarter or three quarters of a turn: cos and sin swap
    c, s = torch.where(odd, sin, cos), torch.where(odd, cos, sin)
    c = torch.where((quarter == 1) | (quarter == 2), -c, c)
    s = torch.where(quarter >= 2, -s, s)
    return c, s


def _box_muller(u_word: torch.Tensor, angle_word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent standard normals (float64) from two 32-bit words."""
    u = (u_word.to(torch.float64) + 0.5) * 2.0**-32  # (0, 1): the largest radius is 6.8
    r = _log_unit(u)
    r *= -2.0
    r = r.sqrt()
    c, s = _cos_sin(angle_word)
    return r * c, r * s


class ParameterStream:
    """The normals of one parameter: `normals(counters)` gives elements 4k .. 4k+3 for every counter k."""

    def __init__(self, seed: int, name: str):
        h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
        seed = int(seed) % 2**64
        self.seed, self.name = seed, name
        self.key = (h & M32, seed & M32)
        self.high = ((seed >> 32) & M32, h >> 32)  # the counter's words 2 and 3

    def words(self, counters: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The four 32-bit words of each counter (int64 tensor, values below 2**64)."""
        c0, c1 = counters & M32, counters >> 32
        c2, c3 = torch.full_like(counters, self.high[0]), torch.full_like(counters, self.high[1])
        return philox4x32(c0, c1, c2, c3, *self.key)

    def normals(self, counters: torch.Tensor) -> torch.Tensor:
        """Standard normals, float64, shape counters.shape + (4,): lane j of counter k is element 4k + j."""
        w0, w1, w2, w3 = self.words(counters)
        z0, z1 = _box_muller(w0, w1)
        z2, z3 = _box_muller(w2, w3)
        return torch.stack([z0, z1, z2, z3], dim=-1)
