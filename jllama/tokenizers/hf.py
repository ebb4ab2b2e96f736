"""The tokenizer of a Hugging Face model folder (`tokenizer.json` and its companions).

Files read (Hugging Face `tokenizers`' serialization and transformers' side files):
  tokenizer.json          required: `model` (type "BPE": `vocab` text -> id, `merges` as
                          "a b" strings or [a, b] pairs, `byte_fallback`, `ignore_merges`),
                          `added_tokens` ({id, content, special, lstrip, rstrip, single_word}),
                          `normalizer`, `pre_tokenizer`, `post_processor`
  tokenizer_config.json   optional: `bos_token`, `eos_token` (a str, or {"content": str}),
                          `add_bos_token`, `chat_template`
  special_tokens_map.json optional: `bos_token`, `eos_token` when the config lacks them
  generation_config.json  optional: `eos_token_id` (int or list: every one ends a generation),
                          `bos_token_id` when no file names a BOS token
  config.json             optional: `bos_token_id`, `eos_token_id` as a last resort
  chat_template.jinja     optional: the chat template (it wins over tokenizer_config.json's)

Two kinds of `tokenizer.json` are understood (byte-level BPE, and SentencePiece-style BPE
with byte fallback) and built as jllama's own tokenizers by `jllama.tokenizers.hf_build`,
which says how; the `tokenizers` library is only the tests' oracle.

Anything else (another model type, a normalizer, an unknown pre-tokenizer, added tokens with
lstrip/rstrip/single_word) is a one-line `TokenizerError` naming what was found.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jllama.errors import TokenizerError
from jllama.platform.files import parse_json_object, require_regular_file
from jllama.tokenizers.bpe import END_OF_GENERATION_TEXTS, ByteLevelBPE
from jllama.tokenizers.hf_build import (
    BYTE_LEVEL_PRE_TOKENIZERS,
    Added,
    Parsed,
    byte_level_tokenizer,
    sentencepiece_tokenizer,
)
from jllama.tokenizers.spm import Tokenizer
from jllama.tokenizers.tiktoken_model import LLAMA3_STOP_TOKENS

__all__ = [
    "BYTE_LEVEL_PRE_TOKENIZERS", "CHAT_TEMPLATE_FILE", "GENERATION_CONFIG", "MODEL_CONFIG",
    "SPECIAL_TOKENS_MAP", "TOKENIZER_CONFIG", "TOKENIZER_JSON", "read_hf_chat_template",
    "read_hf_tokenizer",
]

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
MODEL_CONFIG = "config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def read_hf_tokenizer(folder: str | os.PathLike) -> ByteLevelBPE | Tokenizer:
    """Read the tokenizer of a Hugging Face model folder.

    Args:
      folder: the folder holding `tokenizer.json` (and optionally the other files listed in
        the module docstring).

    Returns:
      a `ByteLevelBPE` (byte-level vocabularies) or a llama2c `Tokenizer` (SentencePiece-style
      ones), with `source` the tokenizer.json path and:
        - bos_id / eos_id: `bos_token` / `eos_token` of tokenizer_config.json (else
          special_tokens_map.json, else the ids in generation_config.json, else config.json);
          without any BOS, bos_id = eos_id and BOS is never added;
        - add_bos: `add_bos_token` of tokenizer_config.json; when absent, whether the
          post-processor's TemplateProcessing puts BOS first (Llama 3);
        - stop_ids: EOS, every `eos_token_id` of generation_config.json, the end-of-turn tokens
          `ByteLevelBPE` knows by text, and Llama 3's `<|end_of_text|>`, `<|eom_id|>` and
          `<|eot_id|>`.

    Raises:
      TokenizerError: a missing folder or tokenizer.json, a file that is not JSON or not the
        expected shape, an unsupported model/normalizer/pre-tokenizer, special tokens that are
        not in the vocabulary. One line naming the file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        what = f"Hugging Face tokenizer folder {folder}"
        raise TokenizerError(f"{what}: {'not a folder' if folder.exists() else 'no such folder'}")
    path = folder / TOKENIZER_JSON
    data = _read_json(path, required=True)
    src = str(path)
    model = _field(data, "model", dict, src)
    kind = model.get("type", "BPE" if "merges" in model else None)
    if kind != "BPE":
        raise TokenizerError(
            f"{src}: model type {kind!r}; jllama reads BPE vocabularies only (byte-level, as "
            "GPT-2/Llama 3, or SentencePiece-style with byte fallback, as Llama 2)"
        )
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key) not in (None, ""):
            raise TokenizerError(f"{src}: model.{key} is {model[key]!r}; jllama supports none")

    tokens, specials = _vocabulary(model, data.get("added_tokens") or [], src)
    ids = _first_ids(tokens)
    side = _SideFiles.read(folder)
    bos_id = side.token_id("bos", ids, len(tokens))
    eos_id = side.token_id("eos", ids, len(tokens))
    if eos_id is None:
        raise TokenizerError(
            f"{folder}: no EOS token: none of {TOKENIZER_CONFIG}, {SPECIAL_TOKENS_MAP}, "
            f"{GENERATION_CONFIG}, {MODEL_CONFIG} names one"
        )
    first = _post_processor_first_token(data.get("post_processor"), ids, src)
    if bos_id is None:
        bos_id = first
    add_bos = side.config.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise TokenizerError(f"{side.config_path}: add_bos_token is {add_bos!r}, not a bool")
    if add_bos is None:
        add_bos = first is not None and first == bos_id
    if bos_id is None:
        bos_id, add_bos = eos_id, False
    stop = {eos_id, *side.eos_ids(len(tokens))}
    stop |= {ids[t] for t in (*LLAMA3_STOP_TOKENS, *END_OF_GENERATION_TEXTS) if t in ids}
    parsed = Parsed(
        data=data, model=model, tokens=tokens, specials=specials, merges=_merges(model, src),
        ids=ids, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, stop_ids=frozenset(stop),
        source=src,
    )
    if model.get("byte_fallback"):
        return sentencepiece_tokenizer(parsed)
    return byte_level_tokenizer(parsed)


def read_hf_chat_template(folder: str | os.PathLike) -> str | None:
    """The chat template of a Hugging Face model folder, or None if it has none.

    `chat_template.jinja` if present (transformers gives it priority), else `chat_template` of
    tokenizer_config.json: a str, or a list of {"name", "template"} from which "default" is
    taken.

    Raises:
      TokenizerError: a file that cannot be read or is not JSON, a chat_template of another
        shape, or a list without "default".
    """
    folder = Path(folder)
    jinja = folder / CHAT_TEMPLATE_FILE
    if jinja.exists():
        require_regular_file(jinja, f"chat template {jinja}", TokenizerError)
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"chat template {jinja}: cannot read: {e}") from None
    path = folder / TOKENIZER_CONFIG
    config = _read_json(path, required=False) or {}
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {}
        for item in template:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise TokenizerError(
                    f"{path}: chat_template list items must be {{name, template}} strings, got "
                    f"{item!r:.60}"
                )
            named[item["name"]] = item["template"]
        if "default" not in named:
            raise TokenizerError(
                f"{path}: chat_template has no 'default' template (it has: "
                f"{', '.join(named) or 'none'})"
            )
        return named["default"]
    raise TokenizerError(
        f"{path}: chat_template is {type(template).__name__}, expected a str or a list"
    )


# ---------------------------------------------------------------------- the files


def _read_json(path: Path, required: bool) -> Any:
    """Parsed JSON of `path`; None if it does not exist and is not required."""
    what = f"tokenizer {path}" if path.name == TOKENIZER_JSON else str(path)
    if not required and not path.exists():
        return None
    require_regular_file(path, what, TokenizerError)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TokenizerError(f"{what}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{what}: not UTF-8 text (byte {e.start})") from None
    return parse_json_object(text, what, TokenizerError)


def _field(obj: Mapping, key: str, kind: type, src: str, where: str = "") -> Any:
    value = obj.get(key)
    if not isinstance(value, kind):
        raise TokenizerError(
            f"{src}: {where}{key} is {type(value).__name__}, expected {kind.__name__}"
        )
    return value


def _token_text(value: Any) -> str | None:
    """A special token as transformers writes it: a str, or {"content": str, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True)
class _SideFiles:
    """The optional JSON files beside tokenizer.json (empty dicts for those absent)."""

    folder: Path
    config: dict
    special_map: dict
    generation: dict
    model_config: dict

    @property
    def config_path(self) -> Path:
        return self.folder / TOKENIZER_CONFIG

    @classmethod
    def read(cls, folder: Path) -> _SideFiles:
        return cls(
            folder,
            *(_read_json(folder / name, required=False) or {}
              for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, GENERATION_CONFIG, MODEL_CONFIG)),
        )

    def token_id(self, name: str, ids: Mapping[str, int], n: int) -> int | None:
        """The id of the `{name}_token`, by text from the tokenizer files, else by id."""
        for file, values in ((TOKENIZER_CONFIG, self.config),
                             (SPECIAL_TOKENS_MAP, self.special_map)):
            raw = values.get(f"{name}_token")
            if raw is None:
                continue
            text = _token_text(raw)
            if text is None:
                raise TokenizerError(
                    f"{self.folder / file}: {name}_token is {raw!r:.60}, not a token text"
                )
            if text not in ids:
                raise TokenizerError(
                    f"{self.folder / file}: {name}_token {text!r} is not a token of "
                    f"{TOKENIZER_JSON}"
                )
            return ids[text]
        for file, values in ((GENERATION_CONFIG, self.generation),
                             (MODEL_CONFIG, self.model_config)):
            found = _ids(values.get(f"{name}_token_id"), self.folder / file, name, n)
            if found:
                return found[0]
        return None

    def eos_ids(self, n: int) -> list[int]:
        """Every `eos_token_id` of generation_config.json."""
        return _ids(self.generation.get("eos_token_id"), self.folder / GENERATION_CONFIG, "eos", n)


def _ids(value: Any, path: Path, name: str, n: int) -> list[int]:
    """An `*_token_id` value (None, an int, or a list of ints) as a list of ids in range."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < n:
            raise TokenizerError(
                f"{path}: {name}_token_id {value!r:.60} is not an id of the {n}-token vocabulary"
            )
    return list(values)


# ---------------------------------------------------------------------- tokenizer.json


def _first_ids(tokens: Sequence[str | None]) -> dict[str, int]:
    """Token text -> the lowest id with that text."""
    ids: dict[str, int] = {}
    for i, text in enumerate(tokens):
        if text is not None:
            ids.setdefault(text, i)
    return ids



MAX_UNNAMED_IDS = 1 << 20
"""The most ids below a tokenizer.json's largest id that no token may leave unnamed."""


def _vocabulary(
    model: Mapping, added: Sequence, src: str
) -> tuple[list[str | None], list[Added]]:
    """Token texts by id (None for ids neither the vocabulary nor an added token names), and
    the added tokens."""
    vocab = _field(model, "vocab", dict, src, "model.")
    if not vocab:
        raise TokenizerError(f"{src}: model.vocab is empty")
    by_id: dict[int, str] = {}
    for text, i in vocab.items():
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise TokenizerError(f"{src}: model.vocab[{text!r:.40}] is {i!r}, not a token id")
        if i in by_id:
            raise TokenizerError(
                f"{src}: model.vocab gives id {i} to both {by_id[i]!r:.40} and {text!r:.40}"
            )
        by_id[i] = text
    if not isinstance(added, list):
        raise TokenizerError(f"{src}: added_tokens is {type(added).__name__}, expected a list")
    extra = []
    for k, item in enumerate(added):
        if not (isinstance(item, dict) and isinstance(item.get("content"), str)
                and isinstance(item.get("id"), int) and item["id"] >= 0):
            raise TokenizerError(
                f"{src}: added_tokens[{k}] is not an {{id, content}} object: {item!r:.60}"
            )
        for flag in ("lstrip", "rstrip", "single_word"):
            if item.get(flag):
                raise TokenizerError(
                    f"{src}: added token {item['content']!r} has {flag}=true, which jllama does "
                    "not support"
                )
        extra.append(Added(item["content"], item["id"], bool(item.get("special"))))
        by_id[item["id"]] = item["content"]
    # The table below has an entry per id up to the largest: checked first, or a crafted id of
    # 10^12 asks for terabytes. Real vocabularies leave a few ids unnamed, never millions.
    top = max(by_id)
    if top >= len(by_id) + MAX_UNNAMED_IDS:
        raise TokenizerError(
            f"{src}: token id {top} ({by_id[top]!r:.40}) is beyond the {len(by_id)} tokens the "
            f"file names by more than {MAX_UNNAMED_IDS} ids (a damaged or crafted file)"
        )
    tokens: list[str | None] = [None] * (top + 1)
    for i, text in by_id.items():
        tokens[i] = text
    return tokens, extra


def _merges(model: Mapping, src: str) -> list[tuple[str, str]]:
    merges = model.get("merges", [])
    if not isinstance(merges, list):
        raise TokenizerError(f"{src}: model.merges is {type(merges).__name__}, expected a list")
    out = []
    for rank, merge in enumerate(merges):
        if isinstance(merge, str):
            pair = merge.split(" ")
        elif isinstance(merge, list):
            pair = merge
        else:
            pair = None
        if not pair or len(pair) != 2 or not all(isinstance(p, str) and p for p in pair):
            raise TokenizerError(f"{src}: model.merges[{rank}] {merge!r:.60} is not two tokens")
        out.append((pair[0], pair[1]))
    return out


def _post_processor_first_token(node: Any, ids: Mapping[str, int], src: str) -> int | None:
    """The id of the special token a TemplateProcessing puts before a single sequence, if any
    (searched inside a Sequence of processors)."""
    if not isinstance(node, dict):
        return None
    if node.get("type") == "Sequence":
        for child in node.get("processors") or []:
            found = _post_processor_first_token(child, ids, src)
            if found is not None:
                return found
        return None
    if node.get("type") != "TemplateProcessing":
        return None
    single = node.get("single") or []
    head = single[0] if single and isinstance(single[0], dict) else {}
    special = head.get("SpecialToken")
    if not isinstance(special, dict):
        return None
    name = special.get("id")
    table = node.get("special_tokens")
    entry = table.get(name) if isinstance(table, dict) else None
    token_ids = entry.get("ids") if isinstance(entry, dict) else None
    if isinstance(token_ids, list) and len(token_ids) == 1 and isinstance(token_ids[0], int):
        return token_ids[0]
    if name in ids:
        return ids[name]
    raise TokenizerError(f"{src}: post_processor adds {name!r:.40}, which is not a token")


