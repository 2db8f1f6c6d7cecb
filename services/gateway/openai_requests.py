"""OpenAI request bodies -> GenerateRequest: OpenAI and vLLM parameter conventions, defaults and checks.

`load_body` turns the raw body into JSON values every later step can trust: valid Unicode (a lone UTF-16
surrogate such as "\\ud800" is legal JSON but cannot be encoded into a protobuf string), finite numbers, and
at most MAX_JSON_DEPTH levels of nesting (Python's JSON decoder recurses, so a deep body would exhaust the
stack). Checked after that: what the JSON shape and the wire form need (types, n=1, the prompt's form,
unsigned fields, top_p > 0 because the wire reads 0 as "disabled", parameters this server cannot honour).
Value rules the engine owns (temperature >= 0, the context length, ...) are left to the decode worker,
whose message the gateway passes on with the parameter it names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pcpstack.decode.client import build_request
from pcpstack.gateway.errors import ApiError, bad_request
from pcpstack.v1 import decode_pb2

# OpenAI's default for /v1/completions.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# The gateway has no tokenizer, so "the rest of the context" (vLLM's chat default) is unknown here; a prompt
# whose length plus this exceeds the context is refused by decode with a message naming max_tokens.
CHAT_DEFAULT_MAX_TOKENS = 256
_UINT32 = 2**32
_SEED_LIMIT = 2**63
# Parameters this server cannot honour, and the values that mean "not used" (None always does).
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
}
_CHAT_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role
# An OpenAI body nests a handful of levels (messages -> content parts); anything near this is an attack.
MAX_JSON_DEPTH = 32


@dataclass(frozen=True)
class ParsedRequest:
    """One validated /v1/completions or /v1/chat/completions request."""

    chat: bool
    model: str
    prompt: str | list[int] | list[dict[str, str]]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False

    def to_generate_request(self, request_id: str) -> decode_pb2.GenerateRequest:
        """The Decode.Generate request."""
        return build_request(
            self.prompt,
            request_id=request_id,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            model=self.model,
        )


def load_body(raw: bytes, charset: str | None = None) -> Any:
    """The JSON value of a request body; raises ApiError (400, param "body" or the top-level key that holds
    the bad value) for text that is not JSON, a lone surrogate, a non-finite number or too deep nesting."""
    try:
        text = raw.decode(charset or "utf-8")
    except LookupError:
        raise bad_request("body", f"charset={charset!r} is unknown; send the body as UTF-8 JSON") from None
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
                pending.append((item, depth + 1, param or (key if isinstance(key, str) else None)))


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


def parse_completion(body: Any, served_model: str) -> ParsedRequest:
    """A /v1/completions body; raises ApiError (400, naming the parameter) or 404 for another model."""
    body = _object(body)
    logprobs = _int(body, "logprobs", None, minimum=0)
    if logprobs:
        raise bad_request(
            "logprobs",
            f"logprobs={logprobs} is not supported: this server returns the sampled token's log-probability "
            "only, without alternatives; send logprobs=0",
        )
    return ParsedRequest(
        chat=False,
        prompt=_completion_prompt(body.get("prompt")),
        max_tokens=_int(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, minimum=1, below=_UINT32),
        logprobs=logprobs is not None,
        **_common(body, served_model),
    )


def parse_chat(body: Any, served_model: str) -> ParsedRequest:
    """A /v1/chat/completions body; raises ApiError (400, naming the parameter) or 404 for another model."""
    body = _object(body)
    top_logprobs = _int(body, "top_logprobs", 0, minimum=0)
    if top_logprobs:
        raise bad_request(
            "top_logprobs",
            f"top_logprobs={top_logprobs} is not supported: this server returns the sampled token's "
            "log-probability only, without alternatives; send 0 or leave it out",
        )
    max_tokens_name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    return ParsedRequest(
        chat=True,
        prompt=_messages(body.get("messages")),
        max_tokens=_int(body, max_tokens_name, CHAT_DEFAULT_MAX_TOKENS, minimum=1, below=_UINT32),
        logprobs=_bool(body, "logprobs", False),
        **_common(body, served_model),
    )


def _common(body: dict, served_model: str) -> dict[str, Any]:
    """The parameters both endpoints share."""
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(
            404,
            f"model={model!r} does not exist here; this server serves {served_model!r} (see /v1/models)",
            param="model",
            code="model_not_found",
        )
    n = _int(body, "n", 1)
    if n != 1:
        raise bad_request("n", f"n={n} is not supported: this server returns one choice per request (n=1)")
    for name, unused in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value not in unused:
            raise bad_request(name, f"{name}={value!r} is not supported by this server; leave it out")
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise bad_request("stream_options", "stream_options is only allowed with stream=true")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad_request("top_p", f"top_p={top_p!r} must be in (0, 1] (1 disables top-p)")
    top_k = _int(body, "top_k", 0, minimum=-1, below=_UINT32)
    return {
        "model": served_model,
        "temperature": _number(body, "temperature", 1.0),
        "top_p": top_p,
        "top_k": max(top_k, 0),  # vLLM's -1 and our 0 both disable top-k
        "seed": _int(body, "seed", None, minimum=0, below=_SEED_LIMIT),
        "stop": _stop(body.get("stop")),
        "stop_token_ids": _int_list(body, "stop_token_ids"),
        "ignore_eos": _bool(body, "ignore_eos", False),
        "stream": stream,
        "include_usage": _bool(_object(stream_options or {}, "stream_options"), "include_usage", False),
    }


def _object(value: Any, name: str = "body") -> dict:
    if not isinstance(value, dict):
        raise bad_request(name, f"{name} must be a JSON object")
    return value


def _completion_prompt(prompt: Any) -> str | list[int]:
    """A string or token ids; a batch of one is unwrapped, a larger batch refused (n=1 per request)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > 1:
            raise bad_request(
                "prompt", f"a batch of {len(prompt)} prompts is not supported; send one prompt per request"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(_is_int(t) and 0 <= t < _UINT32 for t in prompt):
        return prompt
    raise bad_request("prompt", "prompt must be a string or a list of token ids (integers >= 0)")


def _messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages as {"role", "content"}; content parts of type "text" are joined."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages must be a non-empty list of {role, content} objects")
    result = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("messages", f"messages[{index}] must be an object with a string role")
        role = _CHAT_ROLES.get(message["role"], message["role"])
        result.append({"role": role, "content": _content(message.get("content"), index)})
    return result


def _content(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(
                    "messages",
                    f"messages[{index}].content: only parts of type 'text' are supported",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request("messages", f"messages[{index}].content must be a string or a list of text parts")


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise bad_request("stop", "stop must be a string or a list of strings")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, default: Any, *, minimum: int | None = None, below: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad_request(name, f"{name}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise bad_request(name, f"{name}={value} must be >= {minimum}")
    if below is not None and value >= below:
        raise bad_request(name, f"{name}={value} must be < {below}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise bad_request(name, f"{name}={value!r} must be a number")
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(name, f"{name}={value!r} must be true or false")
    return value


def _int_list(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(v) and 0 <= v < _UINT32 for v in value):
        raise bad_request(name, f"{name} must be a list of integers >= 0")
    return value
