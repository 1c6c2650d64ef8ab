"""Scenario files: the original's schema (bench spec §3), loaded unchanged, plus optional extensions.

Every model forbids unknown keys except ``algorithms[].config``, which is forwarded verbatim to the
router as ``lb-config.json``. Extensions are new optional blocks (``client``, ``execution``,
``mock``, ``prompts``) and new traffic kinds (``zipf``, ``sessions``, ``trace``); every original
key keeps its name and default. :meth:`Scenario.engines`, :meth:`Scenario.backends` and
:meth:`Scenario.runs` turn the topology into the command lines of the fleet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from stargate.errors import ConfigError

U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
Positive = Annotated[int, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
PositiveFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]

MOCK_NUM_TOKENS = 32
_GENERATED_HEADERS = frozenset(
    {
        "content-type",
        "x-request-id",
        "x-model",
        "x-input-tokens",
        "x-output-tokens",
        "x-routing-key",
        "x-cache-affinity-key",
        "x-priority",
        "x-max-wait-ms",
        "x-request-slo-ms",
    }
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- distributions (spec §3.5) ---------------------------------------------------------------


class ConstantTokens(_Strict):
    distribution: Literal["constant"]
    value: U64


class UniformTokens(_Strict):
    distribution: Literal["uniform"]
    min: U64
    max: U64

    @model_validator(mode="after")
    def _ordered(self) -> UniformTokens:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class LognormalTokens(_Strict):
    """``mean`` is the median of the law (the original's naming), ``p99_cap`` a hard cap."""

    distribution: Literal["lognormal"]
    mean: PositiveFloat
    sigma: PositiveFloat
    min: U64 | None = None
    p99_cap: U64 | None = None


TokenDist = Annotated[ConstantTokens | UniformTokens | LognormalTokens, Field(discriminator="distribution")]


class ConstantArrival(_Strict):
    distribution: Literal["constant"]
    interval_ms: U64


class PoissonArrival(_Strict):
    distribution: Literal["poisson"]
    target_rps: PositiveFloat


class GammaArrival(_Strict):
    """Extension: gamma-distributed gaps with mean 1/rps and coefficient of variation ``cv``."""

    distribution: Literal["gamma"]
    target_rps: PositiveFloat
    cv: PositiveFloat


Arrival = Annotated[ConstantArrival | PoissonArrival | GammaArrival, Field(discriminator="distribution")]


# --- traffic patterns (spec §3.5 plus extensions) --------------------------------------------


class _Keys(_Strict):
    routing_keys: U64 = 0
    cache_affinity_keys: U64 = 0


class UniformTraffic(_Keys):
    kind: Literal["uniform"]
    input_tokens: TokenDist
    output_tokens: TokenDist
    arrival: Arrival


class ZipfHotsetTraffic(_Keys):
    kind: Literal["zipf_hotset"]
    hotset_fraction: Fraction
    hotset_share: Fraction
    input_tokens: TokenDist
    output_tokens: TokenDist
    arrival: Arrival


class BurstyTraffic(_Keys):
    kind: Literal["bursty"]
    input_tokens: TokenDist
    output_tokens: TokenDist
    quiet_rps: PositiveFloat
    burst_rps: PositiveFloat
    burst_period_requests: Positive


class StairStepTraffic(_Keys):
    kind: Literal["stair_step"]
    input_tokens: TokenDist
    output_tokens: TokenDist
    start_rps: PositiveFloat
    step_rps: Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
    step_requests: Positive


class SizeClass(_Strict):
    input_tokens: TokenDist
    output_tokens: TokenDist


class MixedSizeTraffic(_Keys):
    kind: Literal["mixed_size"]
    arrival: Arrival
    small: SizeClass
    large: SizeClass
    small_share: Fraction


class PrefixReuseTraffic(_Keys):
    kind: Literal["prefix_reuse"]
    initial_input_tokens: TokenDist
    incremental_input_tokens: TokenDist
    output_tokens: TokenDist
    arrival: Arrival

    @model_validator(mode="after")
    def _needs_keys(self) -> PrefixReuseTraffic:
        if self.cache_affinity_keys == 0:
            raise ValueError("prefix_reuse needs cache_affinity_keys > 0")
        return self


class ZipfTraffic(_Keys):
    """Extension: a true Zipf law over cache keys, P(rank r) ∝ r^-exponent."""

    kind: Literal["zipf"]
    exponent: PositiveFloat
    input_tokens: TokenDist
    output_tokens: TokenDist
    arrival: Arrival


class SessionsTraffic(_Strict):
    """Extension: closed-loop multi-turn sessions; each session is one conversation (its own key).

    Turn k+1 starts after turn k ended plus a think time; its input is the previous input plus the
    previous output (when ``context_includes_output``) plus a fresh increment.
    """

    kind: Literal["sessions"]
    routing_keys: U64 = 0
    turns: TokenDist
    think_time_ms: TokenDist = ConstantTokens(distribution="constant", value=0)
    initial_input_tokens: TokenDist
    incremental_input_tokens: TokenDist
    output_tokens: TokenDist
    context_includes_output: bool = True


class TraceTraffic(_Strict):
    """Extension: replay a JSONL trace (path relative to the scenario file).

    Each line: ``timestamp_ms``, ``session`` (or null), ``input_tokens``, ``output_tokens`` and
    optionally ``prompt`` (text sent verbatim) and ``routing_key``.
    """

    kind: Literal["trace"]
    path: str = Field(min_length=1)
    time_scale: PositiveFloat = 1.0


TrafficPattern = Annotated[
    UniformTraffic
    | ZipfHotsetTraffic
    | BurstyTraffic
    | StairStepTraffic
    | MixedSizeTraffic
    | PrefixReuseTraffic
    | ZipfTraffic
    | SessionsTraffic
    | TraceTraffic,
    Field(discriminator="kind"),
]


# --- fleet (spec §3.3, §3.4) -----------------------------------------------------------------


class ServiceTime(_Strict):
    ttft_mean: U64
    ttft_jitter_ms: U64 = 0
    decode_tokens_per_s: PositiveFloat
    decode_jitter_ms: U64 = 0
    prefill_tokens_per_s: PositiveFloat | None = None


class Registration(_Strict):
    last_mean_input_tps: PositiveFloat


class BackendProfile(_Strict):
    name: str = "default"
    weight: float = 1.0
    max_concurrent_requests: U64 | None = None
    kv_cache_capacity_tokens: U64 = 0
    service_time_ms: ServiceTime
    registration: Registration


class ProfileGroup(_Strict):
    count: Positive
    profile: BackendProfile


class Backends(_Strict):
    count: Positive
    cluster_id_template: str | None = None
    pylons_per_cluster: Positive = 1
    profile: BackendProfile
    profiles: list[ProfileGroup] = []

    @model_validator(mode="after")
    def _topology(self) -> Backends:
        template = self.cluster_id_template
        if template is not None and not template.strip():
            raise ValueError("cluster_id_template must not be blank")
        if self.pylons_per_cluster > 1:
            if template is None or "{cluster_index}" not in template:
                raise ValueError("pylons_per_cluster > 1 needs a cluster_id_template with {cluster_index}")
            if self.count % self.pylons_per_cluster:
                raise ValueError(
                    f"count ({self.count}) must be divisible by "
                    f"pylons_per_cluster ({self.pylons_per_cluster})"
                )
        if self.profiles and sum(group.count for group in self.profiles) != self.count:
            raise ValueError(f"profiles counts must sum to backends.count ({self.count})")
        return self

    def profile_of(self, index: int) -> BackendProfile:
        remaining = index
        for group in self.profiles:
            if remaining < group.count:
                return group.profile
            remaining -= group.count
        return self.profile

    def cluster_of(self, index: int) -> str:
        if self.cluster_id_template is None:
            return f"backend-{index}"
        return self.cluster_id_template.replace(
            "{cluster_index}", str(index // self.pylons_per_cluster)
        ).replace("{backend_index}", str(index))


class Stargates(_Strict):
    count: Positive = 1


class Metadata(_Strict):
    description: str | None = None
    tags: list[str] = []
    expected_runtime: str | None = None
    expected_signal: str | None = None


class DegradationAction(_Strict):
    """The original's two actions plus ours: kill (SIGKILL) or freeze (SIGSTOP) an engine or a Pylon."""

    at_request: U64
    backend_index: U64
    action: Literal["delete_backend_pod", "scale_backend", "kill_engine", "kill_pylon", "freeze_engine",
                    "freeze_pylon"]
    replicas: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    resume_after_ms: U64 | None = None

    @model_validator(mode="after")
    def _replicas(self) -> DegradationAction:
        if (self.action == "scale_backend") != (self.replicas is not None):
            raise ValueError("replicas is required for and only allowed with scale_backend")
        if self.resume_after_ms is not None and not self.action.startswith("freeze_"):
            raise ValueError("resume_after_ms is only allowed with freeze_engine and freeze_pylon")
        return self


class Degradation(_Strict):
    actions: list[DegradationAction] = []


class QueueAdmission(_Strict):
    enabled: bool
    min_delta_ms: U64 | None = None
    tolerance_factor: PositiveFloat | None = None
    retry_after_ms: U64 | None = None

    def pylon_args(self) -> list[str]:
        args = [f"--pylon-queue-mismatch-retry-enabled={'true' if self.enabled else 'false'}"]
        if self.min_delta_ms is not None:
            args += ["--pylon-queue-mismatch-min-delta-ms", str(self.min_delta_ms)]
        if self.tolerance_factor is not None:
            args += ["--pylon-queue-mismatch-tolerance-factor", _num(self.tolerance_factor)]
        if self.retry_after_ms is not None:
            args += ["--pylon-queue-mismatch-retry-after-ms", str(self.retry_after_ms)]
        return args


class AlgorithmEntry(_Strict):
    name: str = Field(min_length=1)
    config: dict[str, Any]
    pylon_queue_admission: QueueAdmission | None = None


# --- extensions -------------------------------------------------------------------------------


class Client(_Strict):
    """How the driver sends requests. ``timeout_s`` bounds a whole request (the original had none)."""

    timeout_s: PositiveFloat = 300.0
    stream: bool = True
    request_slo_ms: U64 | None = None
    max_wait_ms: U64 | None = None
    priority: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    headers: dict[str, str] = {}

    @model_validator(mode="after")
    def _no_generated(self) -> Client:
        clash = sorted(name for name in self.headers if name.lower() in _GENERATED_HEADERS)
        if clash:
            raise ValueError(f"headers set by the bench itself cannot be overridden: {', '.join(clash)}")
        return self


class Execution(_Strict):
    """``closed_loop``: ``workers`` sessions in flight, each turn after the previous one ended."""

    mode: Literal["open_loop", "closed_loop"] | None = None
    workers: Positive | None = None
    duration_s: PositiveFloat | None = None


class Mock(_Strict):
    kv_mode: Literal["affinity", "prefix"] = "affinity"
    block_tokens: Positive = 16
    batching: Literal["independent", "continuous"] = "independent"
    health_delay_ms: U64 = 0


class Prompts(_Strict):
    """Prompt text: ``words`` (seeded vocabulary, per-session prefixes) or ``repeat`` (``x`` x tokens)."""

    text: Literal["words", "repeat"] = "words"
    shared_prefix_tokens: U64 = 0
    vocabulary_size: Annotated[int, Field(ge=16, le=65536)] = 2048
    vocabulary_seed: U64 = 0


# --- topology values handed to the fleet ------------------------------------------------------


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


def _num(value: float) -> str:
    """A float flag value without a spurious ``.0`` and without truncation."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def token_delay_ms(decode_tokens_per_s: float) -> float:
    """Per-token delay of the mock. The original truncated to whole ms (260 tok/s ran at 333); we don't."""
    return 1000.0 / decode_tokens_per_s


class Scenario(_Strict):
    name: str = Field(min_length=1)
    metadata: Metadata = Metadata()
    model: str = Field(min_length=1)
    seed: U64 | None = None
    request_count: Positive
    max_concurrency: Positive
    tunnel_protocol: Literal["raw-quic", "http3", "h3", "webtransport", "web-transport", "wt"] = "raw-quic"
    stargates: Stargates = Stargates()
    backends: Backends
    traffic_pattern: TrafficPattern
    degradation: Degradation = Degradation()
    algorithms: list[AlgorithmEntry] = []
    client: Client = Client()
    execution: Execution = Execution()
    mock: Mock = Mock()
    prompts: Prompts = Prompts()

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @model_validator(mode="after")
    def _cross_checks(self) -> Scenario:
        for position, action in enumerate(self.degradation.actions):
            if action.at_request >= self.request_count:
                raise ValueError(f"degradation.actions[{position}].at_request must be < request_count")
            if action.backend_index >= self.backends.count:
                raise ValueError(f"degradation.actions[{position}].backend_index must be < backends.count")
        names = [entry.name for entry in self.algorithms]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"algorithm names must be unique: {', '.join(duplicates)}")
        if isinstance(self.traffic_pattern, SessionsTraffic) and self.execution.mode == "open_loop":
            raise ValueError("sessions traffic needs execution.mode closed_loop")
        self._check_clusters()
        return self

    def _check_clusters(self) -> None:
        members = self.cluster_members()
        for cluster, indices in members.items():
            first = self.backends.profile_of(indices[0])
            if any(self.backends.profile_of(i) != first for i in indices[1:]):
                raise ValueError(f"all backends of cluster {cluster} must have identical profiles")

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    @property
    def slug(self) -> str:
        return slugify(self.name)

    @property
    def effective_mode(self) -> Literal["open_loop", "closed_loop"]:
        if self.execution.mode is not None:
            return self.execution.mode
        return "closed_loop" if isinstance(self.traffic_pattern, SessionsTraffic) else "open_loop"

    def effective_seed(self, override: int | None = None) -> int:
        """CLI ``--seed`` > YAML ``seed`` > 0."""
        if override is not None:
            return override
        return self.seed if self.seed is not None else 0

    def cluster_members(self) -> dict[str, list[int]]:
        members: dict[str, list[int]] = {}
        for index in range(self.backends.count):
            members.setdefault(self.backends.cluster_of(index), []).append(index)
        return members

    def capacity_weights(self) -> dict[str, float]:
        """Registered input tps per backend id: the capacity weights of the balance scores (spec §7)."""
        return {
            f"backend-{i}": self.backends.profile_of(i).registration.last_mean_input_tps
            for i in range(self.backends.count)
        }

    def engines(self) -> list[EngineSpec]:
        engines = []
        for indices in self.cluster_members().values():
            upstream = min(indices)
            engines.append(EngineSpec(f"engine-{upstream}", self._engine_args(upstream, len(indices))))
        return engines

    def _engine_args(self, upstream: int, pylons: int) -> list[str]:
        profile = self.backends.profile_of(upstream)
        timing = profile.service_time_ms
        slots = (profile.max_concurrent_requests or 0) * pylons
        capacity = profile.kv_cache_capacity_tokens * pylons
        if slots >= 2**64 or capacity >= 2**64:
            raise ConfigError(
                "concurrency or KV capacity times pylons_per_cluster overflows", path="$.backends"
            )
        args = [
            "--model-name", self.model,
            "--num-tokens", str(MOCK_NUM_TOKENS),
            "--token-delay-ms", _num(token_delay_ms(timing.decode_tokens_per_s)),
            "--decode-jitter-ms", str(timing.decode_jitter_ms),
            "--ttft-ms", str(timing.ttft_mean),
            "--ttft-jitter-ms", str(timing.ttft_jitter_ms),
            "--prefill-tokens-per-s", _num(timing.prefill_tokens_per_s or 0.0),
            "--max-concurrent-requests", str(slots),
            "--kv-cache-capacity-tokens", str(capacity),
            "--kv-cache-mode", self.mock.kv_mode,
            "--batching", self.mock.batching,
            "--backend-id", f"engine-{upstream}",
        ]  # fmt: skip
        if self.mock.kv_mode == "prefix":
            args += ["--kv-block-size", str(self.mock.block_tokens)]
        if self.mock.health_delay_ms:
            args += ["--health-delay-ms", str(self.mock.health_delay_ms)]
        return args

    def backend_specs(self) -> list[BackendSpec]:
        """One Pylon per backend (``backends`` itself is the original's topology block)."""
        members = self.cluster_members()
        specs = []
        for index in range(self.backends.count):
            cluster = self.backends.cluster_of(index)
            profile = self.backends.profile_of(index)
            args = [
                "--inference-server-id", f"backend-{index}",
                "--model-name", self.model,
                "--kv-cache-stats-path", "/kv-cache/stats",
                "--min-update-interval-ms", "100",
                "--disable-bringup",
                "--active-canary-interval-ms", "0",
                "--initial-input-tps", _num(profile.registration.last_mean_input_tps),
                "--benchmark-pin-input-tps",
            ]  # fmt: skip
            if self.backends.cluster_id_template is not None:
                args += ["--cluster-id", cluster]
            if profile.max_concurrent_requests:
                args += ["--max-engine-concurrency", str(profile.max_concurrent_requests)]
            engine = f"engine-{min(members[cluster])}"
            specs.append(BackendSpec(f"backend-{index}", cluster, engine, args))
        return specs

    def runs(self) -> list[RunSpec]:
        return [
            RunSpec(
                entry.name,
                dict(entry.config),
                entry.pylon_queue_admission.pylon_args() if entry.pylon_queue_admission else [],
            )
            for entry in self.algorithms
        ]

    def select_algorithms(self, names: list[str]) -> Scenario:
        """Keep the named algorithms in config order; unknown names are an error listing the known."""
        known = [entry.name for entry in self.algorithms]
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ConfigError(
                f"unknown algorithm(s) {', '.join(unknown)}; available: {', '.join(known) or 'none'}",
                path="--algorithms",
            )
        kept = [entry for entry in self.algorithms if entry.name in names]
        copy = self.model_copy(update={"algorithms": kept})
        copy._base_dir = self._base_dir
        return copy


def slugify(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "scenario"


def _path_of(loc: tuple[int | str, ...], data: Any) -> str:
    """JSON path of a pydantic error location, dropping the union tags pydantic inserts."""
    path = "$"
    node = data
    for part in loc:
        tagged = isinstance(node, dict) and isinstance(part, str) and part not in node
        if tagged and part in (node.get("kind"), node.get("distribution")):
            continue
        if isinstance(part, int):
            path += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
        else:
            path += f".{part}"
            node = node.get(part) if isinstance(node, dict) else None
    return path


def parse_scenario(data: Any, *, file: str = "", base_dir: Path | None = None) -> Scenario:
    if not isinstance(data, dict):
        raise ConfigError("a scenario must be a mapping", file=file)
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        reason = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            reason = "unknown field"
        more = exc.error_count() - 1
        if more:
            reason += f" (and {more} more error{'s' if more > 1 else ''})"
        raise ConfigError(reason, path=_path_of(tuple(first["loc"]), data), file=file) from exc
    except ConfigError as exc:
        raise exc.in_file(file) from None
    if base_dir is not None:
        scenario._base_dir = base_dir
    return scenario


def load_scenario(path: str | Path) -> Scenario:
    """Load a YAML (``.yaml``/``.yml``) or JSON scenario; errors name the file and the field."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read scenario: {exc.strerror or exc}", file=str(file)) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML/JSON: {exc}", file=str(file)) from exc
    return parse_scenario(data, file=str(file), base_dir=file.resolve().parent)
