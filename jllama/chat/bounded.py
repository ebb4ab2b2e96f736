"""Jinja's sandbox with the sizes of `jllama.chat.limits` checked in its hooks.

Each step that could make a huge value in one C call is sized before it runs:

- `_BoundedEnvironment.call`: the methods that make more than their operands (`str.center`,
  `str.join`, `str.format`, `int.to_bytes`, ...; `limits.method_size`);
- `_BoundedEnvironment.call_binop`: `* ** %`, and `+` of two values that are not constants
  (only that can double a value a step; `x + 1` and `'<|' + role` stay Python's own `+`);
- `_BoundedCodeGenerator.visit_Concat`: `~` (its operands' text, a list's included);
- `_bounded_filter`: the filters that make more than their value (`limits.FILTER_SIZES`) or
  write a list's text (`limits.STRINGIFY`); the others are Jinja's own, untouched;
- `_finalize`: a `{{ list }}`'s text before `str()` writes it;
- `_bounded_output` (the environment's `concat`): the output of the template, of each macro,
  `{% set %}` block and `{% call %}`, refused as it grows.

Loops, recursion and accumulation are left to the watcher (`jllama.chat.watchdog`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import markupsafe

from jllama.chat import limits
from jllama.errors import ChatError

_METHOD_CLASSES = (type("".join), types.FunctionType)

_SIZED_METHODS = frozenset({
    "center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "translate",
    "format", "format_map", "to_bytes", "fromkeys",
})


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's code generator with `~` sized and `+` of constants left to Python."""

    def visit_Add(self, node: jinja2.nodes.Add, frame: jinja2.compiler.Frame) -> None:
        if _is_constant(node.left) or _is_constant(node.right):
            # One operand is made of constants: the sum outgrows the other by the constants'
            # size only, so no check is needed (and `x + 1` costs what it costs in Python).
            self.write("(")
            self.visit(node.left, frame)
            self.write(" + ")
            self.visit(node.right, frame)
            self.write(")")
        else:
            # str + str, the common case, checked inline (no call); anything else by
            # `call_binop`. Each operand is evaluated once, into a name of its own.
            a, b = self.temporary_identifier(), self.temporary_identifier()
            self.write(f"({a} + {b} if (({a} := ")
            self.visit(node.left, frame)
            self.write(f").__class__ is str) & (({b} := ")
            self.visit(node.right, frame)
            self.write(f").__class__ is str) and len({a}) + len({b}) <= "
                       f"{limits.MAX_TEMPLATE_VALUE} else "
                       f"environment.call_binop(context, '+', {a}, {b}))")

    # `{{ value }}` is written by Jinja as `str(environment.finalize(value))`; `_finalize` sizes
    # a container's text first. Here a value that is a string costs neither call: where it is
    # text by construction (a filter that returns text, `~`, a string constant added to
    # something; most outputs of real templates, `{{ message['content'] | trim }}`) it is
    # written as it is, elsewhere a type test decides, inline:
    # `(o if (o := value).__class__ is str else str(environment.finalize(o)))`.

    def _output_child_pre(self, node, frame, finalize) -> None:
        self._output_child(node, frame, finalize, before=True)

    def _output_child_post(self, node, frame, finalize) -> None:
        self._output_child(node, frame, finalize, before=False)

    def _output_child(self, node, frame, finalize, before: bool) -> None:
        """The code written before (`before`) or after an output expression."""
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            jinjas = super()._output_child_pre if before else super()._output_child_post
            jinjas(node, frame, finalize)
        elif _is_text(node):
            self.write("(" if before else ")")
        elif before:
            name = self.temporary_identifier()
            self.__dict__.setdefault("_output_names", []).append(name)
            self.write(f"({name} if ({name} := ")
        else:
            name = self._output_names.pop()
            self.write(f").__class__ is str else str(environment.finalize({name})))")

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        """`a ~ b ~ c`: where every operand is a string, joined inline, after a type test and,
        with two operands or more that are not constants, their lengths summed (one that
        is alone outgrows the constants' size only, as in `visit_Add`); anything else by
        `bounded_concat`, which sizes the operands' text. Each operand is evaluated once."""
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")
            return
        parts: list[str] = []  # each operand: a constant's text, or the name it is bound to
        dynamic: list[tuple[str, jinja2.nodes.Expr]] = []
        for arg in node.nodes:
            if isinstance(arg, jinja2.nodes.Const) and (
                arg.value is None or type(arg.value) in (str, int, float, bool)
            ):
                parts.append(repr(str(arg.value)))
            else:
                name = self.temporary_identifier()
                parts.append(name)
                dynamic.append((name, arg))
        if not dynamic:
            self.write(repr("".join(str(arg.value) for arg in node.nodes)))
            return
        operands = "(" + ", ".join(parts) + ",)"
        self.write(f"(''.join({operands}) if (")
        for i, (name, arg) in enumerate(dynamic):  # evaluated here, in order
            self.write(f"{' & ' if i else ''}(({name} := ")
            self.visit(arg, frame)
            self.write(").__class__ is str)")
        self.write(")")
        if len(dynamic) > 1:
            lengths = " + ".join(f"len({name})" for name, _ in dynamic)
            self.write(f" and {lengths} <= {limits.MAX_TEMPLATE_VALUE}")
        self.write(f" else environment.bounded_concat({operands}))")


_TEXT_FILTERS = frozenset({
    "capitalize", "center", "e", "escape", "forceescape", "format", "indent", "join", "lower",
    "replace", "safe", "string", "striptags", "title", "tojson", "trim", "truncate", "upper",
    "urlencode", "urlize", "wordwrap",
})
"""Filters whose result is text whatever their value."""


def _is_text(node: jinja2.nodes.Node) -> bool:
    """Whether an expression's value is a string by construction."""
    if isinstance(node, jinja2.nodes.Const):
        return isinstance(node.value, str)
    if isinstance(node, jinja2.nodes.Concat):
        return True
    if isinstance(node, jinja2.nodes.Filter):
        return node.name in _TEXT_FILTERS
    if isinstance(node, jinja2.nodes.Add):
        return _is_text(node.left) or _is_text(node.right)  # str + x is a str or an error
    if isinstance(node, jinja2.nodes.CondExpr):
        return _is_text(node.expr1) and node.expr2 is not None and _is_text(node.expr2)
    return False


def _is_constant(node: jinja2.nodes.Node) -> bool:
    """Whether an expression is made of constants only (its size is the template text's)."""
    if isinstance(node, jinja2.nodes.Const):
        return True
    if isinstance(node, jinja2.nodes.Add):
        return _is_constant(node.left) and _is_constant(node.right)
    if isinstance(node, jinja2.nodes.Concat):
        return all(_is_constant(n) for n in node.nodes)
    return False


def _bounded_output(parts: Iterable[str]) -> str:
    """The environment's `concat`: joins a template's (a macro's, a set block's) output,
    refused past `MAX_TEMPLATE_OUTPUT` characters before the text is made. The parts are
    gathered first (references: a part written many times is held once; parts made anew
    each time are Python work the watcher can stop)."""
    parts = parts if type(parts) is list else list(parts)
    n = sum(map(len, parts))
    if n > limits.MAX_TEMPLATE_OUTPUT:
        raise ChatError(f"chat template: wrote {n} characters (refused; the limit is "
                        f"{limits.MAX_TEMPLATE_OUTPUT})")
    return "".join(parts)


def _finalize(value: Any) -> Any:
    """A `{{ ... }}` value before it is written: a container's text is sized first."""
    if not isinstance(value, _SCALARS):
        limits.check_size(limits.text_size(value))
    return value


_SCALARS = (str, int, float, type(None), jinja2.Undefined)


def _bounded_filter(name: str, func: Callable) -> Callable:
    """`func`, the filter `name`, with what it makes sized before it runs."""
    sizer = limits.FILTER_SIZES.get(name)
    materialize = name in limits.MATERIALIZE
    first = 0 if jinja2.utils._PassArg.from_obj(func) is None else 1  # after context/env

    if sizer is None and first == 0:
        # Writes its value as text and makes no more (`trim`, `upper`, `string`, ...): only
        # a value that is not a string is sized (the common case costs one type check).
        @functools.wraps(func)
        def stringifying(value: Any, *args: Any, **kwargs: Any) -> Any:
            if type(value) is not str:
                limits.check_size(limits.text_size(value))
            return func(value, *args, **kwargs)

        return stringifying

    stringifies = name in limits.STRINGIFY

    @functools.wraps(func)  # keeps `jinja_pass_arg`, which tells Jinja what to pass first
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if len(args) > first:
            value = args[first]
            if materialize and not hasattr(value, "__len__"):
                value = list(value)  # a generator (`map`, `select`): its length is needed
                args = (*args[:first], value, *args[first + 1:])
            if stringifies and type(value) is not str:
                limits.check_size(limits.text_size(value))
            if sizer is not None:
                limits.check_size(sizer(value, args[first + 1:], kwargs))
        return func(*args, **kwargs)

    return bounded


def _text_of(value: Any) -> str:
    """`value` as text (a `Markup` stays one), a container's text sized first."""
    if type(value) is str:
        return value
    if not isinstance(value, str):
        limits.check_size(limits.text_size(value))
    return markupsafe.soft_str(value)


# The commonest text filters, written with the check inside rather than wrapped (a wrapper
# costs a call on each use; real templates trim every message), and a string taken as it is
# without calling `_text_of`.
def _trim(value: Any, chars: str | None = None) -> str:
    """`trim`: leading and trailing `chars` (whitespace) removed."""
    return (value if value.__class__ is str else _text_of(value)).strip(chars)


def _lower(value: Any) -> str:
    """`lower`: the value in lower case."""
    return (value if value.__class__ is str else _text_of(value)).lower()


def _upper(value: Any) -> str:
    """`upper`: the value in upper case."""
    return (value if value.__class__ is str else _text_of(value)).upper()


def _string(value: Any) -> str:
    """`string`: the value as text."""
    return value if value.__class__ is str else _text_of(value)


def _list(value: Any) -> list:
    """`list`: the value's items (a string's characters, 8 a character counted: each is an
    object). Jinja's own also dispatches to an async variant at each call, which a sandbox
    that renders synchronously never takes."""
    if isinstance(value, str):
        limits.check_size(8 * len(value))
    return list(value)


_OWN_FILTERS = {"trim": _trim, "lower": _lower, "upper": _upper, "string": _string,
                "list": _list}


def _replace_filter(bounded: Callable) -> Callable:
    """`replace` with strings, its commonest use (escaping a value: `|replace('&', '&amp;')`),
    sized inline; anything else by `bounded` (Jinja's, wrapped by `_bounded_filter`)."""

    @jinja2.pass_eval_context
    def replace(eval_ctx, s: Any, old: Any, new: Any, count: Any = None) -> Any:
        if (s.__class__ is str and old.__class__ is str and new.__class__ is str
                and not eval_ctx.autoescape):
            if len(new) > len(old):
                limits.check_size(limits.replace_size(s, old, new, count))
            return s.replace(old, new, -1 if count is None else count)
        return bounded(eval_ctx, s, old, new, count)

    return replace


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    """`lipsum()` with its size bounded before it is made (`n` paragraphs of up to `max`
    words; 7 characters a word is generous for its vocabulary)."""
    if isinstance(n, int) and isinstance(max, int):
        limits.check_size(7 * n * max)
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


class _BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox whose amplifying calls, operators and `~` are sized first."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        # A sized method is a builtin's (str.center) or the sandbox's wrapper of str.format:
        # the class is tested first, the cheapest test for the calls that are neither
        # (macros, dict.get, the template's globals).
        if (
            __obj.__class__ in _METHOD_CLASSES
            and (args or kwargs)
            and __obj.__name__ in _SIZED_METHODS
        ):
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner = getattr(method, "__self__", None)
            if owner is not None:
                size = limits.method_size(owner, method.__name__, args, kwargs)
                if size is not None:
                    limits.check_size(size)
        # The sandbox's own `call`, inline (one Python frame less on every call).
        if not __self.is_safe_callable(__obj):
            raise jinja2.sandbox.SecurityError(f"{__obj!r} is not safely callable")
        return __context.call(__obj, *args, **kwargs)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:  # the common case
            if len(left) + len(right) > limits.MAX_TEMPLATE_VALUE:
                raise limits.too_large(len(left) + len(right))
            return left + right
        limits.check_size(limits.binop_size(operator, left, right))
        return self.binop_table[operator](left, right)

    def bounded_concat(self, values: tuple) -> str:
        """`a ~ b ~ c` (called by the generated code): sized before the text is made."""
        n = 0
        for v in values:
            n += len(v) if type(v) is str else limits.text_size(v)
        limits.check_size(n)
        return "".join(map(str, values))


def bounded_environment(**options: Any) -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The sandbox with the size checks, given Jinja `Environment` options. Filters added
    after it is made are not checked until `bound_filters` wraps them: call it once they are
    in place."""
    env = _BoundedEnvironment(finalize=_finalize, **options)
    env.concat = _bounded_output
    env.globals["lipsum"] = _bounded_lipsum
    return env


def bound_filters(env: jinja2.Environment) -> None:
    """Wraps the filters of `env` that make more than their value or write a list's text."""
    env.filters = {
        name: _OWN_FILTERS.get(name) or _bounded_filter(name, f)
        if name in limits.FILTER_SIZES or name in limits.STRINGIFY else f
        for name, f in env.filters.items()
    }
    if "replace" in env.filters:
        env.filters["replace"] = _replace_filter(env.filters["replace"])
