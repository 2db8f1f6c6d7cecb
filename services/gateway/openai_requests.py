"""OpenAI request bodies -> GenerateRequest: the request shapes as pydantic models, OpenAI and vLLM parameter
conventions, defaults and checks.

`load_body` turns the raw body into JSON values every later step can trust: valid Unicode (a lone UTF-16
surrogate such as "\\ud800" is legal JSON but cannot be encoded into a protobuf string), finite numbers, and
at most MAX_JSON_DEPTH levels of nesting (Python's JSON decoder recurses, so a deep body would exhaust the
stack). The models then check what the JSON shape and the wire form need: types (strictly: `true` is not a
number), ranges, the prompt's form, unsigned fields, top_p > 0 because the wire reads 0 as "disabled".
Every field of a body must be one the models know: a parameter this server cannot honour (tools,
response_format, ...) is refused with a 400 naming it rather than silently ignored. A validation failure
becomes an OpenAI-style 400 whose `param` is the top-level field. Value rules the engine owns (the context
length, token ids below the vocabulary size, ...) are left to the decode worker, whose message the gateway
passes on with the parameter it names; only prompt text longer than any context could hold (MAX_PROMPT_CHARS)
is refused here, before decode spends seconds tokenizing it. A message quotes only the start of a bad value.

`n` > 1 asks for independent samples: sample i is its own Generate call, and with a seed it uses seed + i,
so a request with a seed gives the same n answers each time while its samples still differ.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from pcpstack.decode.client import build_request
from pcpstack.gateway.errors import ApiError, bad_request, clipped, quoted
from pcpstack.v1 import decode_pb2

# OpenAI's default for /v1/completions.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# The gateway has no tokenizer, so "the rest of the context" (vLLM's chat default) is unknown here: a default
# (this, or completions' 16) travels with GenerateRequest.fit_max_tokens, and decode cuts it to the room the
# prompt leaves, so a default never makes a request that fits fail.
CHAT_DEFAULT_MAX_TOKENS = 256
# Prompt text longer than this is refused before it is passed on (16 Mi characters). The gateway does not
# know the served model's context; the longest the families served here offer (Llama 3.1, Qwen2.5 with
# YaRN) is 128 Ki tokens, and no token of their vocabularies stands for more than 128 bytes, so no prompt
# that fits any of them is longer. Decode refuses a text past its own model's exact bound
# (Tokenizer.longest_token_bytes) before tokenizing it too.
MAX_PROMPT_CHARS = 128 * 1024 * 128
# More samples than this in one request is refused: each is a Generate call (OpenAI allows up to 128).
MAX_N = 128
# OpenAI's limits on alternatives per token.
MAX_TOP_LOGPROBS = 20
_UINT32 = 2**32
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45  # the smallest above 0
_SEED_LIMIT = 2**63
# Known parameters this server cannot honour, and the values that mean "not used" (None always does).
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "parallel_tool_calls": (),
    "response_format": ({"type": "text"},),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "use_beam_search": (False,),
    "prompt_logprobs": (0,),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}
_CHAT_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role
# An OpenAI body nests a handful of levels (messages -> content parts); anything near this is an attack.
MAX_JSON_DEPTH = 32

_M = TypeVar("_M", bound=BaseModel)
_T = TypeVar("_T")
TokenId = Annotated[int, Field(ge=0, lt=_UINT32)]


def _as_float32(value: float) -> float:
    """value as the wire's 32-bit float carries it (value within float32's range)."""
    return struct.unpack("f", struct.pack("f", value))[0]


class StrictModel(BaseModel):
    """Unknown fields are refused, and JSON types are taken as they are (no "1" for 1, no true for 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    """stream_options: whether a last chunk carries the usage."""

    include_usage: bool | None = None


class _Sampling(StrictModel):
    """The parameters both generation endpoints share (OpenAI's, and vLLM's extras)."""

    model: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=_UINT32)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=_SEED_LIMIT)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0, lt=_UINT32)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # An end-user identifier for abuse monitoring at OpenAI; it changes no output, so it is accepted.
    user: str | None = None
    # vLLM's cache salt: prompt prefixes are reused only between requests with the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:
        """Drops the known-but-unsupported parameters that hold their "not used" value; refuses the others."""
        if isinstance(body, dict):
            for name, unused in _UNSUPPORTED.items():
                if name in body:
                    value = body[name]
                    if value is not None and not any(_same_json(value, u) for u in unused):
                        raise _Refused(
                            name, f"{name}={quoted(value)} is not supported by this server; leave it out"
                        )
                    body = {k: v for k, v in body.items() if k != name}
        return body

    @field_validator(
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"
    )
    @classmethod
    def _fits_the_wire(cls, value: float | None, info: ValidationInfo) -> float | None:
        # The wire carries 32-bit floats: a larger value would arrive as inf (refused by that name), and a
        # tiny one as 0, which the wire reads as "off" for top_p and repetition_penalty.
        if value is not None and (abs(value) > FLOAT32_MAX or (value != 0 and _as_float32(value) == 0)):
            raise ValueError(
                f"{info.field_name}={value!r} must be 0 or between {FLOAT32_TINY:.4g} and {FLOAT32_MAX:.4g} "
                "in size (a 32-bit float)"
            )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            # ASCII digits only: str.isdigit() also takes "²" and "１", which int() then fails on.
            if not re.fullmatch(r"[0-9]{1,10}", key) or int(key) >= _UINT32:
                raise ValueError(
                    f"logit_bias keys must be token ids (integers >= 0 as strings), not {quoted(key)}"
                )
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise _Refused("stream_options", "stream_options is only allowed with stream=true")
        return self


class CompletionRequest(_Sampling):
    """A /v1/completions body."""

    # A batch of one ([text] or [[ids]]) arrives here unwrapped (_one_prompt).
    prompt: str | list[TokenId]
    max_tokens: int | None = Field(None, ge=1, lt=_UINT32)
    # Completions' logprobs is a count of alternatives per token (0: the sampled token's only).
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        """A batch of one is unwrapped; a larger batch refused (one prompt per request). What is left must be
        a string or token ids: a batch inside the batch ([["a"]], [[[1]]]) is refused here, by name."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            if len(prompt) > 1:
                raise ValueError(
                    f"a batch of {len(prompt)} prompts is not supported; send one prompt per request"
                )
            prompt = prompt[0]
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(type(token) is int for token in prompt)
        ):
            return prompt
        raise ValueError(
            "prompt must be a string, a non-empty list of token ids (integers >= 0), or a list holding one "
            "of those"
        )


class TextPart(StrictModel):
    """A content part of type "text" (the only kind this server reads)."""

    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    """One chat message; a tool call or an image is refused by the strict shape."""

    role: Literal["system", "developer", "user", "assistant"]
    # No `name`: the chat template would not show it, and a participant's name silently dropped changes
    # what the model is told; it is refused like any unknown field.
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """An image or audio part is refused as what it is, not as a string the part failed to be."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(
                    f"messages: content parts of type {quoted(kind)} are not supported (this model reads "
                    "text)"
                )
        return content

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def as_prompt(self) -> dict[str, str]:
        """The message as decode takes it: {"role", "content"}, the role in the chat template's terms."""
        return {"role": _CHAT_ROLES.get(self.role, self.role), "content": self.text()}


class ChatCompletionRequest(_Sampling):
    """A /v1/chat/completions body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, lt=_UINT32)
    max_completion_tokens: int | None = Field(None, ge=1, lt=_UINT32)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise _Refused("top_logprobs", "top_logprobs needs logprobs=true")
        return self


def _same_json(value: Any, unused: object) -> bool:
    """Whether value is `unused` as JSON: type-strict, so true is not 1 and 0 is not false."""
    return json.dumps(value, sort_keys=True) == json.dumps(unused, sort_keys=True)


class _Refused(ValueError):
    """A check that names its parameter itself (pydantic would name the model for a model validator)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class ParsedRequest:
    """One validated /v1/completions or /v1/chat/completions request, in the terms of the decode service."""

    chat: bool
    model: str
    prompt: str | list[int] | list[dict[str, str]]
    max_tokens: int
    # False: max_tokens is the endpoint's default (decode may cut it to the context's room)
    max_tokens_given: bool = True
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    # Alternatives per token besides the sampled one.
    top_logprobs: int = 0
    cache_salt: str = ""

    def seed_of(self, sample: int) -> int | None:
        """Sample i's seed: seed + i, so the n samples differ and each is reproducible."""
        return None if self.seed is None else (self.seed + sample) % _SEED_LIMIT

    def to_generate_request(self, request_id: str, sample: int = 0) -> decode_pb2.GenerateRequest:
        """The Decode.Generate request of sample `sample`."""
        request = build_request(
            self.prompt,
            request_id=request_id,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed_of(sample),
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            model=self.model,
        )
        sampling = request.sampling
        sampling.min_p = self.min_p
        sampling.min_tokens = self.min_tokens
        sampling.presence_penalty = self.presence_penalty
        sampling.frequency_penalty = self.frequency_penalty
        sampling.repetition_penalty = self.repetition_penalty
        sampling.logit_bias.update(self.logit_bias)
        if self.logprobs:
            sampling.logprobs = self.top_logprobs
        request.cache_salt = self.cache_salt
        request.fit_max_tokens = not self.max_tokens_given
        return request


def load_body(raw: bytes, charset: str | None = None) -> Any:
    """The JSON value of a request body; raises ApiError (400, param "body" or the top-level key that holds
    the bad value) for text that is not JSON, a lone surrogate, a non-finite number or too deep nesting."""
    try:
        text = raw.decode(charset or "utf-8")
    except LookupError:
        raise bad_request(
            "body", f"charset={quoted(charset)} is unknown; send the body as UTF-8 JSON"
        ) from None
    except UnicodeDecodeError as exc:
        raise bad_request(
            "body", f"the request body is not valid {charset or 'utf-8'} at byte {exc.start}: send UTF-8 JSON"
        ) from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # JSONDecodeError, and ints beyond Python's digit limit
        raise bad_request("body", f"the request body must be JSON ({exc})") from None
    _check_values(body)
    return body


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def _too_deep() -> ApiError:
    return bad_request("body", f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep")


def _check_values(body: Any) -> None:
    """Checks every string and number of the body, walking it without recursion (a recursive walk would
    overflow the stack where the parser nearly did)."""
    pending: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while pending:
        value, depth, param = pending.pop()
        if isinstance(value, str):
            _check_text(value, param)
        elif isinstance(value, float) and not math.isfinite(value):
            raise bad_request(param or "body", f"{param or 'the body'} holds a number beyond the float range")
        elif isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            for key, item in value.items() if isinstance(value, dict) else enumerate(value):
                if isinstance(key, str):
                    _check_text(key, param)
                # The top-level key names the OpenAI parameter a message should point at.
                pending.append((item, depth + 1, param or (clipped(key) if isinstance(key, str) else None)))


def _check_text(text: str, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise bad_request(
            param or "body",
            f"{param or 'the body'} contains the lone surrogate {bad!r} at index {exc.start}, which is not "
            "valid Unicode: a UTF-16 surrogate must be followed by its pair",
        ) from None


def validate(model: type[_M], body: Any) -> _M:
    """`body` as a `model`; raises ApiError(400) naming the top-level field of the first problem."""
    if not isinstance(body, dict):
        raise bad_request("body", "body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _api_error(exc) from None


def _api_error(exc: ValidationError) -> ApiError:
    error = _most_relevant(exc.errors())
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, _Refused):
        return bad_request(cause.param, cause.message)
    loc = [clipped(str(part)) for part in error["loc"] if not _is_type_name(part)]
    param = loc[0] if loc else "body"
    where = (
        loc[0] + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in loc[1:]) if loc else param
    )
    if error["type"] == "extra_forbidden":
        if len(loc) == 1:
            return bad_request(param, f"{param} is not a parameter this server supports; leave it out")
        return bad_request(param, f"{where} is not supported by this server; leave it out")
    if error["type"] == "missing":
        return bad_request(param, f"{where} is required")
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "value_error":
        return bad_request(param, message)
    return bad_request(param, f"{where}={quoted(error.get('input'))}: {message[:1].lower()}{message[1:]}")


def _most_relevant(errors: list[ErrorDetails]) -> ErrorDetails:
    """The error to report: the first, or where that is one branch of a union, the branch that got furthest
    into the value (for prompt=[-1], list[int]'s "must be >= 0" rather than str's "must be a string")."""
    first = errors[0]
    union = next((i for i, part in enumerate(first["loc"]) if _is_type_name(part)), None)
    if union is None:
        return first
    branches = [
        error
        for error in errors
        if error["loc"][:union] == first["loc"][:union]
        and len(error["loc"]) > union
        and _is_type_name(error["loc"][union])
    ]
    return max(branches, key=lambda error: len(error["loc"]))  # the first among equals


def _is_type_name(part: int | str) -> bool:
    """pydantic names the branch of a union in an error's location ("list[int]"); that is no field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def parse_completion(body: Any, served_model: str) -> ParsedRequest:
    """A /v1/completions body; raises ApiError (400, naming the parameter) or 404 for another model."""
    request = validate(CompletionRequest, body)
    prompt = request.prompt
    if isinstance(prompt, str):
        check_prompt_chars("prompt", len(prompt), MAX_PROMPT_CHARS)
    return ParsedRequest(
        chat=False,
        prompt=prompt,
        max_tokens=_or(request.max_tokens, _default_max_tokens(COMPLETION_DEFAULT_MAX_TOKENS, request)),
        max_tokens_given=request.max_tokens is not None,
        logprobs=request.logprobs is not None,
        top_logprobs=request.logprobs or 0,
        **_common(request, served_model),
    )


def parse_chat(body: Any, served_model: str) -> ParsedRequest:
    """A /v1/chat/completions body; raises ApiError (400, naming the parameter) or 404 for another model."""
    request = validate(ChatCompletionRequest, body)
    max_tokens = _or(request.max_completion_tokens, request.max_tokens)
    messages = [message.as_prompt() for message in request.messages]
    check_prompt_chars("messages", sum(len(message["content"]) for message in messages), MAX_PROMPT_CHARS)
    return ParsedRequest(
        chat=True,
        prompt=messages,
        max_tokens=_or(max_tokens, _default_max_tokens(CHAT_DEFAULT_MAX_TOKENS, request)),
        max_tokens_given=max_tokens is not None,
        logprobs=bool(request.logprobs),
        top_logprobs=request.top_logprobs or 0,
        **_common(request, served_model),
    )


def check_prompt_chars(param: str, chars: int, limit: int) -> None:
    """Refuses prompt text of more than `limit` characters (400 naming `param`) before anything tokenizes
    it."""
    if chars > limit:
        raise bad_request(
            param,
            f"{param} is {chars} characters long; at most {limit} are accepted (text that long cannot fit "
            "the model's context)",
        )


def _default_max_tokens(default: int, request: _Sampling) -> int:
    """The endpoint's default max_tokens, raised to min_tokens: decode refuses min_tokens > max_tokens, and
    the client asked for no maximum (decode still cuts a default to the room the prompt leaves)."""
    return max(default, _or(request.min_tokens, 0))


def _or(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _common(request: _Sampling, served_model: str) -> dict[str, Any]:
    """The ParsedRequest fields both endpoints share."""
    if request.model is not None and request.model != served_model:
        raise ApiError(
            404,
            f"model={quoted(request.model)} does not exist here; this server serves {served_model!r} "
            "(see /v1/models)",
            param="model",
            code="model_not_found",
        )
    stop = request.stop
    skip_special_tokens = _or(request.skip_special_tokens, True)
    if not skip_special_tokens and stop:
        # Decode matches stop strings in text without special tokens; the gateway, writing the text with
        # them, could not cut it where decode stopped.
        raise bad_request(
            "skip_special_tokens", "skip_special_tokens=false cannot be combined with stop strings"
        )
    return {
        "model": served_model,
        "n": _or(request.n, 1),
        "temperature": _or(request.temperature, 1.0),
        "top_p": _or(request.top_p, 1.0),
        "top_k": max(_or(request.top_k, 0), 0),  # vLLM's -1 and our 0 both disable top-k
        "min_p": _or(request.min_p, 0.0),
        "seed": request.seed,
        "stop": [stop] if isinstance(stop, str) else list(stop or []),
        "stop_token_ids": list(request.stop_token_ids or []),
        "ignore_eos": _or(request.ignore_eos, False),
        "min_tokens": _or(request.min_tokens, 0),
        "presence_penalty": _or(request.presence_penalty, 0.0),
        "frequency_penalty": _or(request.frequency_penalty, 0.0),
        "repetition_penalty": _or(request.repetition_penalty, 1.0),
        "logit_bias": {int(token): bias for token, bias in (request.logit_bias or {}).items()},
        "include_stop_str_in_output": _or(request.include_stop_str_in_output, False),
        "skip_special_tokens": skip_special_tokens,
        "stream": _or(request.stream, False),
        "include_usage": bool(request.stream_options and request.stream_options.include_usage),
        "cache_salt": request.cache_salt or "",
    }
