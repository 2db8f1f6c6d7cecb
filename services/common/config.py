"""Typed engine configuration read from the seed-style JSON, with the configuration rules enforced
(docs/architecture.md, "The registry").

A config file looks like the seed orchestrator's:

    {"motor_engine_prefill_config": {"engine_type": "vllm", "engine_config": {
        "model": "...", "tensor_parallel_size": 1, "data_parallel_size": 2,
        "prefill-context-parallel-size": 2, "cp-kv-cache-interleave-size": 128,
        "nnodes": 2, "master-port": 7001}}}

engine_config keys may use hyphens or underscores. Command-line overrides (`key=value`) are applied on
top. Every rule violation raises ConfigError naming the keys, their values and the rule, so a user knows
what to change. The `check_*` functions state the rules the services' own configs share (ports, addresses,
durations, model sources), so every service words them the same way.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from pcpstack.common.errors import FailedPrecondition
from pcpstack.common.models import resolve_model
from pcpstack.v1 import common_pb2

# The device kinds a node may run its model on (engine.device picks one; listed here so that checking a
# config needs no torch).
DEVICE_KINDS = ("cpu", "cuda", "npu")

ROLE_SECTIONS = {
    "prefill": "motor_engine_prefill_config",
    "decode": "motor_engine_decode_config",
}
DEFAULT_BLOCK_SIZE = 128
DEFAULT_MASTER_PORT = 7001
MAX_UINT32 = 2**32 - 1  # the largest value of a uint32 field (a lease in ms, a token count)
# Largest parallel size or block size, and most ranks one set may have (PCP x TP): far past any cluster,
# small enough that a registry can list a set's ranks
MAX_SIZE = 4096
MAX_SET_RANKS = 4096
TRANSFER_MODES = ("whole", "layerwise")
# PCPSTACK_CPU_KERNELS, read by engine/cpu_kernels.py; named here so that a node refuses a bad value at
# start-up, before it imports torch or starts a rank process that would read it.
CPU_KERNELS_ENV = "PCPSTACK_CPU_KERNELS"
# How much faster than torch's dense matmul the C kernels must be to be used (default 1.0: not slower).
KERNEL_MIN_SPEEDUP_ENV = "PCPSTACK_KERNEL_MIN_SPEEDUP"
CPU_KERNELS_CHOICES = {
    "": "use the CPU kernels where they beat plain PyTorch",
    "0": "never use them",
    "1": "use them without the speed check",
}
# PCPSTACK_DENSE_MATMUL, read by engine/dense.py: which library runs the fp32 dense matmuls of prefill.
DENSE_MATMUL_ENV = "PCPSTACK_DENSE_MATMUL"
DENSE_MATMUL_CHOICES = {
    "": "the faster of torch's and oneDNN's on this CPU",
    "torch": "always torch's own (MKL's sgemm)",
    "onednn": "always oneDNN's",
}
# PCPSTACK_COPY_CRC, read by kvstore/copy_crc.py wherever KV is copied (the store, prefill, decode):
# refused at their start-up rather than at the first copy.
COPY_CRC_ENV = "PCPSTACK_COPY_CRC"
COPY_CRC_CHOICES = {
    "": "use the fused copy and CRC where it builds",
    "0": "never build it",
    "1": "require it",
}


class ConfigError(FailedPrecondition, ValueError):
    """A configuration that breaks a rule. `keys` are the offending keys, `rule` the rule's statement.

    A FailedPrecondition: a node whose config breaks a rule cannot be served as configured (the registry
    refuses its registration with that status); a ValueError too, for callers that catch bad values.
    """

    def __init__(self, message: str, keys: tuple[str, ...] = (), rule: str = "") -> None:
        super().__init__(message)
        self.keys = keys
        self.rule = rule

    @classmethod
    def broken(cls, key: str, value: object, rule: str) -> ConfigError:
        """The error for one key: the message reads `key=value: rule`."""
        return cls(f"{key}={value!r}: {rule}", (key,), rule)


def unbindable(flag: str, address: str, exc: BaseException) -> ConfigError:
    """The start-up error for a listening address that cannot be bound (flag: the flag that set it)."""
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return ConfigError.broken(
        flag,
        address,
        f"cannot be bound ({reason}): another process holds the port, or the host is not an address of "
        "this machine",
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def check_port(key: str, value: object, allow_zero: bool = True) -> None:
    """A TCP port to bind: 1..65535, or 0 (any free port) when allow_zero."""
    low = 0 if allow_zero else 1
    if not _is_int(value) or not low <= value <= 65535:
        raise ConfigError.broken(key, value, f"must be a TCP port in {low}..65535")


def check_positive(key: str, value: object) -> None:
    """A size, count or duration that must be > 0."""
    if not _is_number(value) or value <= 0:
        raise ConfigError.broken(key, value, "must be > 0")


def check_non_negative(key: str, value: object, meaning_of_zero: str = "") -> None:
    """A size, count or duration that must be >= 0 (0 often means "the default"; say so)."""
    if not _is_number(value) or value < 0:
        zero = f" ({meaning_of_zero})" if meaning_of_zero else ""
        raise ConfigError.broken(key, value, f"must be >= 0{zero}")


def env_choice(name: str, meanings: dict[str, str]) -> str:
    """Environment variable `name` (stripped, lower-cased), one of `meanings`' keys ("" for unset); a
    ConfigError naming the variable, its value and the values it takes otherwise."""
    value = os.environ.get(name, "").strip().lower()
    if value not in meanings:
        takes = ", ".join(f"{choice or 'unset'} ({meaning})" for choice, meaning in meanings.items())
        raise ConfigError.broken(name, os.environ[name], f"must be one of: {takes}")
    return value


def env_positive_float(name: str, default: float) -> float:
    """Environment variable `name` as a finite number > 0 (default when unset or empty); a ConfigError
    naming the variable otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError.broken(name, os.environ[name], "must be a number > 0")
    return value


def check_address(key: str, value: str, required: bool = False) -> None:
    """A peer to dial, HOST:PORT with a port in 1..65535 (an IPv6 host in brackets: [::1]:7000); empty is
    allowed unless required."""
    if not value:
        if required:
            raise ConfigError.broken(key, value, "is required (HOST:PORT)")
        return
    problem = _address_problem(value)
    if problem:
        raise ConfigError.broken(key, value, problem)


def check_addresses(key: str, value: str, required: bool = False) -> None:
    """One peer or several (registry replicas): HOST:PORT[,HOST:PORT...], each checked as check_address."""
    if not value:
        check_address(key, value, required)
        return
    for address in value.split(","):
        problem = _address_problem(address.strip())
        if problem:
            raise ConfigError.broken(key, value, f"address {address.strip()!r} {problem}")


def _address_problem(address: str) -> str:
    """What is wrong with a HOST:PORT to dial ("" for nothing)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "must be HOST:PORT with a port in 1..65535"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        # "::1:7000" reads as an address of its own, not ::1 and a port
        return "must put an IPv6 host in brackets: [::1]:PORT"
    if any(char.isspace() for char in host) or not host.isprintable():
        return "must have a host without spaces or control characters"
    return ""


def join_host_port(host: str, port: int) -> str:
    """HOST:PORT as gRPC and URLs write it: an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_wildcard(host: str) -> bool:
    """True for a bind-to-every-interface host (0.0.0.0, ::), which no peer can dial."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def check_dialable_host(key: str, host: str) -> None:
    """A host others dial this node at (--advertise, or the bound --host without it): not a wildcard,
    without spaces; ConfigError naming key otherwise."""
    if is_wildcard(host):
        raise ConfigError.broken(key, host, "is no address others can dial: give --advertise HOST")
    if not host or any(char.isspace() for char in host) or not host.isprintable():
        raise ConfigError.broken(key, host, "must be a host name or IP without spaces")


HOST_ID_MAX_CHARS = 253  # a DNS name's longest


def check_host_id(key: str, value: str) -> None:
    """A machine's name for routers to compare (--host-id): empty (the advertised address's host), or up
    to HOST_ID_MAX_CHARS printable characters without spaces."""
    spaced = any(c.isspace() for c in value)
    if value and (len(value) > HOST_ID_MAX_CHARS or not value.isprintable() or spaced):
        raise ConfigError.broken(
            key, value, f"must be at most {HOST_ID_MAX_CHARS} printable characters without spaces"
        )


NODE_ID_CHARS = "ASCII letters, digits, '.', '_', '-' and ':'"


def check_node_id(key: str, value: str) -> None:
    """A node's stable identity (--node-id, a Register's node_id): empty (the default, hostname-ROLE-port)
    or NODE_ID_CHARS only. Hostnames, pod and compose service names fit; '/' would let one id's etcd
    mailbox prefix cover another's, and spaces or control characters do not belong in keys or logs."""
    if value and not (value.isascii() and all(c.isalnum() or c in "._-:" for c in value)):
        raise ConfigError.broken(key, value, f"may hold only {NODE_ID_CHARS}")


def check_model_source(key: str, model: str) -> None:
    """A model a node can load: empty (the embedded default), 'tiny', a .gguf file, a model folder or a
    Hugging Face repo id in the local cache (common/models.py).

    Checked before anything is loaded, so a mistyped path is refused at once and not after a slow import.
    """
    try:
        resolve_model(model)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError.broken(key, model, str(exc)) from None


def _key(name: str) -> str:
    return name.strip().replace("-", "_")


@dataclass(frozen=True)
class EngineConfig:
    """The engine configuration of one node, validated when built (sizes are >= 1, and the configuration
    rules hold between them); an instance that exists is a valid one."""

    role: str = "prefill"
    engine_type: str = "pcpstack"
    model: str = ""
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = DEFAULT_BLOCK_SIZE
    nnodes: int = 1
    master_port: int = DEFAULT_MASTER_PORT
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_transfer_mode: str = "whole"
    # KV heads of the model, for the DCP rule of GQA models: set by with_model_shape once the model is
    # read, never by a config (0 = not known yet; the rule waits for it).
    num_kv_heads: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def pcp_size(self) -> int:
        """Global PCP degree of one set."""
        return self.prefill_context_parallel_size

    @property
    def pcp_ranks_per_node(self) -> int:
        """PCP ranks each node of a set contributes."""
        return self.prefill_context_parallel_size // self.nnodes

    @property
    def world_size(self) -> int:
        """Ranks of one set: tp x pcp."""
        return self.tensor_parallel_size * self.prefill_context_parallel_size

    @property
    def nodes_required(self) -> int:
        """Prefill nodes the registry waits for before assembling: dp x nnodes."""
        return self.data_parallel_size * self.nnodes

    def validate(self) -> EngineConfig:
        """Raises ConfigError on the first rule this config breaks; returns self otherwise."""
        if self.role not in ("prefill", "decode"):
            raise ConfigError(f"role={self.role!r} is not one of prefill, decode", ("role",), "known role")
        for name in (
            "tensor_parallel_size",
            "data_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
            "nnodes",
            "block_size",
            "cp_kv_cache_interleave_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1", (name,), "sizes are >= 1")
            if value > MAX_SIZE:
                # a registry builds a set's rank lists from these: an absurd size must not take its memory
                raise ConfigError(
                    f"{name}={value} must be at most {MAX_SIZE}", (name,), f"sizes are <= {MAX_SIZE}"
                )
        if not 0 < self.master_port < 65536:
            raise ConfigError(
                f"master_port={self.master_port} must be a TCP port in 1..65535",
                ("master_port",),
                "valid port",
            )
        if self.role == "decode" and self.master_port != DEFAULT_MASTER_PORT:
            raise _decode_master_port(self.master_port)
        if self.kv_transfer_mode not in TRANSFER_MODES:
            raise ConfigError(
                f"kv_transfer_mode={self.kv_transfer_mode!r} is not one of {', '.join(TRANSFER_MODES)}",
                ("kv_transfer_mode",),
                "known transfer mode",
            )
        pcp, dcp, tp = (
            self.prefill_context_parallel_size,
            self.decode_context_parallel_size,
            self.tensor_parallel_size,
        )
        if pcp * tp > MAX_SET_RANKS:
            raise ConfigError(
                f"prefill_context_parallel_size={pcp} x tensor_parallel_size={tp} = {pcp * tp} ranks: a set "
                f"has at most {MAX_SET_RANKS}",
                ("prefill_context_parallel_size", "tensor_parallel_size"),
                f"pcp x tp <= {MAX_SET_RANKS}",
            )
        if pcp > 1 and dcp > 1:
            raise ConfigError(
                f"prefill_context_parallel_size={pcp} and decode_context_parallel_size={dcp}: PCP and DCP "
                "cannot both be > 1; set one of them to 1",
                ("prefill_context_parallel_size", "decode_context_parallel_size"),
                "PCP and DCP cannot both be > 1",
            )
        if self.role == "decode" and pcp != 1:
            raise ConfigError(
                f"prefill_context_parallel_size={pcp} on a decode instance: a decode (KV consumer) instance "
                "must have prefill_context_parallel_size == 1",
                ("prefill_context_parallel_size",),
                "decode requires PCP == 1",
            )
        if self.cp_kv_cache_interleave_size != self.block_size:
            raise ConfigError(
                f"cp_kv_cache_interleave_size={self.cp_kv_cache_interleave_size} but block_size="
                f"{self.block_size}: when KV is transferred, cp_kv_cache_interleave_size must equal the KV "
                "block_size",
                ("cp_kv_cache_interleave_size", "block_size"),
                "interleave size == block size",
            )
        if dcp > 1:
            if tp % dcp != 0 or tp < dcp:
                raise ConfigError(
                    f"tensor_parallel_size={tp}, decode_context_parallel_size={dcp}: DCP needs "
                    "tp % dcp == 0 and tp >= dcp",
                    ("tensor_parallel_size", "decode_context_parallel_size"),
                    "tp % dcp == 0 and tp >= dcp",
                )
            if self.num_kv_heads > 0:
                per_head = tp // self.num_kv_heads
                if per_head < dcp or per_head % dcp != 0:
                    raise ConfigError(
                        f"tensor_parallel_size={tp}, num_kv_heads={self.num_kv_heads}, "
                        f"decode_context_parallel_size={dcp}: for GQA models (tp // num_kv_heads)={per_head} "
                        "must be >= dcp and divisible by dcp",
                        ("tensor_parallel_size", "num_kv_heads", "decode_context_parallel_size"),
                        "(tp // num_kv_heads) >= dcp and (tp // num_kv_heads) % dcp == 0",
                    )
        if pcp % self.nnodes != 0:
            raise ConfigError(
                f"prefill_context_parallel_size={pcp} is not divisible by nnodes={self.nnodes}: every node "
                "of a set must contribute the same number of PCP ranks",
                ("prefill_context_parallel_size", "nnodes"),
                "pcp % nnodes == 0",
            )
        if self.kv_transfer_mode == "layerwise" and pcp > 1:
            raise ConfigError(
                f"kv_transfer_mode='layerwise' with prefill_context_parallel_size={pcp}: layerwise KV "
                "transfer is incompatible with PCP (its block split does not match CP); use 'whole'",
                ("kv_transfer_mode", "prefill_context_parallel_size"),
                "no layerwise transfer with PCP",
            )
        return self

    # --- conversions -------------------------------------------------------------------------------

    @classmethod
    def from_mapping(
        cls, engine_config: dict[str, Any], role: str, engine_type: str = "pcpstack"
    ) -> EngineConfig:
        """Builds from an engine_config mapping (hyphen or underscore keys); unknown keys are refused, and
        so is master_port on a decode instance."""
        values: dict[str, Any] = {}
        for raw_key, value in engine_config.items():
            key = _key(raw_key)
            if key not in settable_keys():
                raise _unknown_key("engine_config", raw_key)
            if key in values:
                raise ConfigError(
                    f"engine_config key {raw_key!r} is given twice", (raw_key,), "no duplicates"
                )
            values[key] = value
        if "cp_kv_cache_interleave_size" not in values and "block_size" in values:
            values["cp_kv_cache_interleave_size"] = values["block_size"]
        if "block_size" not in values and "cp_kv_cache_interleave_size" in values:
            values["block_size"] = values["cp_kv_cache_interleave_size"]
        for key, value in values.items():
            expected = type(getattr(cls(), key))
            if expected is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
                values[key] = int(value)
            elif not isinstance(values[key], expected) or isinstance(values[key], bool):
                raise ConfigError(
                    f"engine_config {key}={value!r} must be of type {expected.__name__}",
                    (key,),
                    "typed values",
                )
        if role == "decode" and "master_port" in values:
            raise _decode_master_port(values["master_port"])
        return cls(role=role, engine_type=engine_type, **values).validate()

    def with_overrides(self, overrides: dict[str, Any]) -> EngineConfig:
        """A copy with `key=value` overrides applied (hyphen or underscore keys), validated."""
        # A decode config's master_port is always the default: left out, so only an override names it.
        unset = {"master_port"} if self.role == "decode" else set()
        merged = {k: v for k, v in asdict(self).items() if k in settable_keys() - unset}
        for raw_key, value in overrides.items():
            key = _key(raw_key)
            if key not in settable_keys():
                raise _unknown_key("override", raw_key)
            merged[key] = value
        config = EngineConfig.from_mapping(merged, role=self.role, engine_type=self.engine_type)
        return config.with_model_shape(self.num_kv_heads) if self.num_kv_heads else config

    def to_proto(self) -> common_pb2.EngineConfig:
        """The wire form sent to the registry."""
        return common_pb2.EngineConfig(
            engine_type=self.engine_type,
            model=self.model,
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            prefill_context_parallel_size=self.prefill_context_parallel_size,
            decode_context_parallel_size=self.decode_context_parallel_size,
            cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size,
            nnodes=self.nnodes,
            master_port=self.master_port,
            block_size=self.block_size,
            kv_transfer_mode=(
                common_pb2.KV_TRANSFER_MODE_LAYERWISE
                if self.kv_transfer_mode == "layerwise"
                else common_pb2.KV_TRANSFER_MODE_WHOLE
            ),
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.EngineConfig, role: str, num_kv_heads: int = 0) -> EngineConfig:
        """Reads the wire form (0 means default for every size) and validates it."""
        block = msg.block_size or DEFAULT_BLOCK_SIZE
        config = cls(
            role=role,
            engine_type=msg.engine_type or "pcpstack",
            model=msg.model,
            tensor_parallel_size=msg.tensor_parallel_size or 1,
            data_parallel_size=msg.data_parallel_size or 1,
            prefill_context_parallel_size=msg.prefill_context_parallel_size or 1,
            decode_context_parallel_size=msg.decode_context_parallel_size or 1,
            cp_kv_cache_interleave_size=msg.cp_kv_cache_interleave_size or block,
            nnodes=msg.nnodes or 1,
            master_port=msg.master_port or DEFAULT_MASTER_PORT,
            block_size=block,
            kv_transfer_mode=_transfer_mode_of(msg.kv_transfer_mode),
            num_kv_heads=num_kv_heads,
        )
        return config.validate()

    def with_model_shape(self, num_kv_heads: int) -> EngineConfig:
        """Re-validates once the model's KV head count is known (the GQA DCP rule needs it)."""
        return replace(self, num_kv_heads=num_kv_heads).validate()


def _transfer_mode_of(value: int) -> str:
    """The transfer mode a wire enum value names; ConfigError for a value this version does not know (a
    newer peer's mode must not be served as another)."""
    modes = {
        common_pb2.KV_TRANSFER_MODE_UNSPECIFIED: "whole",
        common_pb2.KV_TRANSFER_MODE_WHOLE: "whole",
        common_pb2.KV_TRANSFER_MODE_LAYERWISE: "layerwise",
    }
    if value not in modes:
        raise ConfigError(
            f"kv_transfer_mode={value} is not a known KvTransferMode (0, 1 or 2)",
            ("kv_transfer_mode",),
            "known transfer mode",
        )
    return modes[value]


def settable_keys() -> set[str]:
    """The engine_config keys a config file or an override may set."""
    return {f.name for f in fields(EngineConfig)} - {"role", "engine_type", "num_kv_heads"}


def _unknown_key(where: str, raw_key: str) -> ConfigError:
    """The error for a key no config may set (`where`: engine_config or override)."""
    # num_kv_heads is a field, but the model's, not the user's: say where it comes from.
    model_note = "the model's own config decides its K/V heads; " if _key(raw_key) == "num_kv_heads" else ""
    known = ", ".join(sorted(settable_keys()))
    return ConfigError(
        f"unknown {where} key {raw_key!r}; {model_note}known keys: {known}", (raw_key,), "known keys only"
    )


def _decode_master_port(value: object) -> ConfigError:
    """The error for a master port on a decode instance, which has no use for one."""
    return ConfigError(
        f"master_port={value!r} on a decode instance: master_port is where a prefill set's ranks meet; a "
        "decode worker's TP ranks all run on its own host and meet at a free port it picks itself, so "
        "remove master_port from motor_engine_decode_config and its overrides",
        ("master_port",),
        "no master_port on a decode instance",
    )


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """Parses `key=value` strings; values are JSON when they parse as JSON, strings otherwise."""
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {pair!r} is not of the form key=value", (pair,), "key=value")
        try:
            overrides[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key.strip()] = raw
    return overrides


# The keys a role section may hold.
SECTION_KEYS = ("engine_type", "engine_config")


def load_configs(
    document: dict[str, Any], overrides: dict[str, Any] | None = None
) -> dict[str, EngineConfig]:
    """Reads every role section of a seed-style document into a validated EngineConfig per role."""
    if not isinstance(document, dict):
        raise ConfigError("the config file must hold a JSON object", (), "JSON object")
    unknown = set(document) - set(ROLE_SECTIONS.values())
    if unknown:
        raise ConfigError(
            f"unknown top-level keys {sorted(unknown)}; expected {sorted(ROLE_SECTIONS.values())}",
            tuple(sorted(unknown)),
            "known sections only",
        )
    configs = {}
    for role, section_key in ROLE_SECTIONS.items():
        if section_key not in document:
            continue
        section = document[section_key]
        if not isinstance(section, dict) or not isinstance(section.get("engine_config", {}), dict):
            raise ConfigError(
                f"{section_key} must be an object with an engine_config object", (section_key,), "shape"
            )
        stray = sorted(set(section) - set(SECTION_KEYS))
        if stray:  # a misspelt engine_config would otherwise leave every setting at its default, silently
            raise ConfigError(
                f"unknown keys {stray} in {section_key}; expected {list(SECTION_KEYS)}",
                (section_key, stray[0]),
                "known keys only",
            )
        if not isinstance(section.get("engine_type", ""), str):
            raise ConfigError(
                f"{section_key}.engine_type={section['engine_type']!r} must be a string",
                (section_key, "engine_type"),
                "string",
            )
        config = EngineConfig.from_mapping(
            section.get("engine_config", {}), role=role, engine_type=section.get("engine_type", "pcpstack")
        )
        configs[role] = config.with_overrides(overrides) if overrides else config
    if not configs:
        raise ConfigError(
            f"no engine section found; expected one of {sorted(ROLE_SECTIONS.values())}",
            tuple(ROLE_SECTIONS.values()),
            "at least one section",
        )
    return configs


def load_config_file(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, EngineConfig]:
    """Reads a seed-style JSON file; see load_configs."""
    try:
        document = json.loads(Path(path).read_text(), object_pairs_hook=_no_repeated_keys)
    except OSError as exc:
        raise ConfigError.broken("config", str(path), f"cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError.broken("config", str(path), f"must hold valid JSON ({exc})") from None
    except RecursionError:
        raise ConfigError.broken("config", str(path), "nests too deeply to be a configuration") from None
    except _RepeatedKey as exc:
        rule = f"gives {exc.key!r} twice in one object (JSON would keep only the last)"
        raise ConfigError.broken("config", str(path), rule) from None
    return load_configs(document, overrides)


class _RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict, refusing a key given twice (json keeps the last one without a word)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen[key] = value
    return seen


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_model_name(model: str | None) -> str:
    """The name clients use for a model: the embedded default's name, 'tiny', or the file or folder name."""
    if not model:
        return DEFAULT_MODEL_NAME
    return model if model == "tiny" else Path(model).stem


def role_config(
    role: str, config_file: str | None, overrides: dict[str, Any], model: str | None = None
) -> EngineConfig:
    """A service's engine config: its role's section of config_file (or the defaults), overrides applied.

    `model`, when given, overrides the file's model (the --model flag of the service commands).
    """
    overrides = dict(overrides)
    if model is not None:
        overrides["model"] = model
    if config_file:
        # The overrides go to this role's section alone: a service's --set is not about the file's others
        # (a prefill node's master-port would be refused by the decode section).
        configs = load_config_file(config_file)
        if role not in configs:
            section = ROLE_SECTIONS[role]
            raise ConfigError(f"{config_file} has no {section} section", (section,), f"{role} section")
        return configs[role].with_overrides(overrides) if overrides else configs[role]
    base = EngineConfig(role=role)
    return base.with_overrides(overrides) if overrides else base.validate()
