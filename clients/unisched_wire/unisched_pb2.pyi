from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_ONLINE: _ClassVar[Priority]
    PRIORITY_OFFLINE: _ClassVar[Priority]
PRIORITY_UNSPECIFIED: Priority
PRIORITY_ONLINE: Priority
PRIORITY_OFFLINE: Priority

class ResourceShare(_message.Message):
    __slots__ = ("gpu", "domain", "target_share", "measured_share", "charges")
    GPU_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    TARGET_SHARE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SHARE_FIELD_NUMBER: _ClassVar[int]
    CHARGES_FIELD_NUMBER: _ClassVar[int]
    gpu: int
    domain: str
    target_share: float
    measured_share: float
    charges: _containers.RepeatedCompositeFieldContainer[Charge]
    def __init__(self, gpu: _Optional[int] = ..., domain: _Optional[str] = ..., target_share: _Optional[float] = ..., measured_share: _Optional[float] = ..., charges: _Optional[_Iterable[_Union[Charge, _Mapping]]] = ...) -> None: ...

class Charge(_message.Message):
    __slots__ = ("rule", "source", "seconds")
    RULE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    rule: str
    source: str
    seconds: float
    def __init__(self, rule: _Optional[str] = ..., source: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("name", "weight", "base_weight", "priority", "pids", "state", "target_share", "measured_share", "gpu_seconds", "cgroup", "engines", "shares", "slices", "owner_uid", "adopted", "sessions", "refusals", "caps", "memory_bytes", "over_memory", "devices", "cooperative", "overrun_s", "enforced", "unit_ms", "turn_ms", "env", "gpu_memory")
    class SessionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BASE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TARGET_SHARE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SHARE_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CGROUP_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    CAPS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    OVER_MEMORY_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    COOPERATIVE_FIELD_NUMBER: _ClassVar[int]
    OVERRUN_S_FIELD_NUMBER: _ClassVar[int]
    ENFORCED_FIELD_NUMBER: _ClassVar[int]
    UNIT_MS_FIELD_NUMBER: _ClassVar[int]
    TURN_MS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: int
    base_weight: int
    priority: Priority
    pids: _containers.RepeatedScalarFieldContainer[int]
    state: str
    target_share: float
    measured_share: float
    gpu_seconds: float
    cgroup: str
    engines: _containers.RepeatedScalarFieldContainer[str]
    shares: _containers.RepeatedCompositeFieldContainer[ResourceShare]
    slices: int
    owner_uid: int
    adopted: bool
    sessions: _containers.ScalarMap[str, int]
    refusals: _containers.ScalarMap[str, int]
    caps: Limits
    memory_bytes: int
    over_memory: bool
    devices: str
    cooperative: bool
    overrun_s: float
    enforced: bool
    unit_ms: float
    turn_ms: float
    env: _containers.ScalarMap[str, str]
    gpu_memory: _containers.RepeatedCompositeFieldContainer[GpuMemory]
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[int] = ..., base_weight: _Optional[int] = ..., priority: _Optional[_Union[Priority, str]] = ..., pids: _Optional[_Iterable[int]] = ..., state: _Optional[str] = ..., target_share: _Optional[float] = ..., measured_share: _Optional[float] = ..., gpu_seconds: _Optional[float] = ..., cgroup: _Optional[str] = ..., engines: _Optional[_Iterable[str]] = ..., shares: _Optional[_Iterable[_Union[ResourceShare, _Mapping]]] = ..., slices: _Optional[int] = ..., owner_uid: _Optional[int] = ..., adopted: _Optional[bool] = ..., sessions: _Optional[_Mapping[str, int]] = ..., refusals: _Optional[_Mapping[str, int]] = ..., caps: _Optional[_Union[Limits, _Mapping]] = ..., memory_bytes: _Optional[int] = ..., over_memory: _Optional[bool] = ..., devices: _Optional[str] = ..., cooperative: _Optional[bool] = ..., overrun_s: _Optional[float] = ..., enforced: _Optional[bool] = ..., unit_ms: _Optional[float] = ..., turn_ms: _Optional[float] = ..., env: _Optional[_Mapping[str, str]] = ..., gpu_memory: _Optional[_Iterable[_Union[GpuMemory, _Mapping]]] = ...) -> None: ...

class GpuMemory(_message.Message):
    __slots__ = ("gpu", "used_bytes", "cap_bytes", "reserve_bytes", "refused")
    GPU_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    gpu: int
    used_bytes: int
    cap_bytes: int
    reserve_bytes: int
    refused: int
    def __init__(self, gpu: _Optional[int] = ..., used_bytes: _Optional[int] = ..., cap_bytes: _Optional[int] = ..., reserve_bytes: _Optional[int] = ..., refused: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("render", "decode", "encode", "memory_bytes", "memory_reserve")
    RENDER_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    ENCODE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RESERVE_FIELD_NUMBER: _ClassVar[int]
    render: int
    decode: int
    encode: int
    memory_bytes: int
    memory_reserve: int
    def __init__(self, render: _Optional[int] = ..., decode: _Optional[int] = ..., encode: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., memory_reserve: _Optional[int] = ...) -> None: ...

class SetLimitRequest(_message.Message):
    __slots__ = ("tenant", "render", "decode", "encode", "memory_bytes", "memory_reserve")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RENDER_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    ENCODE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RESERVE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    render: int
    decode: int
    encode: int
    memory_bytes: int
    memory_reserve: int
    def __init__(self, tenant: _Optional[str] = ..., render: _Optional[int] = ..., decode: _Optional[int] = ..., encode: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., memory_reserve: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("tenant", "weight", "priority", "engines", "gpus", "keep", "session_hooks", "memory_bytes", "memory_reserve")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    SESSION_HOOKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RESERVE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: int
    priority: Priority
    engines: _containers.RepeatedScalarFieldContainer[str]
    gpus: _containers.RepeatedScalarFieldContainer[int]
    keep: bool
    session_hooks: bool
    memory_bytes: int
    memory_reserve: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[int] = ..., priority: _Optional[_Union[Priority, str]] = ..., engines: _Optional[_Iterable[str]] = ..., gpus: _Optional[_Iterable[int]] = ..., keep: _Optional[bool] = ..., session_hooks: _Optional[bool] = ..., memory_bytes: _Optional[int] = ..., memory_reserve: _Optional[int] = ...) -> None: ...

class AdoptRequest(_message.Message):
    __slots__ = ("tenant", "weight", "priority", "cgroup", "engines", "gpus", "labels", "memory_bytes", "memory_reserve")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CGROUP_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RESERVE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: int
    priority: Priority
    cgroup: str
    engines: _containers.RepeatedScalarFieldContainer[str]
    gpus: _containers.RepeatedScalarFieldContainer[int]
    labels: _containers.ScalarMap[str, str]
    memory_bytes: int
    memory_reserve: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[int] = ..., priority: _Optional[_Union[Priority, str]] = ..., cgroup: _Optional[str] = ..., engines: _Optional[_Iterable[str]] = ..., gpus: _Optional[_Iterable[int]] = ..., labels: _Optional[_Mapping[str, str]] = ..., memory_bytes: _Optional[int] = ..., memory_reserve: _Optional[int] = ...) -> None: ...

class SetWeightRequest(_message.Message):
    __slots__ = ("tenant", "weight")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[int] = ...) -> None: ...

class RemoveTenantRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantsReply(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[Tenant]
    def __init__(self, tenants: _Optional[_Iterable[_Union[Tenant, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "name", "contention", "sm_util", "dec_util", "enc_util", "memory_used", "memory_total", "mix")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENTION_FIELD_NUMBER: _ClassVar[int]
    SM_UTIL_FIELD_NUMBER: _ClassVar[int]
    DEC_UTIL_FIELD_NUMBER: _ClassVar[int]
    ENC_UTIL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MIX_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    contention: str
    sm_util: float
    dec_util: float
    enc_util: float
    memory_used: int
    memory_total: int
    mix: MixedSlices
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., contention: _Optional[str] = ..., sm_util: _Optional[float] = ..., dec_util: _Optional[float] = ..., enc_util: _Optional[float] = ..., memory_used: _Optional[int] = ..., memory_total: _Optional[int] = ..., mix: _Optional[_Union[MixedSlices, _Mapping]] = ...) -> None: ...

class MixedSlices(_message.Message):
    __slots__ = ("together", "compute_alone", "graphics_alone", "now")
    TOGETHER_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_ALONE_FIELD_NUMBER: _ClassVar[int]
    GRAPHICS_ALONE_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    together: float
    compute_alone: float
    graphics_alone: float
    now: str
    def __init__(self, together: _Optional[float] = ..., compute_alone: _Optional[float] = ..., graphics_alone: _Optional[float] = ..., now: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "mode", "slice_ms", "cgroup_driver", "cgroup_root", "nvml", "gpus", "tenants", "uptime_s", "caller_pid", "caller_uid", "caller_is_admin", "caller_tenant", "agent_socket", "session_hooks", "device_admission", "mps", "mps_pipe_dir", "runtime_agent_socket")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SLICE_MS_FIELD_NUMBER: _ClassVar[int]
    CGROUP_DRIVER_FIELD_NUMBER: _ClassVar[int]
    CGROUP_ROOT_FIELD_NUMBER: _ClassVar[int]
    NVML_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    CALLER_PID_FIELD_NUMBER: _ClassVar[int]
    CALLER_UID_FIELD_NUMBER: _ClassVar[int]
    CALLER_IS_ADMIN_FIELD_NUMBER: _ClassVar[int]
    CALLER_TENANT_FIELD_NUMBER: _ClassVar[int]
    AGENT_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SESSION_HOOKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ADMISSION_FIELD_NUMBER: _ClassVar[int]
    MPS_FIELD_NUMBER: _ClassVar[int]
    MPS_PIPE_DIR_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_AGENT_SOCKET_FIELD_NUMBER: _ClassVar[int]
    version: str
    mode: str
    slice_ms: float
    cgroup_driver: str
    cgroup_root: str
    nvml: bool
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    tenants: int
    uptime_s: float
    caller_pid: int
    caller_uid: int
    caller_is_admin: bool
    caller_tenant: str
    agent_socket: str
    session_hooks: str
    device_admission: str
    mps: str
    mps_pipe_dir: str
    runtime_agent_socket: str
    def __init__(self, version: _Optional[str] = ..., mode: _Optional[str] = ..., slice_ms: _Optional[float] = ..., cgroup_driver: _Optional[str] = ..., cgroup_root: _Optional[str] = ..., nvml: _Optional[bool] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., tenants: _Optional[int] = ..., uptime_s: _Optional[float] = ..., caller_pid: _Optional[int] = ..., caller_uid: _Optional[int] = ..., caller_is_admin: _Optional[bool] = ..., caller_tenant: _Optional[str] = ..., agent_socket: _Optional[str] = ..., session_hooks: _Optional[str] = ..., device_admission: _Optional[str] = ..., mps: _Optional[str] = ..., mps_pipe_dir: _Optional[str] = ..., runtime_agent_socket: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaseHello(_message.Message):
    __slots__ = ("tenant", "weight", "priority", "engines", "gpu")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: int
    priority: Priority
    engines: _containers.RepeatedScalarFieldContainer[str]
    gpu: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[int] = ..., priority: _Optional[_Union[Priority, str]] = ..., engines: _Optional[_Iterable[str]] = ..., gpu: _Optional[int] = ...) -> None: ...

class LeaseWant(_message.Message):
    __slots__ = ("engine",)
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    engine: str
    def __init__(self, engine: _Optional[str] = ...) -> None: ...

class LeaseReport(_message.Message):
    __slots__ = ("engine", "gpu_seconds", "release", "yielded", "units", "ended_ago_s")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    YIELDED_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    ENDED_AGO_S_FIELD_NUMBER: _ClassVar[int]
    engine: str
    gpu_seconds: float
    release: bool
    yielded: bool
    units: int
    ended_ago_s: float
    def __init__(self, engine: _Optional[str] = ..., gpu_seconds: _Optional[float] = ..., release: _Optional[bool] = ..., yielded: _Optional[bool] = ..., units: _Optional[int] = ..., ended_ago_s: _Optional[float] = ...) -> None: ...

class CodecSession(_message.Message):
    __slots__ = ("kind", "open")
    KIND_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    kind: str
    open: bool
    def __init__(self, kind: _Optional[str] = ..., open: _Optional[bool] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("hello", "want", "report", "session", "seq")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    hello: LeaseHello
    want: LeaseWant
    report: LeaseReport
    session: CodecSession
    seq: int
    def __init__(self, hello: _Optional[_Union[LeaseHello, _Mapping]] = ..., want: _Optional[_Union[LeaseWant, _Mapping]] = ..., report: _Optional[_Union[LeaseReport, _Mapping]] = ..., session: _Optional[_Union[CodecSession, _Mapping]] = ..., seq: _Optional[int] = ...) -> None: ...

class LeaseWelcome(_message.Message):
    __slots__ = ("tenant", "session", "slice_s", "valid_s")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SLICE_S_FIELD_NUMBER: _ClassVar[int]
    VALID_S_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    session: int
    slice_s: float
    valid_s: float
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ..., session: _Optional[int] = ..., slice_s: _Optional[float] = ..., valid_s: _Optional[float] = ...) -> None: ...

class LeaseGrant(_message.Message):
    __slots__ = ("lease", "engine", "valid_s", "contended", "slice_left_s", "jump")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    VALID_S_FIELD_NUMBER: _ClassVar[int]
    CONTENDED_FIELD_NUMBER: _ClassVar[int]
    SLICE_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    JUMP_FIELD_NUMBER: _ClassVar[int]
    lease: int
    engine: str
    valid_s: float
    contended: bool
    slice_left_s: float
    jump: bool
    def __init__(self, lease: _Optional[int] = ..., engine: _Optional[str] = ..., valid_s: _Optional[float] = ..., contended: _Optional[bool] = ..., slice_left_s: _Optional[float] = ..., jump: _Optional[bool] = ...) -> None: ...

class LeaseRevoke(_message.Message):
    __slots__ = ("lease", "engine", "reason")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease: int
    engine: str
    reason: str
    def __init__(self, lease: _Optional[int] = ..., engine: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaseAck(_message.Message):
    __slots__ = ("engine", "held", "lease", "admitted", "reason")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    engine: str
    held: bool
    lease: int
    admitted: bool
    reason: str
    def __init__(self, engine: _Optional[str] = ..., held: _Optional[bool] = ..., lease: _Optional[int] = ..., admitted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaseError(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: str
    details: str
    def __init__(self, code: _Optional[str] = ..., details: _Optional[str] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("welcome", "grant", "revoke", "ack", "error", "seq")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    REVOKE_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    welcome: LeaseWelcome
    grant: LeaseGrant
    revoke: LeaseRevoke
    ack: LeaseAck
    error: LeaseError
    seq: int
    def __init__(self, welcome: _Optional[_Union[LeaseWelcome, _Mapping]] = ..., grant: _Optional[_Union[LeaseGrant, _Mapping]] = ..., revoke: _Optional[_Union[LeaseRevoke, _Mapping]] = ..., ack: _Optional[_Union[LeaseAck, _Mapping]] = ..., error: _Optional[_Union[LeaseError, _Mapping]] = ..., seq: _Optional[int] = ...) -> None: ...
