"""How a local stack divides the host's cores between its prefill ranks and its decode ranks, and passes its
prefill flags on."""

from __future__ import annotations

import pytest

from pcpstack.cli.commands import _stack_options
from pcpstack.cli.main import build_parser, main
from pcpstack.cli.stack import LocalStack, StackOptions


def test_decode_gets_the_cores_prefill_leaves() -> None:
    plan = StackOptions(pcp=2, threads_per_rank=1).core_plan(cores=8)
    assert (plan.prefill_threads, plan.decode_threads_per_rank) == (2, 6)
    assert "share cores" not in plan.describe()


def test_decode_keeps_one_thread_and_the_plan_says_the_two_share_cores_when_prefill_takes_them_all() -> None:
    plan = StackOptions(pcp=2, decode_tp=3).core_plan(cores=2)
    assert plan.decode_threads_per_rank == 1
    assert plan.threads == 5
    assert "5 threads on 2 cores: prefill and decode share cores" in plan.describe()


def test_decode_threads_flag_overrides_the_division() -> None:
    plan = StackOptions(pcp=2, decode_threads=3).core_plan(cores=16)
    assert plan.decode_threads_per_rank == 3
    assert "from --decode-threads" in plan.describe()


def test_negative_decode_threads_is_refused_naming_the_flag(capsys) -> None:
    assert main(["generate", "--local", "--decode-threads", "-1", "hi"]) == 2
    assert "--decode-threads" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "expected"), [([], False), (["--no-prefix-cache"], True)])
def test_no_prefix_cache_reaches_the_stacks_prefill_sets(tmp_path, flags, expected) -> None:
    args = build_parser([]).parse_args(["up", "--log-dir", str(tmp_path), *flags])
    stack = LocalStack(_stack_options(args), progress=lambda line: None)
    assert ("--no-prefix-cache" in stack._prefill_cache_args()) is expected
