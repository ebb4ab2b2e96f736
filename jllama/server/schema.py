"""Request bodies of the OpenAI API, validated: field types, ranges, and what jllama supports.

Types are strict (a string is not a number, a float is not an integer, a bool is neither);
unknown fields are ignored, as OpenAI-compatible servers do. `parse_body` turns a JSON body into
a request object or raises `APIError` (400) naming the first bad field, e.g.
`temperature: Input should be a valid number (got 'hot')`.

Ranges are OpenAI's where OpenAI documents one (temperature [0, 2], top_p [0, 1],
presence/frequency penalties [-2, 2], logit_bias [-100, 100], top_logprobs [0, 20], at most 4
stop strings); the extra samplers (top_k, min_p, repeat_penalty, penalty_last_n, samplers) are
llama.cpp server's names and ranges.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from jllama.sampling import FILTERS, SamplerConfig
from jllama.server.errors import APIError

_U64 = 2**64


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0, le=1e6)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    penalty_last_n: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-(2**63), lt=_U64)
    stop: Any = Field(None, validate_default=True)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    samplers: list[str] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("must be a string or a list of strings")
        if len(value) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(value)}")
        if any(s == "" for s in value):
            raise ValueError("a stop string must not be empty")
        return tuple(value)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys must be token ids (digits), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {bias!r}")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"only n=1 is supported, got {value}")
        return value

    @field_validator("samplers")
    @classmethod
    def _samplers(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and sorted(value) != sorted(FILTERS):
            raise ValueError(f"must list each of {', '.join(FILTERS)} once, got {value!r}")
        return value

    def sampler_config(self, vocab_size: int) -> SamplerConfig:
        """The `SamplerConfig` this request asks for, OpenAI's defaults where a field is absent
        (temperature 1, top_p 1, no penalties).

        The seed: absent, a clock seed; an integer s, the xorshift state s mod 2**64 (so
        seed=42 samples as `jllama --seed=42`), with 0 (which xorshift cannot start from)
        mapped to 2**64 - 1.

        Raises:
          APIError (400): a logit_bias token id outside [0, vocab_size).
        """
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            token = int(key)
            if token >= vocab_size:
                raise APIError(
                    400, f"logit_bias: token id {token} is outside the vocabulary "
                    f"[0, {vocab_size})", param="logit_bias",
                )
            bias[token] = value
        seed = None
        if self.seed is not None:
            seed = self.seed % _U64 or _U64 - 1
        options = {
            name: getattr(self, name)
            for name in ("top_k", "min_p", "repeat_penalty", "presence_penalty",
                         "frequency_penalty", "penalty_last_n")
            if getattr(self, name) is not None
        }
        if self.samplers is not None:
            options["order"] = tuple(self.samplers)
        return SamplerConfig(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=seed, logit_bias=bias, **options,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a list of one string.
    `max_tokens` defaults to 16, as OpenAI's. `logprobs`: top log-probabilities per token
    (0 to 5)."""

    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            return value[0]
        if (
            isinstance(value, list) and value
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
        ):
            return value
        if isinstance(value, list) and len(value) > 1 and all(isinstance(s, str) for s in value):
            raise ValueError("one prompt per request: a list of several prompts is not supported")
        raise ValueError("must be a string or a non-empty list of token ids")

    @field_validator("echo")
    @classmethod
    def _echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo=true is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (insertion) is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"only best_of=1 is supported, got {value}")
        return value


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Any
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            parts = []
            for i, part in enumerate(value):
                if (
                    not isinstance(part, dict) or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise ValueError(
                        f'part {i} must be {{"type": "text", "text": "..."}} (only text '
                        "content is supported)"
                    )
                parts.append(part["text"])
            return "".join(parts)
        raise ValueError("must be a string or a list of text parts")

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        return self.content


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. `max_tokens` (or `max_completion_tokens`) absent: until the
    end-of-turn token or the context is full. `logprobs` / `top_logprobs` (0 to 20) as OpenAI's.
    A "developer" message is given to the template as "system" (OpenAI's newer name for it)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: Any) -> Any:
        if value:
            raise ValueError("tools (function calling) are not supported")
        return value

    @field_validator("response_format")
    @classmethod
    def _format(cls, value: Any) -> Any:
        if value is not None and value != {"type": "text"}:
            raise ValueError('only {"type": "text"} is supported')
        return value

    def message_dicts(self) -> list[dict[str, str]]:
        """The messages as the chat template reads them: {"role", "content"} dicts."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_body(body: bytes, kind: type[_Sampling]) -> _Sampling:
    """A request object from a JSON body.

    Args:
      body: the raw body, UTF-8 JSON holding one object.
      kind: `CompletionRequest` or `ChatCompletionRequest`.

    Raises:
      APIError (400): not JSON (the position of the error), not an object, or a field that is
        missing, of the wrong type or out of range (`param` names it).
    """

    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not a JSON number")

    try:
        data = json.loads(body, parse_constant=no_constants)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise APIError(
            400, f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {_json_type(data)}")
    where = _lone_surrogate(data, "")
    if where is not None:
        # JSON's \uD83D escapes can encode half of a UTF-16 pair, which is no Unicode text:
        # refuse it here rather than fail when the tokenizer encodes it.
        raise APIError(
            400, f"{where}: holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF "
            "escape), which is not valid Unicode text", param=where,
        )
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _param(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            raise APIError(400, f"{param}: this field is required", param=param) from None
        if "got " not in msg:  # the validators' own messages already say what they got
            msg = f"{msg} (got {_short(err.get('input'))})"
        raise APIError(400, f"{param}: {msg}", param=param) from None


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path (e.g. "messages[0].content") of the first string in `value` holding a lone
    surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate(key, path) or _lone_surrogate(
                item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None
