from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_NVME: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_NVME: Tier
TIER_REMOTE: Tier

class ModelIdentity(_message.Message):
    __slots__ = ("model_id", "weights_digest", "num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "kv_dtype", "kv_quantization", "memory_layout", "adapter_id", "adapter_digest", "tokenizer_digest", "chat_template_version", "rope_theta", "rope_scaling", "tp_rank", "tp_world_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    ROPE_SCALING_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weights_digest: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    kv_dtype: str
    kv_quantization: str
    memory_layout: str
    adapter_id: str
    adapter_digest: str
    tokenizer_digest: str
    chat_template_version: str
    rope_theta: float
    rope_scaling: str
    tp_rank: int
    tp_world_size: int
    def __init__(self, model_id: _Optional[str] = ..., weights_digest: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tokens_per_block: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., kv_quantization: _Optional[str] = ..., memory_layout: _Optional[str] = ..., adapter_id: _Optional[str] = ..., adapter_digest: _Optional[str] = ..., tokenizer_digest: _Optional[str] = ..., chat_template_version: _Optional[str] = ..., rope_theta: _Optional[float] = ..., rope_scaling: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_world_size: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("identity",)
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    identity: ModelIdentity
    def __init__(self, identity: _Optional[_Union[ModelIdentity, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("fingerprint", "block_bytes")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    block_bytes: int
    def __init__(self, fingerprint: _Optional[bytes] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("fingerprint", "keys", "pin_ttl_s", "scope")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_S_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pin_ttl_s: float
    scope: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., pin_ttl_s: _Optional[float] = ..., scope: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_blocks", "tiers", "lease_id", "lease_ttl_s")
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    hit_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    lease_id: int
    lease_ttl_s: float
    def __init__(self, hit_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., lease_id: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("fingerprint", "keys", "scope")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    scope: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., scope: _Optional[str] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, present: _Optional[_Iterable[bool]] = ...) -> None: ...

class HeadsRequest(_message.Message):
    __slots__ = ("fingerprint", "keys", "head_bytes", "scope")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HEAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    head_bytes: int
    scope: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., head_bytes: _Optional[int] = ..., scope: _Optional[str] = ...) -> None: ...

class HeadsResponse(_message.Message):
    __slots__ = ("heads",)
    HEADS_FIELD_NUMBER: _ClassVar[int]
    heads: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, heads: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("fingerprint", "keys", "scope")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    scope: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., scope: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class InvalidateRequest(_message.Message):
    __slots__ = ("fingerprint", "everything", "tenant")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EVERYTHING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    everything: bool
    tenant: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., everything: _Optional[bool] = ..., tenant: _Optional[str] = ...) -> None: ...

class InvalidateResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class DemoteRequest(_message.Message):
    __slots__ = ("tier", "fingerprint", "tenant")
    TIER_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tier: str
    fingerprint: bytes
    tenant: str
    def __init__(self, tier: _Optional[str] = ..., fingerprint: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class DemoteResponse(_message.Message):
    __slots__ = ("moved",)
    MOVED_FIELD_NUMBER: _ClassVar[int]
    moved: int
    def __init__(self, moved: _Optional[int] = ...) -> None: ...

class ShredRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class ShredResponse(_message.Message):
    __slots__ = ("removed", "key_removed")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    KEY_REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    key_removed: bool
    def __init__(self, removed: _Optional[int] = ..., key_removed: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "blocks", "checksum_failures", "stored_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    checksum_failures: int
    stored_bytes: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., stored_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "counters", "tenant_bytes", "absent_tiers", "blocks", "leases", "tenant", "version", "uptime_s", "addresses", "lookup_tokens", "hit_tokens", "fingerprints", "connections", "tenant_connections")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TenantBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ConnectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TenantConnectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    TENANT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ABSENT_TIERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    TENANT_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    counters: _containers.ScalarMap[str, int]
    tenant_bytes: _containers.ScalarMap[str, int]
    absent_tiers: _containers.RepeatedScalarFieldContainer[str]
    blocks: int
    leases: int
    tenant: str
    version: str
    uptime_s: float
    addresses: _containers.RepeatedScalarFieldContainer[str]
    lookup_tokens: int
    hit_tokens: int
    fingerprints: _containers.RepeatedCompositeFieldContainer[FingerprintStats]
    connections: _containers.ScalarMap[str, int]
    tenant_connections: _containers.ScalarMap[str, int]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., tenant_bytes: _Optional[_Mapping[str, int]] = ..., absent_tiers: _Optional[_Iterable[str]] = ..., blocks: _Optional[int] = ..., leases: _Optional[int] = ..., tenant: _Optional[str] = ..., version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., addresses: _Optional[_Iterable[str]] = ..., lookup_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., fingerprints: _Optional[_Iterable[_Union[FingerprintStats, _Mapping]]] = ..., connections: _Optional[_Mapping[str, int]] = ..., tenant_connections: _Optional[_Mapping[str, int]] = ...) -> None: ...

class FingerprintStats(_message.Message):
    __slots__ = ("fingerprint", "model_id", "blocks", "bytes", "tp_rank", "tp_world_size")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    model_id: str
    blocks: int
    bytes: int
    tp_rank: int
    tp_world_size: int
    def __init__(self, fingerprint: _Optional[bytes] = ..., model_id: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_world_size: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfoResponse(_message.Message):
    __slots__ = ("data_port", "tiers", "data_socket")
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    data_port: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    data_socket: str
    def __init__(self, data_port: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., data_socket: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("arena_name", "arena_bytes", "pinned")
    ARENA_NAME_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    arena_name: str
    arena_bytes: int
    pinned: bool
    def __init__(self, arena_name: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., pinned: _Optional[bool] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("offset", "size_bytes", "present")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    offset: int
    size_bytes: int
    present: bool
    def __init__(self, offset: _Optional[int] = ..., size_bytes: _Optional[int] = ..., present: _Optional[bool] = ...) -> None: ...

class ResolveRequest(_message.Message):
    __slots__ = ("fingerprint", "keys", "ttl_s", "scope")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    scope: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ..., scope: _Optional[str] = ...) -> None: ...

class ResolveResponse(_message.Message):
    __slots__ = ("slots", "tiers", "lease_id", "arena_name")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_NAME_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    lease_id: int
    arena_name: str
    def __init__(self, slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., lease_id: _Optional[int] = ..., arena_name: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("fingerprint", "keys", "sizes", "parent", "ttl_s", "scope")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    parent: bytes
    ttl_s: float
    scope: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., sizes: _Optional[_Iterable[int]] = ..., parent: _Optional[bytes] = ..., ttl_s: _Optional[float] = ..., scope: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "slots", "arena_name")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ARENA_NAME_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    arena_name: str
    def __init__(self, reservation_id: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., arena_name: _Optional[str] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id", "checksums")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reservation_id: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    def __init__(self, reservation_id: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("fingerprint", "keys", "scope")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    scope: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., scope: _Optional[str] = ...) -> None: ...

class BlockFrame(_message.Message):
    __slots__ = ("key", "payload", "fingerprint", "parent", "scope", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    payload: bytes
    fingerprint: bytes
    parent: bytes
    scope: str
    checksum: int
    def __init__(self, key: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., fingerprint: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., scope: _Optional[str] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "received")
    STORED_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    received: int
    def __init__(self, stored: _Optional[int] = ..., received: _Optional[int] = ...) -> None: ...
