from __future__ import annotations

import itertools

from stargate.pylon.calibration import Step, is_prompt_too_long, steps
from stargate.pylon.ids import RequestIds


def test_b33_default_ramp() -> None:
    assert list(itertools.islice(steps(5, 4096, 4), 6)) == [
        Step(256, 5, 1),
        Step(512, 10, 2),
        Step(1024, 20, 3),
        Step(2048, 40, 4),
        Step(4096, 80, 4),
        Step(4096, 160, 4),
    ]


def test_b35_prompt_too_long_detection() -> None:
    assert is_prompt_too_long(400, b'{"error":{"message":"Prompt too long for model"}}')
    assert is_prompt_too_long(413, b'{"error":{"message":"exceeds maximum context"}}')
    assert not is_prompt_too_long(500, b'{"error":{"message":"prompt too long"}}')
    assert not is_prompt_too_long(400, b"nope")


def test_b40_generated_ids() -> None:
    ids = RequestIds()
    a, b = ids.new("canary", 0), ids.new("calibration", 0)
    assert a == f"canary-{ids.uuid}-g0-1" and b == f"calibration-{ids.uuid}-g0-2"
    assert ids.parse(b) is not None and ids.parse(b).kind == "calibration"  # type: ignore[union-attr]
    assert RequestIds().parse(a) is None
