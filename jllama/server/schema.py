"""Request bodies of the OpenAI API, validated: field types, ranges, and what jllama supports.

Types are strict (a string is not a number, a float is not an integer, a bool is neither);
unknown fields are ignored, as OpenAI-compatible servers do. `parse_body` turns a JSON body into
a request object or raises `APIError` (400) naming the first bad field, e.g.
`temperature: Input should be a valid number (got 'hot')`.

Sampler settings are checked by `jllama.sampling.check_setting`, `SamplerConfig`'s own checks,
so a value the CLI refuses is refused here with the same reason (`top_p: must be a number in
[0, 1], got 1.5`); `top_k` <= 0 means off, as in llama.cpp. On top of those, OpenAI's documented
limits narrow three ranges (temperature at most 2, presence/frequency penalties in [-2, 2],
logit_bias in [-100, 100]); top_logprobs [0, 20] and at most 4 stop strings are OpenAI's too. The
extra samplers (top_k, min_p, repeat_penalty, penalty_last_n, samplers) are llama.cpp server's
names, and so are ignore_eos (go on past the end-of-generation ids, for fixed-length benchmarks)
and cache_prompt (false: feed the whole prompt again rather than reuse the prefix the cache
holds, for replies equal bit for bit to a fresh run's).

`n` (1 to MAX_CHOICES) asks for that many choices; `stream_options` is refused without
`stream: true`, as OpenAI's API refuses it. A body nested more than MAX_DEPTH levels, or holding
an integer of more than MAX_INT_DIGITS digits, is refused before it is validated, in this
module's words (Python's would be "maximum recursion depth exceeded" or
"sys.set_int_max_str_digits").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from jllama.sampling import SamplerConfig, SamplerSettingError, check_setting
from jllama.server.errors import APIError

_U64 = 2**64

MAX_CHOICES = 16
"""The most choices (`n`) one request may ask for: each is a sequence of its own (a slot's
turn, or a turn of the one-at-a-time worker), so n multiplies the request's work."""

MAX_DEPTH = 128
"""The most levels of arrays and objects a request body may nest (a JSON schema of 10 nested
objects is ~25 levels with the request around it)."""

MAX_INT_DIGITS = 64
"""The most digits an integer of a request body may have (a uint64 seed has 20; 2**128, 39)."""

_OPENAI_RANGES = {"temperature": (0.0, 2.0), "presence_penalty": (-2.0, 2.0),
                  "frequency_penalty": (-2.0, 2.0), "logit_bias": (-100.0, 100.0)}
"""OpenAI's documented limits, narrower than `SamplerConfig`'s: (low, high), inclusive (for
logit_bias, each bias)."""

_CONFIG_FIELD = {"samplers": "order"}
"""Request fields named otherwise in `SamplerConfig` (llama.cpp server's `samplers`)."""


def _sampler_setting(name: str, value: Any) -> Any:
    """`value` checked by `SamplerConfig`'s check for the field `name` (the CLI's check, so the
    CLI's reason), returned as `check_setting` normalizes it (a top_k <= 0 as 0).

    Raises:
      ValueError: the reason, e.g. "must be a number in [0, 1], got 1.5".
    """
    try:
        return check_setting(_CONFIG_FIELD.get(name, name), value)
    except SamplerSettingError as e:
        raise ValueError(e.reason) from None


def _openai_range(name: str, value: float, what: str = "") -> None:
    """Raises ValueError where `value` is outside OpenAI's range for `name` (if it has one)."""
    if name not in _OPENAI_RANGES:
        return
    low, high = _OPENAI_RANGES[name]
    if not low <= value <= high:
        raise ValueError(f"{what}must be in [{low:g}, {high:g}] (OpenAI's range), got {value!r}")


def _refuse(supported: Callable[[Any], bool], message: str) -> AfterValidator:
    """A validator that refuses a given value (not None) that jllama does not support."""

    def check(value: Any) -> Any:
        if value is not None and not supported(value):
            raise ValueError(message)
        return value

    return AfterValidator(check)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    penalty_last_n: int | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=_U64)  # OpenAI's int64, or an xorshift state
    stop: Any = Field(None, validate_default=True)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None  # None: 1
    samplers: list[str] | None = None
    user: str | None = None
    ignore_eos: bool = False  # llama.cpp server's: go on past the end-of-generation ids
    cache_prompt: bool = True  # llama.cpp server's: False feeds the whole prompt again
    # llama.cpp's GBNF / Lark text and vLLM's {"regex" | "grammar" | "json"}: constraints
    # besides response_format (`jllama.server.structured.request_grammar`).
    grammar: Any = None
    structured_outputs: Any = None

    @field_validator("temperature", "top_p", "top_k", "min_p", "repeat_penalty",
                     "presence_penalty", "frequency_penalty", "penalty_last_n", "samplers")
    @classmethod
    def _setting(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return None
        checked = _sampler_setting(info.field_name, value)
        _openai_range(info.field_name, value)
        return checked

    @field_validator("n")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"must be an integer in [1, {MAX_CHOICES}] (choices per request; "
                             f"{MAX_CHOICES} is this server's limit), got {value}")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: StreamOptions | None, info: ValidationInfo):
        stream = info.data.get("stream", False)
        if value is not None and stream is not True:
            # OpenAI's API: "The 'stream_options' parameter is only allowed when 'stream' is
            # enabled." (400, param stream_options).
            raise ValueError(f"only allowed when stream is true (as in OpenAI's API), got "
                             f"stream={str(stream).lower()}")
        return value

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
        if value:
            _sampler_setting("logit_bias", {int(key): bias for key, bias in value.items()})
            for key, bias in value.items():
                _openai_range("logit_bias", bias, f"token {key}: ")
        return value

    def sampler_config(self, vocab_size: int, choice: int = 0,
                       base_seed: int | None = None) -> SamplerConfig:
        """The `SamplerConfig` this request asks for, OpenAI's defaults where a field is absent
        (temperature 1, top_p 1, no penalties).

        The seed: absent, a clock seed (or `base_seed`, where given); an integer s, the
        xorshift state s mod 2**64 (so seed=42 samples as `jllama --seed=42`), with 0 (which
        xorshift cannot start from) mapped to 2**64 - 1. Choice i of a request with n > 1
        uses seed s + i (before that mapping): its tokens are those of a request with n=1 and
        seed s + i.

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
        seed = self.seed if self.seed is not None else base_seed
        if seed is not None:
            seed = (seed + choice) % _U64 or _U64 - 1
        options = self.model_dump(
            include={"top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
                     "penalty_last_n"},
            exclude_none=True,
        )
        if self.samplers is not None:
            options["order"] = tuple(self.samplers)
        return SamplerConfig(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=seed, logit_bias=bias, **options,
        )

    @property
    def choices(self) -> int:
        """How many choices to generate (`n`; absent or null: 1)."""
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a list of one string.
    `max_tokens` defaults to 16, as OpenAI's. `logprobs`: top log-probabilities per token
    (0 to 5)."""

    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Annotated[bool, _refuse(lambda echo: not echo, "echo=true is not supported")] = False
    suffix: Annotated[
        str | None, _refuse(lambda suffix: not suffix, "suffix (insertion) is not supported")
    ] = None
    best_of: Annotated[int | None, _refuse(lambda n: n == 1, "only best_of=1 is supported")] = None
    # Not fields of OpenAI's completions API: tools are refused rather than silently ignored;
    # response_format is applied as on /v1/chat/completions (as llama.cpp's and vLLM's servers
    # do), checked by `jllama.server.structured`.
    tools: Annotated[Any, _refuse(lambda tools: False,
                                  "tools (function calling) are only supported on "
                                  "/v1/chat/completions")] = None
    response_format: Any = None

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


class ChatMessage(_Strict):
    """One message. `content` may be null (an assistant message with `tool_calls`);
    `tool_calls` (assistant) and `tool_call_id` (tool) are checked where they are used
    (`jllama.server.tools.history`)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Any = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's thinking (vLLM's, llama.cpp's)

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        if value is None:
            return None
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
            # Parts are joined by a line break, as llama.cpp's and vLLM's servers join them.
            return "\n".join(parts)
        raise ValueError("must be a string or a list of text parts")

    @model_validator(mode="after")
    def _null_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: must be a string or a list of text parts (null only in "
                             "an assistant message with tool_calls)")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined; null: "")."""
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. `max_tokens` (or `max_completion_tokens`) absent: until the
    end-of-turn token or the context is full. `logprobs` / `top_logprobs` (0 to 20) as OpenAI's.
    A "developer" message is given to the template as "system" (OpenAI's newer name for it);
    an assistant message's `reasoning_content` is given to it as that message's."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    # vLLM's and llama.cpp's: more chat template variables (checked by
    # `jllama.server.reasoning.template_kwargs`), and how the reply's think block is read
    # (`jllama.chat.reasoning.REASONING_FORMATS`; None: the server's --reasoning_format).
    chat_template_kwargs: Any = None
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None

    def message_dicts(self) -> list[dict]:
        """The messages as the chat template reads them: {"role", "content"} dicts (content
        null kept as None), with `tool_calls` and `tool_call_id` where given."""
        out = []
        for m in self.messages:
            item = {"role": "system" if m.role == "developer" else m.role,
                    "content": m.content}
            if m.tool_calls is not None:
                item["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                item["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None and m.role == "assistant":
                item["reasoning_content"] = m.reasoning_content  # Qwen3's template reads it
            out.append(item)
        return out


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

    def integer(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_INT_DIGITS:
            raise _BodyLimit(f"the body holds an integer of {len(digits.lstrip('-'))} digits; "
                             f"this server reads at most {MAX_INT_DIGITS}")
        return int(digits)

    try:
        # UTF-8 only: json.loads of bytes would take UTF-16 and UTF-32 as well, guessing from
        # the zero bytes. A UTF-8 byte order mark is allowed (RFC 8259 lets a reader ignore it).
        text = body.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=no_constants, parse_int=integer)
    except json.JSONDecodeError as e:
        raise APIError(
            400, f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except _BodyLimit as e:
        raise APIError(400, str(e)) from None
    except RecursionError:  # nested deeper than the parser's stack: MAX_DEPTH's message
        raise APIError(400, _too_deep()) from None
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {_json_type(data)}")
    if _depth(data) > MAX_DEPTH:
        raise APIError(400, _too_deep())
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


class _BodyLimit(ValueError):
    """A body over one of this module's limits (MAX_INT_DIGITS), found while parsing."""


def _too_deep() -> str:
    return f"the body nests arrays and objects more than {MAX_DEPTH} levels deep"


def _depth(value: Any) -> int:
    """How many levels of arrays and objects `value` nests (a scalar: 0), without recursion."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, depth = level.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            return deepest
        level.extend((child, depth + 1) for child in children)
    return deepest


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
