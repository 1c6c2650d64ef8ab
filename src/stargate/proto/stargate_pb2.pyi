from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InferenceServerStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INFERENCE_SERVER_STATUS_UNKNOWN: _ClassVar[InferenceServerStatus]
    INFERENCE_SERVER_STATUS_ACTIVE: _ClassVar[InferenceServerStatus]
    INFERENCE_SERVER_STATUS_INACTIVE: _ClassVar[InferenceServerStatus]
INFERENCE_SERVER_STATUS_UNKNOWN: InferenceServerStatus
INFERENCE_SERVER_STATUS_ACTIVE: InferenceServerStatus
INFERENCE_SERVER_STATUS_INACTIVE: InferenceServerStatus

class WatchStargatesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StargateInfo(_message.Message):
    __slots__ = ("stargate_id", "advertise_addr", "http_advertise_addr", "grpc_pylon_dial_addr")
    STARGATE_ID_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_ADDR_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADVERTISE_ADDR_FIELD_NUMBER: _ClassVar[int]
    GRPC_PYLON_DIAL_ADDR_FIELD_NUMBER: _ClassVar[int]
    stargate_id: str
    advertise_addr: str
    http_advertise_addr: str
    grpc_pylon_dial_addr: str
    def __init__(self, stargate_id: _Optional[str] = ..., advertise_addr: _Optional[str] = ..., http_advertise_addr: _Optional[str] = ..., grpc_pylon_dial_addr: _Optional[str] = ...) -> None: ...

class WatchStargatesResponse(_message.Message):
    __slots__ = ("stargates", "watch_stargate_urls")
    STARGATES_FIELD_NUMBER: _ClassVar[int]
    WATCH_STARGATE_URLS_FIELD_NUMBER: _ClassVar[int]
    stargates: _containers.RepeatedCompositeFieldContainer[StargateInfo]
    watch_stargate_urls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stargates: _Optional[_Iterable[_Union[StargateInfo, _Mapping]]] = ..., watch_stargate_urls: _Optional[_Iterable[str]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ("model_ids", "routing_key")
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    routing_key: str
    def __init__(self, model_ids: _Optional[_Iterable[str]] = ..., routing_key: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("model_ids",)
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CacheAffinityRoute(_message.Message):
    __slots__ = ("cache_affinity_key", "input_tokens", "admitted_at_unix_ms")
    CACHE_AFFINITY_KEY_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    cache_affinity_key: str
    input_tokens: int
    admitted_at_unix_ms: int
    def __init__(self, cache_affinity_key: _Optional[str] = ..., input_tokens: _Optional[int] = ..., admitted_at_unix_ms: _Optional[int] = ...) -> None: ...

class ModelStats(_message.Message):
    __slots__ = ("last_mean_input_tps", "output_tps", "queue_size", "queued_input_size", "max_output_tps", "kv_cache_capacity_tokens", "kv_cache_used_tokens", "kv_cache_free_tokens", "num_running_queries", "max_engine_concurrency", "total_query_input_size", "queue_time_estimate_ms_by_priority", "input_processing_queries", "output_generation_queries", "stats_observed_at_unix_ms", "stats_capabilities", "stats_sources", "recent_cache_affinity_routes", "prefilling_cache_affinity_keys")
    class QueueTimeEstimateMsByPriorityEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    LAST_MEAN_INPUT_TPS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TPS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_INPUT_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TPS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_QUERIES_FIELD_NUMBER: _ClassVar[int]
    MAX_ENGINE_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_QUERY_INPUT_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_ESTIMATE_MS_BY_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    INPUT_PROCESSING_QUERIES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_GENERATION_QUERIES_FIELD_NUMBER: _ClassVar[int]
    STATS_OBSERVED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STATS_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    STATS_SOURCES_FIELD_NUMBER: _ClassVar[int]
    RECENT_CACHE_AFFINITY_ROUTES_FIELD_NUMBER: _ClassVar[int]
    PREFILLING_CACHE_AFFINITY_KEYS_FIELD_NUMBER: _ClassVar[int]
    last_mean_input_tps: float
    output_tps: float
    queue_size: int
    queued_input_size: int
    max_output_tps: float
    kv_cache_capacity_tokens: int
    kv_cache_used_tokens: int
    kv_cache_free_tokens: int
    num_running_queries: int
    max_engine_concurrency: int
    total_query_input_size: int
    queue_time_estimate_ms_by_priority: _containers.ScalarMap[int, int]
    input_processing_queries: int
    output_generation_queries: int
    stats_observed_at_unix_ms: int
    stats_capabilities: _containers.RepeatedScalarFieldContainer[str]
    stats_sources: _containers.RepeatedScalarFieldContainer[str]
    recent_cache_affinity_routes: _containers.RepeatedCompositeFieldContainer[CacheAffinityRoute]
    prefilling_cache_affinity_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, last_mean_input_tps: _Optional[float] = ..., output_tps: _Optional[float] = ..., queue_size: _Optional[int] = ..., queued_input_size: _Optional[int] = ..., max_output_tps: _Optional[float] = ..., kv_cache_capacity_tokens: _Optional[int] = ..., kv_cache_used_tokens: _Optional[int] = ..., kv_cache_free_tokens: _Optional[int] = ..., num_running_queries: _Optional[int] = ..., max_engine_concurrency: _Optional[int] = ..., total_query_input_size: _Optional[int] = ..., queue_time_estimate_ms_by_priority: _Optional[_Mapping[int, int]] = ..., input_processing_queries: _Optional[int] = ..., output_generation_queries: _Optional[int] = ..., stats_observed_at_unix_ms: _Optional[int] = ..., stats_capabilities: _Optional[_Iterable[str]] = ..., stats_sources: _Optional[_Iterable[str]] = ..., recent_cache_affinity_routes: _Optional[_Iterable[_Union[CacheAffinityRoute, _Mapping]]] = ..., prefilling_cache_affinity_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class InferenceServerRegistration(_message.Message):
    __slots__ = ("inference_server_id", "inference_server_url", "models", "reverse_tunnel", "cluster_id")
    class ModelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: InferenceServerModelRegistration
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[InferenceServerModelRegistration, _Mapping]] = ...) -> None: ...
    INFERENCE_SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_SERVER_URL_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    REVERSE_TUNNEL_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    inference_server_id: str
    inference_server_url: str
    models: _containers.MessageMap[str, InferenceServerModelRegistration]
    reverse_tunnel: bool
    cluster_id: str
    def __init__(self, inference_server_id: _Optional[str] = ..., inference_server_url: _Optional[str] = ..., models: _Optional[_Mapping[str, InferenceServerModelRegistration]] = ..., reverse_tunnel: _Optional[bool] = ..., cluster_id: _Optional[str] = ...) -> None: ...

class InferenceServerModelRegistration(_message.Message):
    __slots__ = ("stats", "status")
    STATS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    stats: ModelStats
    status: InferenceServerStatus
    def __init__(self, stats: _Optional[_Union[ModelStats, _Mapping]] = ..., status: _Optional[_Union[InferenceServerStatus, str]] = ...) -> None: ...

class InferenceServerAck(_message.Message):
    __slots__ = ("reverse_tunnel_target", "reverse_tunnel_pylon_dial_addr")
    REVERSE_TUNNEL_TARGET_FIELD_NUMBER: _ClassVar[int]
    REVERSE_TUNNEL_PYLON_DIAL_ADDR_FIELD_NUMBER: _ClassVar[int]
    reverse_tunnel_target: str
    reverse_tunnel_pylon_dial_addr: str
    def __init__(self, reverse_tunnel_target: _Optional[str] = ..., reverse_tunnel_pylon_dial_addr: _Optional[str] = ...) -> None: ...
