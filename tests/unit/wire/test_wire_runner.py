"""The open-file limit a console script raises before its event loop starts."""

from __future__ import annotations

import resource

import pytest

from stargate.wire.runner import OPEN_FILES_CEILING, raise_open_files_limit


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard limit leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        limit = raise_open_files_limit()
        wanted = OPEN_FILES_CEILING if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_CEILING)
        assert limit == wanted == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
