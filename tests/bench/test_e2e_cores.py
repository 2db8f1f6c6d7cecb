"""bench e2e's accounting of the cores under load: CPU seconds per kind of process and the TTFT p50 floor."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from bench.e2e import _idle_s, _process_tree, _ttft_floor, _where_cores_went, add_arguments
from bench.machine import process_cpu_s


def test_scaling_seconds_must_be_finite_and_not_negative(capsys) -> None:
    parser = argparse.ArgumentParser(prog="bench e2e")
    add_arguments(parser)
    assert parser.parse_args(["--scaling-seconds", "0"]).scaling_seconds == 0.0  # 0 skips the measurement
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["--scaling-seconds", bad])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert f"--scaling-seconds: must be a finite number of seconds, 0 or more, got {bad}" in error


def test_ttft_floor_is_the_median_first_token_of_back_to_back_forwards() -> None:
    # 16 CPU-s over 4 prompts on 2 threads: 2 s a forward, first tokens at 2, 4, 6, 8 s.
    assert _ttft_floor(16.0, 4, 2) == 5.0
    assert _ttft_floor(3.0, 1, 1) == 3.0


def test_elsewhere_is_what_neither_the_stack_nor_idle_took() -> None:
    cores = len(os.sched_getaffinity(0))
    before = {"prefill": 1.0, "decode": 0.5, "idle": 10.0}
    used = _where_cores_went(before, {"prefill": 3.0, "decode": 1.5, "idle": 10.5}, 2.0)
    assert used == {"prefill": 2.0, "decode": 1.0, "idle": 0.5, "elsewhere": round(2.0 * cores - 3.5, 2)}


@pytest.mark.skipif(
    not os.path.exists("/proc/stat") or set(os.sched_getaffinity(0)) != set(range(os.cpu_count() or 0)),
    reason="reads /proc/stat; compares with the all-CPU line, so this process must run on every CPU",
)
def test_idle_seconds_are_the_cores_idle_and_iowait_time() -> None:
    with open("/proc/stat") as stat:
        fields = stat.readline().split()  # "cpu user nice system idle iowait ...": every CPU together
    tick = 1 / os.sysconf("SC_CLK_TCK")
    earlier = (int(fields[4]) + int(fields[5])) * tick
    # Read a moment later, per CPU, summed: each CPU's line rounds down to its own ticks, so the sum may
    # trail the all-CPU line by up to one tick a CPU and a field.
    slack = 2 * len(os.sched_getaffinity(0)) * tick
    assert earlier - slack <= _idle_s() <= earlier + 1.0


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_a_process_tree_and_its_cpu_are_read_from_proc() -> None:
    # A child that burns CPU under a parent that sleeps: the tree holds both, the child's seconds count.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    spawn = (
        f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {burn!r}])\ntime.sleep(30)"
    )
    parent = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            tree = _process_tree(parent.pid)
            if len(tree) == 2 and process_cpu_s(tree[1]) >= 0.3:
                break
            time.sleep(0.1)
        assert tree[0] == parent.pid and len(tree) == 2
        assert process_cpu_s(tree[1]) >= 0.3
        assert process_cpu_s(parent.pid) < 0.3
    finally:
        for pid in reversed(_process_tree(parent.pid)):
            os.kill(pid, 9)
        parent.wait()
    assert process_cpu_s(parent.pid) == 0.0  # gone
