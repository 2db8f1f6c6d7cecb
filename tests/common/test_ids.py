"""The request-id rule names the field and the limit it breaks."""

from __future__ import annotations

import pytest

from pcpstack.common.errors import InvalidArgument
from pcpstack.common.ids import MAX_REQUEST_ID_CHARS, check_request_id


def test_plain_ids_up_to_the_limit_are_accepted() -> None:
    assert check_request_id("req-1_a.B:2") == "req-1_a.B:2"
    assert check_request_id("x" * MAX_REQUEST_ID_CHARS) == "x" * MAX_REQUEST_ID_CHARS


@pytest.mark.parametrize(
    ("request_id", "message"),
    [
        ("", "must not be empty"),
        ("x" * (MAX_REQUEST_ID_CHARS + 1), f"at most {MAX_REQUEST_ID_CHARS}"),
        ("a b", "' '"),
        ("a\nb", "'\\n'"),
        ("ümlaut", "'ü'"),
    ],
)
def test_bad_ids_are_refused_naming_the_field_and_the_rule(request_id: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match="X-Request-Id") as refused:
        check_request_id(request_id, field="X-Request-Id")
    assert message in str(refused.value)
