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
from collections.abc import Callable, Iterable
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from jllama.chat import limits
from jllama.errors import ChatError

_SIZED_METHODS = frozenset({
    "center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "translate",
    "format", "format_map", "to_bytes", "fromkeys",
})


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's code generator with `~` sized and `+` of constants left to Python."""

    def visit_Add(self, node: jinja2.nodes.Add, frame: jinja2.compiler.Frame) -> None:
        if isinstance(node.left, jinja2.nodes.Const) or isinstance(node.right, jinja2.nodes.Const):
            # One operand is a constant: the sum outgrows the other by the constant's size
            # only, so no check is needed (and `x + 1` costs what it costs in Python).
            self.write("(")
            self.visit(node.left, frame)
            self.write(" + ")
            self.visit(node.right, frame)
            self.write(")")
        else:
            super().visit_Add(node, frame)

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


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
    """Each `{{ ... }}` value before it is written: a container's text is sized first."""
    if type(value) is not str:
        limits.check_size(limits.text_size(value))
    return value


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
        if (args or kwargs) and getattr(__obj, "__name__", None) in _SIZED_METHODS:
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
        limits.check_size(limits.binop_size(operator, left, right))
        return super().call_binop(context, operator, left, right)

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
        name: _bounded_filter(name, f)
        if name in limits.FILTER_SIZES or name in limits.STRINGIFY else f
        for name, f in env.filters.items()
    }
