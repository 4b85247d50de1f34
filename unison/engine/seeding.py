"""The seeding contract: a group's completions depend only on the run's seed.

Three seeds, each derived from the one above it and nothing else, so what a seeded sample draws does not
depend on what else is in the batch, how requests were scheduled, or whether the run was resumed:

>>> import random
>>> group = group_seed(random.Random("0/sampling"))  # the rollout loop: one per prompt, from the run's seed
>>> request = request_seed(group, 3)                 # the engine: sample 3 of that group
>>> token_seed(request, 17) == token_seed(request, 17)  # the fused sampler's Philox key for output token 17
True

Every seed is below ``2**SEED_BITS`` (52): the fused sampler sends its per-row parameters to the device in one
float64 buffer, and float64 holds every integer below 2**53 exactly, so a 52-bit seed arrives unrounded.
"""

from __future__ import annotations

import random

SEED_BITS = 52
SEED_RANGE = 2**SEED_BITS
"""Seeds are in ``[0, SEED_RANGE)``."""
_MASK = SEED_RANGE - 1
_TOKEN_STRIDE = 1000003
"""Odd (a prime: the multiplier of CPython's old string hash), so ``seed * stride`` is a bijection mod 2**52 and two
requests' keys for the same position differ; one request's positions differ by less than 2**52, so their keys
differ too. Any odd multiplier would do; changing it changes every seeded fused sample."""


def group_seed(rng: random.Random) -> int:
    """The next group's seed from the rollout loop's seed generator (which is saved and restored on resume)."""
    return rng.getrandbits(SEED_BITS)


def request_seed(group: int, index: int) -> int:
    """The seed of sample ``index`` of a group seeded ``group``. ``hash`` of a tuple of ints is stable across
    processes (PYTHONHASHSEED only salts str/bytes)."""
    return hash((group, index)) & _MASK


def token_seed(request: int, position: int) -> int:
    """The fused sampler's noise key for output token ``position`` of a request seeded ``request``."""
    return (request * _TOKEN_STRIDE + position) & _MASK
