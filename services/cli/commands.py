"""The user-facing commands `pcpstack up` and `pcpstack generate`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time

import grpc

from pcpstack.cli.stack import LocalStack, StackOptions
from pcpstack.decode.client import DecodeClient, build_request


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that shape a local stack."""
    parser.add_argument("--pcp", type=int, default=2, help="PCP ranks per prefill set (default 2)")
    parser.add_argument("--prefill-sets", type=int, default=1, help="number of PCP sets (default 1)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    parser.add_argument("--model", default=None, help="a .gguf file, a HF folder or 'tiny' (default SmolLM2)")
    parser.add_argument("--threads-per-rank", type=int, default=1, help="torch threads per PCP rank")
    parser.add_argument("--log-dir", default=None, help="where service logs go (default: a temp folder)")


def _stack_options(args: argparse.Namespace) -> StackOptions:
    return StackOptions(
        pcp=args.pcp,
        prefill_sets=args.prefill_sets,
        decode=args.decode,
        model=args.model,
        threads_per_rank=args.threads_per_rank,
        log_dir=args.log_dir,
    )


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pcpstack up`."""
    add_stack_arguments(parser)


def run_up(args: argparse.Namespace) -> int:
    """Starts a local stack, prints its endpoints and keeps it up until Ctrl-C."""

    async def main() -> None:
        async with LocalStack(_stack_options(args), progress=_progress) as stack:
            print(f"registry  {stack.registry_address}")
            print(f"kvstore   {stack.kvstore_address}")
            for address in stack.decode_addresses:
                print(f"decode    {address}   (pcpstack generate --target {address} 'your prompt')")
            if stack.gateway_url:
                print(f"openai    {stack.gateway_url}/v1   (OpenAI-compatible HTTP API)")
            print("press Ctrl-C to stop", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            import signal

            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            _progress("stopping...")

    asyncio.run(main())
    return 0


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pcpstack generate`."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="a decode worker HOST:PORT")
    where.add_argument("--local", action="store_true", help="start an ephemeral local stack for this request")
    add_stack_arguments(parser)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--token-ids", default=None, help="comma-separated prompt token ids instead of text")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the request may take")
    parser.add_argument("prompt", nargs="?", default="", help="the prompt text")


def _request(args: argparse.Namespace):
    if args.token_ids:
        prompt: object = [int(t) for t in args.token_ids.split(",") if t.strip()]
    elif args.chat:
        prompt = [{"role": "system", "content": args.system}] if args.system else []
        prompt.append({"role": "user", "content": args.prompt})  # type: ignore[attr-defined]
    else:
        prompt = args.prompt
    return build_request(
        prompt,  # type: ignore[arg-type]
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


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
    if not args.prompt and not args.token_ids:
        print("error: give a PROMPT or --token-ids", file=sys.stderr)
        return 2

    async def main() -> int:
        if args.target:
            return await _generate(args, args.target)
        async with LocalStack(_stack_options(args), progress=_progress) as stack:
            return await _generate(args, stack.decode_addresses[0])

    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(main())
    return 130
