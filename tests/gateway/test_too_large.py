"""A request larger than the deployment holds, through the whole path: the prefill set refuses the prompt
(RESOURCE_EXHAUSTED naming both numbers), decode passes the refusal on, and the gateway answers a 400 with
OpenAI's code for it, not a 429 that clients retry."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.helpers import RunningStack, start_stack

# Each prefill rank holds this many tokens: below the tiny model's 4,096-token context.
KV_CACHE_TOKENS = 512


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[RunningStack]:
    running = start_stack(
        tmp_path_factory.mktemp("too-large"),
        pcp=1,
        decode=1,
        model="tiny",
        prefill_kv_cache_tokens=KV_CACHE_TOKENS,
        gateway=True,
    )
    yield running
    running.stop()


def _post(stack: RunningStack, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{stack.stack.gateway_url}/v1/completions",
        data=json.dumps({"model": "tiny", **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_prompt_over_the_prefill_sets_capacity_is_a_400_naming_the_prompt(stack) -> None:
    status, answer = _post(stack, {"prompt": [1 + i % 250 for i in range(900)], "max_tokens": 2})
    assert status == 400, answer
    error = answer["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert f"900 tokens exceeds this prefill set's KV capacity of {KV_CACHE_TOKENS}" in error["message"]
    # The set serves the next request.
    status, answer = _post(stack, {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


def test_a_max_tokens_the_context_cannot_hold_is_refused_by_name_before_any_prefill(stack) -> None:
    # 4,090 prompt tokens leave 6 of the tiny model's 4,096: decode refuses the client's 16 itself (a
    # default would be cut to 6 instead: tests/decode/test_pipeline.py), before the set sees the prompt.
    status, answer = _post(stack, {"prompt": [1 + i % 250 for i in range(4090)], "max_tokens": 16})
    assert status == 400, answer
    assert answer["error"]["param"] == "max_tokens"
    assert "sampling.max_tokens=16 with 4090 prompt tokens exceeds" in answer["error"]["message"]
