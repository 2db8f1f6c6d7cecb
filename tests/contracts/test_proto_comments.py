"""The protos are the documentation other teams read first: every declaration in them carries a comment."""

from __future__ import annotations

from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
_BLOCKS = ("message ", "enum ", "service ", "rpc ", "oneof ")
_FILE_OPTIONS = ("syntax", "package", "option", "import")


def uncommented_declarations(text: str) -> list[tuple[int, str]]:
    """(line number, declaration) of each message, enum, service, rpc, oneof, field or enum value in a proto
    source whose previous line is not a `//` comment."""
    lines = text.splitlines()
    missing = []
    for index, line in enumerate(lines):
        code = line.strip()
        is_declaration = code.startswith(_BLOCKS) or (
            "=" in code and code.endswith(";") and not code.startswith(_FILE_OPTIONS)
        )
        if is_declaration and (index == 0 or not lines[index - 1].strip().startswith("//")):
            missing.append((index + 1, code))
    return missing


def test_every_declaration_in_the_protos_is_commented() -> None:
    missing = [
        f"{proto.name}:{number}: {code}"
        for proto in sorted(PROTO_ROOT.rglob("*.proto"))
        for number, code in uncommented_declarations(proto.read_text())
    ]
    assert not missing, "uncommented declarations:\n" + "\n".join(missing)


def test_the_comment_check_finds_an_uncommented_field_and_enum_value() -> None:
    source = """syntax = "proto3";
package pcpstack.v1;

// A documented message.
message Documented {
  // Documented field.
  string name = 1;
  uint32 bare = 2;
}

enum Colour {
  // Documented value.
  COLOUR_UNSPECIFIED = 0;
  COLOUR_RED = 1;
}
"""
    assert uncommented_declarations(source) == [
        (8, "uint32 bare = 2;"),
        (11, "enum Colour {"),
        (14, "COLOUR_RED = 1;"),
    ]
