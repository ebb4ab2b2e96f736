"""The fuzz harness's plan (bench/fuzz.py): which cases a run holds and in which order, the same
for the same --seed: the seeds as they are, every crafted lie, then random mutations.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

from fuzz_lies import (  # bench/ is the script's folder
    config_lies, gguf_lies, llama2c_lies, safetensors_lies, tokenizer_bin_lies,
    tokenizer_json_lies)
from fuzz_mutations import (
    Mutation, gguf_field_lie, json_value_lie, llama2c_field_lie, random_damage,
    safetensors_entry_lie)
from fuzz_seeds import Seed
from fuzz_templates import template_lies, template_mutation


@dataclasses.dataclass(frozen=True)
class Case:
    """One input to run: a seed and how to damage it.

    Attributes:
      index: its number in the run (cases are numbered in plan order).
      kind: the reader under test (one of fuzz_seeds.KINDS).
      seed: the seed's name.
      make: builds the mutation when the case starts (a run of thousands of cases never holds
        their files at once); None runs the seed itself.
    """

    index: int
    kind: str
    seed: str
    make: Callable[[], Mutation] | None


def crafted(seeds: dict[str, Seed], kinds: tuple[str, ...]) -> list[tuple[str, str, Callable]]:
    """Every crafted lie once, as (kind, seed name, make): deterministic (lies draw no random
    numbers)."""
    out = []

    def lie(kind, seed, target, name, apply, expect):
        def make():
            return Mutation(name, target, apply(seed.files[target]), expect)

        out.append((kind, seed.name, make))

    if "gguf" in kinds:
        for name, apply, expect in gguf_lies(seeds["gguf"]):
            lie("gguf", seeds["gguf"], "model.gguf", name, apply, expect)
    for seed in (seeds["llama2c-v0"], seeds["llama2c-v2"]):
        if "llama2c" in kinds:
            for name, apply, expect in llama2c_lies(seed):
                lie("llama2c", seed, "model.bin", f"{name} (v{seed.name[-1]})", apply, expect)
        if "tokenizer_bin" in kinds and seed.name == "llama2c-v0":
            for name, apply, expect in tokenizer_bin_lies(seed):
                lie("tokenizer_bin", seed, "tokenizer.bin", name, apply, expect)
    if "hf" in kinds:
        for lies in (config_lies, tokenizer_json_lies, safetensors_lies):
            for target, name, apply, expect in lies(seeds["hf"]):
                lie("hf", seeds["hf"], target, name, apply, expect)
    if "template" in kinds:
        for name, apply, expect in template_lies(seeds["template"]):
            lie("template", seeds["template"], "model.gguf", name, apply, expect)
    # Every file of every seed missing, and empty.
    owners = {"model.gguf": "gguf", "model.bin": "llama2c", "tokenizer.bin": "tokenizer_bin"}
    for seed in seeds.values():
        if seed.name in ("llama2c-v2", "template"):
            continue  # their files are llama2c-v0's and gguf's again
        for target in seed.files:
            kind = owners.get(target, "hf")
            if kind in kinds:
                optional = target.endswith("tokenizer_config.json")  # transformers: optional
                lie(kind, seed, target, f"file.missing[{target}]", lambda d: None,
                    "any" if optional else "refuse")
                lie(kind, seed, target, f"file.empty[{target}]", lambda d: b"", "refuse")
    return out


def random_mutation(rng: random.Random, seeds: dict[str, Seed],
                    kind: str) -> tuple[str, Callable[[], Mutation]]:
    """A random case for `kind`, as (seed name, make): random damage to one of the kind's
    files, or a third of the time a random header field set to an interesting value (for a
    JSON file, half the time a hostile value somewhere in it). Each case draws its damage
    from a generator of its own when it is made, so the plan holds no file bytes."""
    if kind == "template":
        own_seed = rng.randrange(2**63)
        return "template", lambda: template_mutation(random.Random(own_seed), seeds["template"])
    if kind in ("gguf", "hf"):
        seed = seeds[kind]
    else:
        seed = seeds[rng.choice(("llama2c-v0", "llama2c-v2"))]
    target = {"gguf": "model.gguf", "llama2c": "model.bin",
              "tokenizer_bin": "tokenizer.bin"}.get(kind) or rng.choice(sorted(seed.files))
    structural = {"model.gguf": gguf_field_lie, "model.bin": llama2c_field_lie,
                  "hf/model.safetensors": safetensors_entry_lie}.get(target)
    if target.endswith(".json"):
        def structural(r, s):
            return json_value_lie(r, s, target)
    use_structural = structural is not None and rng.random() < (
        0.5 if target.endswith(".json") else 1 / 3)
    own_seed = rng.randrange(2**63)

    def make():
        r = random.Random(own_seed)
        if use_structural:
            return structural(r, seed)
        return random_damage(r, seed, target)

    return seed.name, make


def plan(seeds: dict[str, Seed], n: int, seed: int, kinds: tuple[str, ...]) -> list[Case]:
    """The cases of a run: each seed as it is (they must run), every crafted lie, then random
    mutations, the kinds in turn, up to `n` (when n is smaller, a seeded sample of those)."""
    rng = random.Random(seed)
    firsts = [("gguf", "gguf"), ("llama2c", "llama2c-v0"), ("llama2c", "llama2c-v2"),
              ("hf", "hf"), ("template", "template")]
    cases = [(k, s, None) for k, s in firsts if k in kinds]
    lies = crafted(seeds, kinds)
    room = max(0, n - len(cases))
    cases += lies if len(lies) <= room else rng.sample(lies, room)
    while len(cases) < n:
        kind = kinds[len(cases) % len(kinds)]
        cases.append((kind, *random_mutation(rng, seeds, kind)))
    return [Case(i, k, s, make) for i, (k, s, make) in enumerate(cases[:n])]


@dataclasses.dataclass
class Running:
    """A started case: its process, its input and output folder, and what it was given."""

    case: Case
    mutation: Mutation | None  # without its data (written already)
    folder: Path
    argv: list[str]
    pid: int
    started: float
    rss_offset_kib: int = 0  # see `seed_peak_kib`
    killed: str | None = None
