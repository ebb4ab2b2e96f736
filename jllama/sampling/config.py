"""`SamplerConfig`, how to pick the next token, and the one set of range checks for its fields.

Every place that takes sampler settings from a user (the CLI's flags, the server's request
bodies, a script) checks them here: `check_setting(name, value)` gives the value as
`SamplerConfig` stores it, or raises `SamplerSettingError`, whose `reason` ("must be a number
in [0, 1], got 1.5") the CLI prints after the field's name and the server puts in its 400
response. A front end may narrow a range further (the server keeps OpenAI's documented limits)
but never widens one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jllama.errors import SamplerError

FILTERS = ("top_k", "temperature", "top_p", "min_p")
"""The default order of the candidate steps: temperature before top-p and min-p, as run.c (top-p
on the tempered distribution), Hugging Face transformers and vLLM do. llama.cpp's default order
puts temperature last: `("top_k", "top_p", "min_p", "temperature")`."""

LLAMA_CPP_ORDER = ("top_k", "top_p", "min_p", "temperature")
"""llama.cpp's default order of these four steps (`--samplers top_k;top_p;min_p;temperature`)."""

_U64_MASK = (1 << 64) - 1
_F32_MAX = float(np.finfo(np.float32).max)
_NUMBER_TYPES = (int, float, np.integer, np.floating)


class SamplerSettingError(SamplerError):
    """A sampler setting out of range, as "{name}: {reason}".

    Attributes:
        name: the `SamplerConfig` field ("top_p", "logit_bias", ...).
        reason: what is wrong, with the value given: "must be a number in [0, 1], got 1.5".
    """

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


def check_seed(seed: object) -> int:
    """A seed for `XorShiftRng`: an integer (Python or NumPy; not a bool, float or string) in
    [1, 2**64), returned as a Python int.

    Raises:
        SamplerSettingError: "seed: must be an integer in [1, 2**64), got ...".
    """
    try:
        value = operator.index(seed)  # int or NumPy integer; rejects floats and strings
    except TypeError:
        value = None
    if value is None or isinstance(seed, bool) or not 1 <= value <= _U64_MASK:
        raise SamplerSettingError("seed", f"must be an integer in [1, 2**64), got {seed!r}")
    return value


def _number(name: str, reason: str, low: float, high: float, value: object, *,
            open_low: bool = False) -> object:
    """`value` if it is a number (not a bool) in [low, high] ((low, high] with open_low)."""
    ok = not isinstance(value, bool) and isinstance(value, _NUMBER_TYPES)
    if ok:
        v = float(value)
        ok = math.isfinite(v) and (low < v if open_low else low <= v) and v <= high
    if not ok:
        raise SamplerSettingError(name, f"{reason}, got {value!r}")
    return value


def _integer(name: str, reason: str, low: int | None, value: object) -> int:
    """`value` as an int if it is an integer (not a bool) >= low (any, for low None)."""
    try:
        v = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        v = None
    if v is None or (low is not None and v < low):
        raise SamplerSettingError(name, f"{reason}, got {value!r}")
    return v


def _optional_seed(seed: object) -> int | None:
    return None if seed is None else check_seed(seed)


def _top_k(value: object) -> int:
    """llama.cpp reads k <= 0 as off: any integer, those <= 0 stored as 0."""
    return max(_integer("top_k", "must be an integer (0 or less: off)", None, value), 0)


def _logit_bias(logit_bias: object) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (or (id, bias) pairs) as sorted (id, bias) pairs, later ids winning."""
    items = logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias
    try:
        pairs = list(items)
    except TypeError:
        pairs = None
    if pairs is None or isinstance(logit_bias, (str, bytes)):
        raise SamplerSettingError(
            "logit_bias", f"must map token ids to numbers, got {logit_bias!r}")
    out = {}
    for pair in pairs:
        try:
            token, bias = pair
        except (TypeError, ValueError):
            raise SamplerSettingError(
                "logit_bias", f"must map token ids to numbers, got {pair!r}") from None
        token = _integer("logit_bias", "token ids must be integers >= 0", 0, token)
        if isinstance(bias, bool) or not isinstance(bias, _NUMBER_TYPES):
            raise SamplerSettingError(
                "logit_bias", f"token {token}: must be a number, got {bias!r}")
        if math.isnan(bias) or bias == math.inf:
            raise SamplerSettingError(
                "logit_bias", f"token {token}: must be finite or -inf, got {bias!r}")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _order(order: object) -> tuple[str, ...]:
    names = [] if isinstance(order, str) or not isinstance(order, Sequence) else list(order)
    if not all(isinstance(name, str) for name in names) or sorted(names) != sorted(FILTERS):
        raise SamplerSettingError(
            "order", f"must list each of {', '.join(FILTERS)} once, got {order!r}")
    return tuple(names)


_CHECKS: dict[str, Callable[[object], object]] = {  # in field order: the first bad one is named
    "temperature": functools.partial(
        _number, "temperature", "must be a finite number >= 0", 0.0, _F32_MAX),
    "top_p": functools.partial(_number, "top_p", "must be a number in [0, 1]", 0.0, 1.0),
    "seed": _optional_seed,
    "top_k": _top_k,
    "min_p": functools.partial(_number, "min_p", "must be a number in [0, 1]", 0.0, 1.0),
    "repeat_penalty": functools.partial(
        _number, "repeat_penalty", "must be a number in (0, 1e6]", 0.0, 1e6, open_low=True),
    "frequency_penalty": functools.partial(
        _number, "frequency_penalty", "must be a finite float32 number", -_F32_MAX, _F32_MAX),
    "presence_penalty": functools.partial(
        _number, "presence_penalty", "must be a finite float32 number", -_F32_MAX, _F32_MAX),
    "penalty_last_n": functools.partial(
        _integer, "penalty_last_n", "must be an integer >= -1 (-1: all)", -1),
    "logit_bias": _logit_bias,
    "order": _order,
}


def check_setting(name: str, value: object) -> object:
    """One `SamplerConfig` field checked, as the constructor checks it.

    Args:
        name: a `SamplerConfig` field name: temperature, top_p, seed, top_k, min_p,
            repeat_penalty, frequency_penalty, presence_penalty, penalty_last_n, logit_bias,
            order.
        value: the value given (see `SamplerConfig` for each field's range).

    Returns:
        The value as `SamplerConfig` stores it: unchanged, except top_k (any value <= 0 is
        0), seed (a Python int, or None), logit_bias (sorted (id, float bias) pairs) and order
        (a tuple).

    Raises:
        SamplerSettingError: the value out of range or of the wrong type (`.reason` says
            how), or `name` not a setting.
    """
    check = _CHECKS.get(name)
    if check is None:
        raise SamplerSettingError(name, "is not a sampler setting")
    return check(value)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """How to pick the next token, validated on construction (frozen, hashable).

    The defaults of the fields after `seed` switch their step off, so a config with only
    temperature, top_p and seed samples exactly as run.c.

    Attributes:
        temperature: divides the logits before the softmax; 0 means greedy (argmax of the
            biased, penalized logits; no random draw). Finite and >= 0, and finite as a
            float32 (run.c keeps it as a float).
        top_p: nucleus mass in [0, 1]; 0 or 1 turn top-p off (plain multinomial sampling).
        seed: the `XorShiftRng` seed, an integer in [1, 2**64), or None to take
            `seed_from_clock()` when a `Sampler` is made. (run.c's `-s 0` means "use the
            clock": a CLI that mirrors it passes None for 0.)
        top_k: keep the k most likely tokens, an integer; 0 or less = off, as llama.cpp reads
            it (stored as 0).
        min_p: keep tokens at least min_p times as likely as the best, in [0, 1]; 0 = off.
        repeat_penalty: llama.cpp's repetition penalty, > 0 (at most 1e6); 1 = off.
        frequency_penalty, presence_penalty: OpenAI's / llama.cpp's penalties, finite
            numbers (negative ones encourage repeats); 0 = off.
        penalty_last_n: how many of the sequence's last tokens (prompt included) the penalties
            count, as llama.cpp's `--repeat-last-n`: >= 0, or -1 for all of them; 0 = off.
        logit_bias: added to the logits first: a mapping {token id: bias} on input, stored as
            a sorted tuple of (id, bias) pairs. Biases finite or -inf.
        order: the order of the candidate steps, a permutation of `FILTERS` (names "top_k",
            "temperature", "top_p", "min_p"); `LLAMA_CPP_ORDER` is llama.cpp's default.

    Raises:
        SamplerSettingError (a SamplerError, a ValueError): a field out of range, as
            `check_setting`; the message names the field.
    """

    temperature: float = 1.0
    top_p: float = 0.9
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()
    order: tuple[str, ...] = FILTERS

    def __post_init__(self) -> None:
        for name, value in list(vars(self).items()):  # the fields, in order
            object.__setattr__(self, name, check_setting(name, value))

    @property
    def uses_history(self) -> bool:
        """True when a penalty is on, so a draw needs the sequence's recent token ids."""
        return self.penalty_last_n != 0 and (
            self.repeat_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
