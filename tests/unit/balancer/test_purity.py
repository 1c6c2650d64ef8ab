"""Package contract: the decision core stays pure, and every policy keeps the common decision rules."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
from support.balancer_builders import make_candidate, make_request

import stargate.balancer as balancer
from stargate.balancer import Algorithm, AlgorithmDefinition, Selected, Unavailable, Wait, build_policy

PACKAGE = Path(balancer.__file__).parent
FORBIDDEN_MODULES = (
    "stargate.router",
    "stargate.pylon",
    "stargate.mock_engine",
    "stargate.bench",
    "asyncio",
    "socket",
    "selectors",
    "ssl",
    "threading",
    "time",
    "aiohttp",
    "grpc",
    "uvloop",
    "http",
    "urllib",
    "subprocess",
)
MODULES = sorted(PACKAGE.glob("*.py"))


def _forbidden(name: str) -> bool:
    return any(name == banned or name.startswith(banned + ".") for banned in FORBIDDEN_MODULES)


def test_every_module_is_checked() -> None:
    names = {path.name for path in MODULES}
    assert {"__init__.py", "types.py", "settings.py", "wait_and_widen.py", "pulsar.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_no_io_layers_clocks_or_global_randomness(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            problems += [f"import {alias.name}" for alias in node.names if _forbidden(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and _forbidden(module):
                problems.append(f"from {module} import ...")
            if module == "random":
                problems += [f"from random import {a.name}" for a in node.names if a.name != "Random"]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            # Module-level random functions share one hidden global generator.
            if node.value.id == "random" and node.attr != "Random":
                problems.append(f"random.{node.attr}")
            if node.value.id in ("time", "datetime") or (node.value.id == "os" and node.attr == "urandom"):
                problems.append(f"{node.value.id}.{node.attr}")
    for statement in tree.body:
        for node in ast.walk(statement):
            is_rng = isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Attribute) and node.func.attr in ("Random", "SystemRandom"))
                or (isinstance(node.func, ast.Name) and node.func.id in ("Random", "SystemRandom"))
            )
            inside_function = isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            if is_rng and not inside_function:
                problems.append("module-level random generator")
    assert problems == [], f"{path.name}: {problems}"


def test_public_api_is_exported() -> None:
    for name in (
        "build_policy",
        "queue_estimate",
        "effective_queue_ms",
        "has_free_slot",
        "with_reservation",
        "AdmissionRejection",
        "check_admission",
        "ModelStats",
        "Candidate",
        "Target",
        "LbRequest",
        "Choice",
        "Selected",
        "Wait",
        "Unavailable",
        "Decision",
        "Algorithm",
        "Comparator",
        "AlgorithmDefinition",
        "Policy",
    ):
        assert name in balancer.__all__ and hasattr(balancer, name), name


def _definitions() -> list[AlgorithmDefinition]:
    return [
        AlgorithmDefinition(Algorithm.POWER_OF_N, sample_count=3),
        AlgorithmDefinition(Algorithm.ROUND_ROBIN),
        AlgorithmDefinition(Algorithm.RANDOM),
        AlgorithmDefinition(Algorithm.PULSAR, consider_kv_free_tokens=True),
        AlgorithmDefinition(Algorithm.WAIT_AND_WIDEN),
        AlgorithmDefinition(Algorithm.WAIT_AND_WIDEN, selection_count=2, cache_affinity_wait_ms=100),
        AlgorithmDefinition(Algorithm.PULSAR_WAIT_AND_WIDEN, queue_slo_ms=(50, 200)),
    ]


@pytest.mark.parametrize("definition", _definitions(), ids=lambda d: d.algorithm.value)
def test_policies_never_return_excluded_clusters(definition: AlgorithmDefinition) -> None:
    policy = build_policy(definition)
    assert policy.definition is definition
    assert build_policy(definition) is not policy
    generator = random.Random(2024)
    assert isinstance(policy.decide((), make_request(), generator), Unavailable)
    timed = definition.algorithm in (Algorithm.WAIT_AND_WIDEN, Algorithm.PULSAR_WAIT_AND_WIDEN)
    for _ in range(300):
        candidates = tuple(
            make_candidate(
                f"c{i}",
                rtt_ms=generator.uniform(0.0, 80.0),
                tps=generator.choice([0.0, 50.0, 500.0]),
                queued=generator.randrange(0, 500),
                running=generator.randrange(0, 3),
                max_concurrency=generator.randrange(0, 3),
                kv_free=generator.randrange(0, 300),
                kv_capacity=1000,
            )
            for i in range(generator.randrange(1, 7))
        )
        excluded = {c.cluster_id for c in candidates if generator.random() < 0.3}
        request = make_request(
            input_tokens=generator.randrange(0, 200),
            elapsed_ms=generator.uniform(0.0, 300.0),
            key=generator.choice([None, "k1", "k2"]),
            excluded=excluded,
        )
        decision = policy.decide(candidates, request, generator)
        if isinstance(decision, Selected):
            assert candidates[decision.choice.index].cluster_id not in excluded
            assert decision.choice.rank_depth >= 1
        elif isinstance(decision, Wait):
            assert timed and decision.ms > 0.0
        else:
            assert isinstance(decision, Unavailable)
        if len(excluded) == len(candidates):
            assert isinstance(decision, Unavailable)
