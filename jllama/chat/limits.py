"""The sizes a chat template's values may reach, computed before the step that would make them.

A chat template comes from a model file, so it is a program from a stranger. Hugging Face
transformers runs it in Jinja's sandbox, which keeps it from Python's internals but not from
the machine's memory and time: `{{ 'a'|center(10**9) }}`, `{{ '%999999999d'|format(1) }}`, a
namespace string doubled 64 times with `~`, a macro calling itself twice per level 40 levels
deep, or 5,000 nested parentheses take gigabytes, hours or the interpreter's stack. Here:

- time and memory are watched from outside (`jllama.chat.watchdog`: `MAX_TEMPLATE_SECONDS`,
  `MAX_TEMPLATE_GROWTH`), which stops any loop, recursion or accumulation the template's Python
  code runs, and costs a rendering nothing per step;
- what the watcher cannot stop is one C call that makes a huge value at once (`center`,
  `%` widths, `*`, `str.join`, `tojson`, `str()` of a list holding one big string many times).
  Each such step is sized *before* it runs, from its operands, by the functions of this module
  (`FILTER_SIZES`, `method_size`, `binop_size`, `printf_size`, `format_size`, `text_size`), and
  refused past `MAX_TEMPLATE_VALUE` characters or items; `jllama.chat.bounded` calls them from
  Jinja's sandbox hooks;
- the output (and each macro's, `{% set %}` block's and `{% call %}`'s) is refused as it grows
  past `MAX_TEMPLATE_OUTPUT` characters;
- recursion ends at Python's recursion limit (a one-line error, as every failure here), and
  the text itself is bounded (`MAX_TEMPLATE_SOURCE`), nesting too deep for the parser or
  Python's compiler being an error too.

The limits sit far above what real templates need: the longest conversation a 1M-token context
holds is ~4M characters, a quarter of `MAX_TEMPLATE_VALUE`. Over a limit: a one-line
`jllama.errors.ChatError` starting "chat template: " naming it.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any

import jinja2.utils

from jllama.errors import ChatError

MAX_TEMPLATE_SOURCE = 1 << 20
"""Characters of template text (the largest real templates are ~30,000)."""

MAX_TEMPLATE_VALUE = 1 << 24
"""Characters (or items) of any one value a sized step makes."""

MAX_TEMPLATE_OUTPUT = 1 << 24
"""Characters a template writes: its output, and each macro's, set block's or call block's."""


def too_large(n: int, limit: int = MAX_TEMPLATE_VALUE) -> ChatError:
    """The error for a value of `n` characters or items over `limit`."""
    return ChatError(f"chat template: a value of {n} characters or items (refused; the limit is "
                     f"{limit})")


def check_size(n: int, limit: int = MAX_TEMPLATE_VALUE) -> int:
    """`n`, or ChatError when it is over `limit`."""
    if n > limit:
        raise too_large(n, limit)
    return n


def text_size(value: Any, indent: int = 0, limit: int = MAX_TEMPLATE_VALUE) -> int:
    """About how many characters `str(value)` (or `json.dumps` with `indent`) writes, counted
    without writing them; counting stops once past `limit`.

    Strings count their length, numbers their digits, containers their items' sizes plus two
    separators an item (and `indent` characters a nesting level an item). A container holding
    one big string many times counts it each time: that is what its text holds. `str()` of a
    string inside a container may write escapes (up to 10 characters a character), so the
    text can be a small multiple of this count, never a power of it.
    """
    if indent:
        return _indented_text_size(value, indent, limit)
    total = 0
    stack = [value]
    pop, extend = stack.pop, stack.extend
    push = stack.append
    while stack:
        item = pop()
        kind = type(item)
        if kind is dict:
            # The commonest shape (JSON objects of strings) counted here rather than pushed:
            # a fifth of the walk's time on a tool's schema.
            total += 2 + 4 * len(item)
            for key, item in item.items():
                if type(key) is str:
                    total += len(key) + 2
                else:
                    push(key)
                if type(item) is str:
                    total += len(item) + 2
                else:
                    push(item)
        elif kind is str:
            total += len(item) + 2
        elif kind is list or kind is tuple:
            total += 2 + 2 * len(item)
            extend(item)
        elif item is None or kind is bool or kind is float:
            total += 24
        elif kind is int:
            total += item.bit_length() // 3 + 2
        else:
            total += _other_size(item, stack)
        if total > limit:
            return total
    return total


def _other_size(item: Any, stack: list) -> int:
    """`text_size`'s rarer types: its count for `item`, pushing what `item` holds."""
    if isinstance(item, str):
        return len(item) + 2
    if isinstance(item, (bytes, bytearray)):
        return 4 * len(item) + 3
    if isinstance(item, Mapping):
        stack.extend(item.keys())
        stack.extend(item.values())
        return 2 + 4 * len(item)
    if isinstance(item, (list, tuple, set, frozenset)):
        stack.extend(item)
        return 2 + 2 * len(item)
    if isinstance(item, jinja2.utils.Namespace):
        stack.append(item._Namespace__attrs)  # its repr writes its attributes
        return 12
    return 64


def _indented_text_size(value: Any, indent: int, limit: int) -> int:
    """`text_size` with `indent` characters a nesting level an item (`pprint`)."""
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            total += 2 + (4 + indent * (depth + 1)) * len(item)
            stack.extend((v, depth + 1) for v in (*item.keys(), *item.values()))
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + (2 + indent * (depth + 1)) * len(item)
            stack.extend((v, depth + 1) for v in item)
        else:
            total += text_size(item, 0, limit)
        if total > limit:
            return total
    return total


# --------------------------------------------------------------------------------------------
# Sizes computed before a step, from its operands.

_PRINTF = re.compile(
    r"%(?:\((?P<key>[^)]*)\))?[#0\- +]*(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d*))?[hlL]?(?P<type>.)?",
    re.S,
)


def _number(text: str | None, what: str) -> int:
    if not text:
        return 0
    if len(text) > 9:
        raise ChatError(f"chat template: a format {what} of {len(text)} digits (refused)")
    return int(text)


def printf_size(fmt: str, args: Any) -> int:
    """An upper bound of the characters `fmt % args` writes (the `%` operator, the `format`
    filter): the format's text plus, for each conversion, its width and precision and the
    size of the value it converts. `*` widths are refused (no template needs them)."""
    total = len(fmt)
    if "%" not in fmt:
        return total
    seq = args if isinstance(args, tuple) else (args,)
    biggest = max((text_size(a) for a in seq), default=0) if isinstance(args, tuple) else 0
    index = 0
    for m in _PRINTF.finditer(fmt):
        if m["type"] == "%":
            continue
        if m["width"] == "*" or m["precision"] == "*":
            raise ChatError("chat template: '*' widths in % formatting are not supported")
        total += _number(m["width"], "width") + _number(m["precision"], "precision")
        if m["key"] is not None and isinstance(args, Mapping):
            total += text_size(args.get(m["key"]))
        elif index < len(seq):
            total += text_size(seq[index])
            index += 1
        else:
            total += biggest
        if total > MAX_TEMPLATE_VALUE:
            break
    return total


_FORMATTER = string.Formatter()


def format_size(fmt: str, args: tuple, kwargs: Mapping) -> int:
    """An upper bound of the characters `fmt.format(*args, **kwargs)` writes: the text, each
    field's width and precision, and the size of the argument it names (the whole argument
    where the field picks a part of it). Fields nested in a format spec are refused."""
    if ":" not in fmt:
        # No format spec, so no width: each field (at most one a "{") writes at most the
        # text of the biggest argument. Parsing the format costs more than a real template's
        # `'<tok{}>'.format(x)` itself: the bound is enough unless it is over the limit.
        biggest = 0
        for values in (args, kwargs.values()):
            for v in values:
                biggest = max(biggest, len(v) + 2 if v.__class__ is str else text_size(v))
        bound = len(fmt) + fmt.count("{") * biggest
        if bound <= MAX_TEMPLATE_VALUE:
            return bound
    total = 0
    auto = 0
    for literal, field, spec, _conversion in _FORMATTER.parse(fmt):
        total += len(literal)
        if field is None:
            continue
        if spec and "{" in spec:
            raise ChatError("chat template: nested fields in a format spec are not supported")
        for digits in re.findall(r"\d+", spec or ""):
            total += _number(digits, "width")
        name = re.split(r"[.\[]", field, maxsplit=1)[0]
        if name == "":
            value = args[auto] if auto < len(args) else None
            auto += 1
        elif name.isdigit():
            value = args[int(name)] if int(name) < len(args) else None
        else:
            value = kwargs.get(name)
        total += text_size(value)
        if total > MAX_TEMPLATE_VALUE:
            break
    return total


def _arg(args: tuple, kwargs: Mapping, index: int, name: str, default: Any = None) -> Any:
    if index < len(args):
        return args[index]
    return kwargs.get(name, default)


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _text(value: Any) -> str:
    """`str(value)`, once its text is known to be within the limit."""
    if isinstance(value, str):
        return value
    check_size(text_size(value))
    return str(value)


def _join_size(items: Any, sep: Any) -> int:
    n = len(items) if hasattr(items, "__len__") else 0
    return text_size(items) + len(_text(sep) if sep is not None else "") * n


def replace_size(s: str, old: Any, new: Any, count: Any) -> int:
    """An upper bound of the characters `s.replace(old, new, count)` writes."""
    old, new = _text(old), _text(new)
    if len(new) <= len(old):
        return len(s)  # no longer than `s` (no need to count the hits)
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _len(value: Any) -> int:
    return len(value) if isinstance(value, str) else text_size(value)


def _lines(value: Any) -> int:
    return value.count("\n") + 1 if isinstance(value, str) else 1


# Filters that can make a value much bigger than their operands, and the bound of what each
# makes, from its arguments after the value (Jinja's signatures; `pass_*` arguments removed).
FILTER_SIZES = {
    "center": lambda v, a, k: max(_len(v), _int(_arg(a, k, 0, "width", 80))),
    "format": lambda v, a, k: printf_size(str(v), k if k else tuple(a)),
    "indent": lambda v, a, k: _len(v) + _lines(v) * (
        len(w) if isinstance(w := _arg(a, k, 0, "width", 4), str) else _int(w)),
    "replace": lambda v, a, k: replace_size(str(v), _arg(a, k, 0, "old", ""),
                                             _arg(a, k, 1, "new", ""), _arg(a, k, 2, "count")),
    "join": lambda v, a, k: _join_size(v, _arg(a, k, 0, "d", "")),
    "wordwrap": lambda v, a, k: _len(v) + (_len(v) + 1) * len(
        _text(_arg(a, k, 2, "wrapstring", None) or "\n")),
    "truncate": lambda v, a, k: _len(v) + len(_text(_arg(a, k, 2, "end", "..."))),
    "batch": lambda v, a, k: _int(_arg(a, k, 0, "linecount", 0)) * (
        1 + text_size(_arg(a, k, 1, "fill_with", None))),
    "slice": lambda v, a, k: _int(_arg(a, k, 0, "slices", 0)) * (
        1 + text_size(_arg(a, k, 1, "fill_with", None))),
    "pprint": lambda v, a, k: text_size(v, indent=1),
    "urlize": lambda v, a, k: _len(v) * (2 + sum(
        len(_text(_arg(a, k, i, n, None) or "")) for i, n in ((2, "target"), (3, "rel")))),
    "sum": lambda v, a, k: text_size(v) + text_size(_arg(a, k, 1, "start", 0)),
    # A string's characters as a list: a string object each (up to ~80 bytes where they are
    # not Latin-1), so a list of characters counts 8 a character.
    "list": lambda v, a, k: 8 * len(v) if isinstance(v, str) else 0,
}

# Filters that write their value as text (`str()` of a list writes all its items): a value that
# is not a string has its text counted before they run (`join` writes its items, counted by
# its size in FILTER_SIZES).
STRINGIFY = frozenset({
    "capitalize", "center", "e", "escape", "forceescape", "format", "indent", "lower",
    "pprint", "replace", "string", "striptags", "title", "trim", "truncate", "upper",
    "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr",
})

# Filters whose first argument is materialized before they run, so its length is known (a
# generator from `map` or `select` has none).
MATERIALIZE = frozenset({"join", "sum", "batch", "slice"})


def method_size(self: Any, name: str, args: tuple, kwargs: Mapping) -> int | None:
    """The bound of what a method of a string, bytes, int or dict makes, for those that can
    make much more than their operands (`str.center`, `str.join`, `int.to_bytes`, ...); None
    for other methods (their results are checked after)."""
    if name == "format" and isinstance(self, str):  # the commonest, first
        return format_size(self, args, kwargs)
    if isinstance(self, (str, bytes, bytearray)):
        if name in ("center", "ljust", "rjust", "zfill"):
            return max(len(self), _int(_arg(args, kwargs, 0, "width", 0)))
        if name == "expandtabs":
            return len(self) + self.count("\t" if isinstance(self, str) else b"\t") * max(
                _int(_arg(args, kwargs, 0, "tabsize", 8)), 0)
        if name == "replace" and isinstance(self, str):
            return replace_size(self, _arg(args, kwargs, 0, "old", ""),
                                 _arg(args, kwargs, 1, "new", ""), _arg(args, kwargs, 2, "count"))
        if name == "replace":
            new = _arg(args, kwargs, 1, "new", b"")
            return len(self) * (1 + len(new) if hasattr(new, "__len__") else 1) + len(new or b"")
        if name == "join":
            items = _arg(args, kwargs, 0, "iterable", ())
            return _join_size(items, self) if hasattr(items, "__len__") else None
        if name == "translate" and isinstance(self, str):
            table = _arg(args, kwargs, 0, "table", {})
            widest = max((text_size(v) for v in table.values()), default=1) if isinstance(
                table, Mapping) else 1
            return len(self) * max(widest, 1)
        if name in ("format", "format_map") and isinstance(self, str):
            if name == "format_map":
                return format_size(self, (), args[0] if args else {})
            return format_size(self, args, kwargs)
    elif isinstance(self, int) and name == "to_bytes":
        return _int(_arg(args, kwargs, 0, "length", 1))
    elif isinstance(self, Mapping) and name == "fromkeys":
        keys = _arg(args, kwargs, 0, "iterable", ())
        n = len(keys) if hasattr(keys, "__len__") else 0
        return n * (1 + text_size(_arg(args, kwargs, 1, "value", None)))
    return None


def binop_size(operator: str, left: Any, right: Any) -> int:
    """The bound of what `left operator right` makes, for the operators the sandbox
    intercepts: the result's characters or items, or for numbers its bits / 4."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes)) and isinstance(n, int):
                return len(seq) * max(n, 0)
            if isinstance(seq, (list, tuple)) and isinstance(n, int):
                return max(len(seq), text_size(seq)) * max(n, 0)
        if isinstance(left, int) and isinstance(right, int):
            return (left.bit_length() + right.bit_length()) // 4
        return 0
    if operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            return abs(left).bit_length() * right // 4
        return 0
    if operator == "%":
        if isinstance(left, str):
            return printf_size(left, right)
        return 0
    if operator == "+":
        if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
            return len(left) + len(right)
        if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            return text_size(left) + text_size(right)
    return 0
