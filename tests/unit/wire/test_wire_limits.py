from __future__ import annotations

import math

from stargate.wire.limits import U64_MAX, sat_u32, sat_u64, saturating_add, u64_ceil


def test_saturating_helpers_clamp_at_both_ends() -> None:
    assert sat_u64(U64_MAX + 5) == U64_MAX and sat_u64(-3) == 0 and sat_u64(7) == 7
    assert sat_u32(2**40) == 2**32 - 1
    assert saturating_add(U64_MAX - 1, 5) == U64_MAX
    assert u64_ceil(math.nan) == 0 and u64_ceil(-1.0) == 0 and u64_ceil(math.inf) == U64_MAX
    assert u64_ceil(6.9e20) == U64_MAX and u64_ceil(2.1) == 3
