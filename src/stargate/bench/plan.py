"""The fleet plan of a scenario: one command line per mock engine and per Pylon, one run per algorithm.

The schema (:mod:`stargate.bench.schema`) says what a scenario file means; this module says how the
bench starts it. Addresses and URLs are left out: the fleet adds them once ports are known.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from stargate.bench.schema import QueueAdmission, Scenario
from stargate.errors import ConfigError
from stargate.wire.limits import U64_MAX

MOCK_NUM_TOKENS = 32


@dataclass(frozen=True)
class EngineSpec:
    """One mock engine per routing cluster; ``args`` is its full command line minus the address."""

    engine_id: str
    args: list[str]


@dataclass(frozen=True)
class BackendSpec:
    """One Pylon; ``pylon_args`` excludes every address and URL (the fleet adds those)."""

    backend_id: str
    cluster_id: str
    engine_id: str
    pylon_args: list[str]


@dataclass(frozen=True)
class RunSpec:
    name: str
    lb_config: dict[str, object]
    pylon_args: list[str]
    stargate_args: tuple[str, ...] = ()


PLAIN_STARGATE_ARGS = ("--plain-clients",)
PLAIN_PYLON_ARGS = ("--pylon-relay-non-streaming", "true")


def with_plain_clients(run: RunSpec) -> RunSpec:
    """``run`` serving clients that send only OpenAI requests: Stargate fills the routing headers
    from the body, Pylon relays non-streaming answers as JSON."""
    return dataclasses.replace(
        run,
        pylon_args=[*run.pylon_args, *PLAIN_PYLON_ARGS],
        stargate_args=(*run.stargate_args, *PLAIN_STARGATE_ARGS),
    )


def _num(value: float) -> str:
    """A float flag value without a spurious ``.0`` and without truncation."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def token_delay_ms(decode_tokens_per_s: float) -> float:
    """Per-token delay of the mock. The original truncated to whole ms (260 tok/s ran at 333); we don't."""
    return 1000.0 / decode_tokens_per_s


def engines(scenario: Scenario) -> list[EngineSpec]:
    """One engine per cluster, named after its lowest backend index."""
    specs = []
    for indices in scenario.cluster_members().values():
        upstream = min(indices)
        specs.append(EngineSpec(f"engine-{upstream}", _engine_args(scenario, upstream, len(indices))))
    return specs


def _engine_args(scenario: Scenario, upstream: int, pylons: int) -> list[str]:
    profile = scenario.backends.profile_of(upstream)
    timing = profile.service_time_ms
    mock = scenario.mock
    slots = (profile.max_concurrent_requests or 0) * pylons
    capacity = profile.kv_cache_capacity_tokens * pylons
    if slots > U64_MAX or capacity > U64_MAX:
        raise ConfigError("concurrency or KV capacity times pylons_per_cluster overflows", path="$.backends")
    args = [
        "--model-name", scenario.model,
        "--num-tokens", str(MOCK_NUM_TOKENS),
        "--token-delay-ms", _num(token_delay_ms(timing.decode_tokens_per_s)),
        "--decode-jitter-ms", str(timing.decode_jitter_ms),
        "--ttft-ms", str(timing.ttft_mean),
        "--ttft-jitter-ms", str(timing.ttft_jitter_ms),
        "--prefill-tokens-per-s", _num(timing.prefill_tokens_per_s or 0.0),
        "--max-concurrent-requests", str(slots),
        "--kv-cache-capacity-tokens", str(capacity),
        "--kv-cache-mode", mock.kv_mode,
        "--batching", mock.batching,
        "--backend-id", f"engine-{upstream}",
    ]  # fmt: skip
    if mock.batching == "vllm":
        args += ["--max-num-batched-tokens", str(mock.max_num_batched_tokens)]
    if mock.kv_mode == "prefix":
        args += ["--kv-block-size", str(mock.block_tokens)]
    if mock.health_delay_ms:
        args += ["--health-delay-ms", str(mock.health_delay_ms)]
    return args


def backend_specs(scenario: Scenario) -> list[BackendSpec]:
    """One Pylon per backend (``backends`` itself is the original's topology block)."""
    backends = scenario.backends
    members = scenario.cluster_members()
    specs = []
    for index in range(backends.count):
        cluster = backends.cluster_of(index)
        profile = backends.profile_of(index)
        args = [
            "--inference-server-id", f"backend-{index}",
            "--model-name", scenario.model,
            "--kv-cache-stats-path", "/kv-cache/stats",
            "--min-update-interval-ms", "100",
            "--disable-bringup",
            "--active-canary-interval-ms", "0",
            "--initial-input-tps", _num(profile.registration.last_mean_input_tps),
            "--benchmark-pin-input-tps",
        ]  # fmt: skip
        if backends.cluster_id_template is not None:
            args += ["--cluster-id", cluster]
        if profile.max_concurrent_requests:
            args += ["--max-engine-concurrency", str(profile.max_concurrent_requests)]
        if not scenario.client.stream:  # Pylon relays only streams unless told otherwise
            args += ["--pylon-relay-non-streaming", "true"]
        engine = f"engine-{min(members[cluster])}"
        specs.append(BackendSpec(f"backend-{index}", cluster, engine, args))
    return specs


def queue_admission_args(admission: QueueAdmission | None) -> list[str]:
    """Pylon flags for an algorithm's ``pylon_queue_admission`` block (none when absent)."""
    if admission is None:
        return []
    args = [f"--pylon-queue-mismatch-retry-enabled={'true' if admission.enabled else 'false'}"]
    if admission.min_delta_ms is not None:
        args += ["--pylon-queue-mismatch-min-delta-ms", str(admission.min_delta_ms)]
    if admission.tolerance_factor is not None:
        args += ["--pylon-queue-mismatch-tolerance-factor", _num(admission.tolerance_factor)]
    if admission.retry_after_ms is not None:
        args += ["--pylon-queue-mismatch-retry-after-ms", str(admission.retry_after_ms)]
    return args


def runs(scenario: Scenario) -> list[RunSpec]:
    """One run per ``algorithms[]`` entry, in config order."""
    return [
        RunSpec(entry.name, dict(entry.config), queue_admission_args(entry.pylon_queue_admission))
        for entry in scenario.algorithms
    ]
