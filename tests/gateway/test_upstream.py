"""The choice of a decode worker: least loaded among the healthy ones, least recently used among equals."""

from __future__ import annotations

import pytest

from pcpstack.gateway.upstream import Candidate, least_loaded


def _worker(address: str, in_flight: int = 0, load: int = 0, unhealthy: bool = False, used: int = 0):
    return Candidate(address, in_flight, load, unhealthy, used)


def test_the_worker_with_the_fewest_calls_in_flight_and_registry_load_is_chosen() -> None:
    workers = [_worker("a", in_flight=2), _worker("b", in_flight=1, load=2), _worker("c", load=1)]
    assert least_loaded(workers).address == "c"


def test_among_equally_loaded_workers_the_least_recently_used_is_chosen() -> None:
    workers = [_worker("a", used=5), _worker("b", used=3), _worker("c", used=9)]
    assert least_loaded(workers).address == "b"


def test_an_unhealthy_worker_is_chosen_only_when_no_healthy_one_is_left() -> None:
    assert least_loaded([_worker("a", unhealthy=True), _worker("b", in_flight=7)]).address == "b"
    assert least_loaded([_worker("a", unhealthy=True)]).address == "a"


def test_no_candidate_is_an_error() -> None:
    with pytest.raises(ValueError):
        least_loaded([])
