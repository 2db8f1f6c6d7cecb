"""`bench peers` runs each peer in a process of its own: a peer library that crashes its process (a llama.cpp
build using instructions the machine refuses dies of SIGILL) leaves the peer reported as unavailable with
how its process ended, while a peer's result, or its own Python error, comes back as before. Real spawned
processes; the peers here are small functions standing in for the libraries."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import pytest

from bench.peers import in_own_process

# as the command line gives them: with its handler, a function the spawned process could not import
ARGS = argparse.Namespace(threads=1, func=lambda args: None)


def _answers(gguf: Path, args: argparse.Namespace) -> dict:
    return {"available": True, "gguf": gguf.name, "pid": os.getpid()}


def _dies_of_sigill(gguf: Path, args: argparse.Namespace) -> dict:
    os.kill(os.getpid(), signal.SIGILL)
    raise AssertionError("unreachable")


def _raises(gguf: Path, args: argparse.Namespace) -> dict:
    raise ValueError("the peer's own error")


def test_a_peer_answers_from_a_process_of_its_own() -> None:
    result = in_own_process("fine", _answers, Path("/models/x.gguf"), ARGS)
    assert result["available"] and result["gguf"] == "x.gguf"
    assert result["pid"] != os.getpid()


def test_a_peer_whose_process_dies_of_sigill_is_unavailable_with_the_signal_named() -> None:
    result = in_own_process("llama.cpp", _dies_of_sigill, Path("x.gguf"), ARGS)
    assert result == {
        "available": False,
        "reason": "llama.cpp's process was killed by SIGILL before reporting",
    }


def test_a_peer_s_own_error_still_fails_the_bench() -> None:
    with pytest.raises(ValueError, match="the peer's own error"):
        in_own_process("broken", _raises, Path("x.gguf"), ARGS)
