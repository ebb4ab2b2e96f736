"""The fuzz harness's chat-template cases (bench/fuzz.py, issue 33): a GGUF whose chat template
is a program from a stranger.

The seed is the GGUF seed run in chat mode (`--mode=chat`: the prompt is the first message, so
the template renders once), its `tokenizer.chat_template` replaced in place (the header spliced,
the data section where it was). Crafted cases: the template bombs a fuzzer found running past
1.5 GB or 20 s or ending in an internal error (huge strings from `center`, `%` and `format`
widths, `~` doubling, `replace` rounds; macros recursing twice a level; `lipsum(10**6)`; 5,000
nested parentheses and 3,000 nested ifs) and their relatives; each must be refused in one line.
Random cases: a real model's template (tests/data/templates) with a few random edits (numbers
made huge, a span deleted or repeated, a hostile snippet inserted, the whole wrapped in a loop);
a clean error or a run are both fine, never a hang, a crash or a stray line.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Iterator

from fuzz_lies import gguf_splice  # bench/ is the script's folder
from fuzz_mutations import Mutation
from fuzz_seeds import REPO, Seed

TEMPLATE_KEY = "tokenizer.chat_template"
REAL_TEMPLATES = REPO / "tests" / "data" / "templates"

_TWICE = ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
          "{{ f(40) }}")
_LITERALS = ("{% set s = 'x' * 1000000 %}{% set a = [s, s, s, s, s, s, s, s] %}"
             "{% set b = [a, a, a, a, a, a, a, a] %}{% set c = [b, b, b, b, b, b, b, b] %}")

BOMBS = {
    "center": "{{ 'a'|center(10**9) }}",
    "printf_width": "{{ '%999999999d'|format(1) }}",
    "printf_precision": "{{ '%.999999999f' % 1.5 }}",
    "format_width": "{{ '{:>999999999}'.format('x') }}",
    "format_map_width": "{{ '{a:>999999999}'.format_map({'a': 1}) }}",
    "ns_doubled": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                  "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "plus_doubled": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "list_doubled": "{% set ns = namespace(l=['ab']) %}{% for i in range(64) %}"
                    "{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}",
    "replace_rounds": "{% set ns = namespace(s='a') %}{% for i in range(40) %}"
                      "{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}{{ ns.s }}",
    "ljust": "{{ 'a'.ljust(10**9) }}",
    "zfill": "{{ '1'.zfill(10**9) }}",
    "mul": "{{ 'x' * 10**10 }}",
    "list_mul": "{{ ['x' * 1000] * 10**6 }}",
    "pow": "{{ 7 ** 100000000 }}",  # Jinja's ** groups to the left: 7 ** 10**8 is 7**80
    "to_bytes": "{{ (1).to_bytes(10**9, 'big') }}",
    "indent": "{{ 'ab\ncd'|indent(10**9) }}",
    "batch_fill": "{{ ['x']|batch(10**9, 'y')|list }}",
    "join_sep": "{{ range(10)|join('x' * 10**7) }}",
    "fromkeys": "{{ {}.fromkeys(range(100000), 'x' * 1000000) }}",
    "nested_literals_out": _LITERALS + "{{ c }}",
    "nested_literals_json": _LITERALS + "{{ c|tojson }}",
    "nested_literals_concat": _LITERALS + "{{ '' ~ c }}",
    "tojson_indent": "{{ messages|tojson(indent=10**9) }}",
    "tojson_separators": "{{ ([0] * 1000)|tojson(separators=('x' * 1000000, ':')) }}",
    "output_loop": "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
    "macro_twice": _TWICE,
    "lipsum": "{{ lipsum(10**6) }}",
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "growing_dict": "{% set ns = namespace(d={}) %}{% set s = 'x' * 8000000 %}"
                    "{% for i in range(100000) %}{% set ns.d = dict(ns.d, **{i|string: s|upper}) %}"
                    "{% endfor %}{{ ns.d|length }}",
    "parens_5000": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
    "ifs_3000": "{% if true %}" * 3000 + "x" + "{% endif %}" * 3000,
    "brackets_5000": "{{ " + "[" * 5000 + "]" * 5000 + " }}",
    "source_2mb": "x" * (2 << 20),
    "internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "raise": "{{ raise_exception('no') }}",
}
"""Name -> template: each must be refused in one line."""

SNIPPETS = [
    "{{ 'a'|center(10**9) }}", "{% for i in range(100000) %}{{ messages }}{% endfor %}",
    "{% set ns.x = ns ~ ns %}", "{{ messages * 100000 }}", "{{ '%99999999s' % 'x' }}",
    "{% macro m(n) %}{{ m(n) }}{{ m(n) }}{% endmacro %}{{ m(1) }}", "{{ (", "{% if %}",
    "{% for m in messages %}{% for n in messages %}{{ m ~ n }}{% endfor %}{% endfor %}",
    "{{ messages|tojson(indent=1000) }}", "{{ lipsum(1000, max=10000) }}", "{{ 10 ** 10 ** 10 }}",
]


def with_template(seed: Seed, data: bytes, template: str) -> bytes:
    """The seed's GGUF bytes with `tokenizer.chat_template` set to `template`."""
    parts = seed.layout.kv[TEMPLATE_KEY]
    (length_at, length_size), (_, text_size) = parts[-2], parts[-1]
    text = template.encode("utf-8", "surrogatepass")
    return gguf_splice(data, seed.layout, length_at, length_size + text_size,
                       struct.pack("<Q", len(text)) + text)


def template_lies(seed: Seed) -> Iterator[tuple[str, Callable[[bytes], bytes], str]]:
    """The bombs, as (name, apply(data) -> data, expectation "refuse")."""
    for name, source in BOMBS.items():
        yield f"template.{name}", (lambda d, s=source: with_template(seed, d, s)), "refuse"


def _real_templates() -> list[str]:
    return [p.read_text() for p in sorted(REAL_TEMPLATES.glob("*.jinja"))]


def template_mutation(rng: random.Random, seed: Seed) -> Mutation:
    """A real template with one to three random edits (expectation "any")."""
    text = rng.choice(_real_templates())
    edits = []
    for _ in range(rng.randint(1, 3)):
        what = rng.choice(("huge_number", "delete", "repeat", "snippet", "wrap"))
        at = rng.randrange(len(text) + 1)
        if what == "huge_number":
            digits = [i for i, c in enumerate(text) if c.isdigit()]
            if digits:
                i = rng.choice(digits)
                text = text[:i] + rng.choice(("999999999", "10**9", "-1", "0")) + text[i + 1:]
        elif what == "delete":
            text = text[:at] + text[at + rng.randint(1, 200):]
        elif what == "repeat":
            span = text[at:at + rng.randint(1, 400)]
            text = text[:at] + span * rng.randint(2, 50) + text[at:]
        elif what == "snippet":
            text = text[:at] + rng.choice(SNIPPETS) + text[at:]
        else:
            text = "{% for i in range(" + str(rng.choice((10, 1000, 100000))) + ") %}" + text \
                   + "{% endfor %}"
        edits.append(what)
    data = with_template(seed, seed.files["model.gguf"], text)
    return Mutation(f"template.random[{'+'.join(edits)}]", "model.gguf", data, "any")
