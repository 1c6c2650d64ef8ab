"""Scenario files: the original's schema (bench spec §3), loaded unchanged, plus optional extensions.

Every model forbids unknown keys except ``algorithms[].config``, which is checked as the router
checks an ``lb-config.json`` and forwarded to it verbatim. Extensions are new optional blocks
(``client``, ``execution``, ``mock``, ``prompts``) and new traffic kinds
(:mod:`stargate.bench.traffic`); every original key keeps its name and default.
:mod:`stargate.bench.plan` turns a scenario into the fleet's command lines.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from stargate.balancer.config import parse_lb_config
from stargate.bench.traffic import (
    U64,
    Positive,
    PositiveFloat,
    SessionsTraffic,
    Strict,
    TrafficPattern,
)
from stargate.errors import ConfigError
from stargate.mock_engine.timing import Batching
from stargate.wire import headers as h
from stargate.wire.limits import U32_MAX

_GENERATED_HEADERS = frozenset(
    {
        "content-type",
        h.REQUEST_ID,
        h.MODEL,
        h.INPUT_TOKENS,
        h.OUTPUT_TOKENS,
        h.ROUTING_KEY,
        h.CACHE_AFFINITY_KEY,
        h.PRIORITY,
        h.MAX_WAIT_MS,
        h.REQUEST_SLO_MS,
    }
)


# --- fleet (spec §3.3, §3.4) -----------------------------------------------------------------


class ServiceTime(Strict):
    ttft_mean: U64
    ttft_jitter_ms: U64 = 0
    decode_tokens_per_s: PositiveFloat
    decode_jitter_ms: U64 = 0
    prefill_tokens_per_s: PositiveFloat | None = None


class Registration(Strict):
    last_mean_input_tps: PositiveFloat


class BackendProfile(Strict):
    name: str = "default"
    weight: float = 1.0
    max_concurrent_requests: U64 | None = None
    kv_cache_capacity_tokens: U64 = 0
    service_time_ms: ServiceTime
    registration: Registration


class ProfileGroup(Strict):
    count: Positive
    profile: BackendProfile


class Backends(Strict):
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


class Stargates(Strict):
    count: Positive = 1


class Metadata(Strict):
    description: str | None = None
    tags: list[str] = []
    expected_runtime: str | None = None
    expected_signal: str | None = None


class DegradationAction(Strict):
    """The original's two actions plus ours: kill (SIGKILL) or freeze (SIGSTOP) an engine or a Pylon, or
    kill a Stargate replica (``kill_stargate``: ``backend_index`` is then the replica's index, sg-N)."""

    at_request: U64
    backend_index: U64
    action: Literal["delete_backend_pod", "scale_backend", "kill_engine", "kill_pylon", "freeze_engine",
                    "freeze_pylon", "kill_stargate"]
    replicas: Annotated[int, Field(ge=0, le=U32_MAX)] | None = None
    resume_after_ms: U64 | None = None

    @model_validator(mode="after")
    def _replicas(self) -> DegradationAction:
        if (self.action == "scale_backend") != (self.replicas is not None):
            raise ValueError("replicas is required for and only allowed with scale_backend")
        if self.resume_after_ms is not None and not self.action.startswith("freeze_"):
            raise ValueError("resume_after_ms is only allowed with freeze_engine and freeze_pylon")
        return self


class Degradation(Strict):
    actions: list[DegradationAction] = []


class QueueAdmission(Strict):
    enabled: bool
    min_delta_ms: U64 | None = None
    tolerance_factor: PositiveFloat | None = None
    retry_after_ms: U64 | None = None


class AlgorithmEntry(Strict):
    name: str = Field(min_length=1)
    config: dict[str, Any]
    pylon_queue_admission: QueueAdmission | None = None

    @field_validator("config")
    @classmethod
    def _an_lb_config(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Checked as Stargate will check it, so ``validate`` fails what a run would."""
        try:
            parse_lb_config(value)
        except ConfigError as exc:
            raise ValueError(f"not an lb-config: {exc.describe()}") from None
        return value


# --- extensions -------------------------------------------------------------------------------


class Client(Strict):
    """How the driver sends requests. ``timeout_s`` bounds a whole request (the original had none)."""

    timeout_s: PositiveFloat = 300.0
    stream: bool = True
    request_slo_ms: U64 | None = None
    max_wait_ms: U64 | None = None
    priority: Annotated[int, Field(ge=0, le=U32_MAX)] | None = None
    headers: dict[str, str] = {}

    @model_validator(mode="after")
    def _no_generated(self) -> Client:
        clash = sorted(name for name in self.headers if name.lower() in _GENERATED_HEADERS)
        if clash:
            raise ValueError(f"headers set by the bench itself cannot be overridden: {', '.join(clash)}")
        return self


class Execution(Strict):
    """``closed_loop``: ``workers`` sessions in flight, each turn after the previous one ended."""

    mode: Literal["open_loop", "closed_loop"] | None = None
    workers: Positive | None = None
    duration_s: PositiveFloat | None = None


class Mock(Strict):
    """Mock engine flags; ``max_num_batched_tokens`` is the step budget of ``batching: vllm``."""

    kv_mode: Literal["affinity", "prefix"] = "affinity"
    block_tokens: Positive = 16
    batching: Batching = "independent"
    max_num_batched_tokens: Positive = 2048
    health_delay_ms: U64 = 0


class Prompts(Strict):
    """Prompt text: ``words`` (seeded vocabulary, per-session prefixes) or ``repeat`` (``x`` x tokens)."""

    text: Literal["words", "repeat"] = "words"
    shared_prefix_tokens: U64 = 0
    vocabulary_size: Annotated[int, Field(ge=16, le=65536)] = 2048
    vocabulary_seed: U64 = 0


MAX_REQUEST_COUNT = 10_000_000
"""A workload is planned whole, in memory, before it runs: a bound, not a suggestion."""

MAX_SCHEDULE_S = 86_400.0
"""The replay's schedule: no request starts later than this after the first, and no session thinks
longer in all. A day is longer than any benchmark; a later offset (a trace row stamped 1e300) is a
mistake that would leave the run waiting for ever."""

MAX_TOKENS = 1_000_000
"""Tokens of one prompt or one answer: a long-context model's window. Prompt text is built in memory
(4 bytes a token) when the workload is planned, so a larger count is a mistake, not a workload."""


class Scenario(Strict):
    name: str = Field(min_length=1)
    metadata: Metadata = Metadata()
    model: str = Field(min_length=1)
    seed: U64 | None = None
    request_count: Annotated[int, Field(gt=0, le=MAX_REQUEST_COUNT)]
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
    _file: str = PrivateAttr(default="")

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
    def file(self) -> str:
        """The file the scenario was loaded from (empty when built in memory), for error messages."""
        return self._file

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

    def slot_counts(self) -> dict[str, float]:
        """Engine slots (``max_concurrent_requests``) per backend id: the per-slot in-flight measure.
        With a backend of unbounded concurrency slots mean nothing: every backend counts 1."""
        limits = [self.backends.profile_of(i).max_concurrent_requests for i in range(self.backends.count)]
        return {f"backend-{i}": float(limit or 1) if all(limits) else 1.0 for i, limit in enumerate(limits)}

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


MAX_LISTED_ERRORS = 10


def _reason(error: ErrorDetails) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown field"
    return str(error["msg"]).removeprefix("Value error, ")


def parse_scenario(data: Any, *, file: str = "", base_dir: Path | None = None) -> Scenario:
    if not isinstance(data, dict):
        raise ConfigError("a scenario must be a mapping", file=file)
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        # Every problem at once (up to a screenful): a user fixing a file one error per run
        # would otherwise run it again for each.
        problems = [(_path_of(tuple(e["loc"]), data), _reason(e)) for e in exc.errors(include_url=False)]
        (path, reason), more = problems[0], problems[1:MAX_LISTED_ERRORS]
        reason += "".join(f"; {p}: {r}" for p, r in more)
        if len(problems) > MAX_LISTED_ERRORS:
            reason += f" (and {len(problems) - MAX_LISTED_ERRORS} more)"
        raise ConfigError(reason, path=path, file=file) from exc
    except ConfigError as exc:
        raise exc.in_file(file) from None
    if base_dir is not None:
        scenario._base_dir = base_dir
    scenario._file = file
    return scenario


def load_scenario(path: str | Path) -> Scenario:
    """Load a YAML (``.yaml``/``.yml``) or JSON scenario; errors name the file and the field."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read scenario: {exc.strerror or exc}", file=str(file)) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte {exc.start})", file=str(file)) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML/JSON: {exc}", file=str(file)) from exc
    return parse_scenario(data, file=str(file), base_dir=file.resolve().parent)
