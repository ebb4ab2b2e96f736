"""A Session: one prepared model and backend, and the one place that assembles a generation.

The command line (both modes), `Conversation`, the server's worker and scripts all drive
generations through a `Session`. It owns what each of them used to put together on its own:

- the step count (`steps` positions from `start_pos`, capped by `max_tokens` and the context);
- compiling, before a generation starts, the programs it will need (`CompilePlanning`);
- the prefill choice (the backend's batched `Prefill`, or token by token) and the decode mode
  (`auto` resolved to `loop` or `graph` by `jllama.generation.device_loop.decode_mode`);
- sampling only among the tokenizer's ids when the model has more logits than tokens;
- the end-of-generation ids (the tokenizer's `stop_ids`);
- the text of a stream with stop strings and log-probs (`jllama.generation.streaming.Completion`);
- a chat turn on top of all that (`chat`, a `Conversation`).

Example::

    from jllama import Session
    session = Session.open(seq_len=256)                   # the embedded stories260K
    for piece in session.complete("Once upon a time", temperature=0.0, max_tokens=32):
        print(piece.text, end="")
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from jllama.backends import prepared_backend
from jllama.backends.base import (
    Backend,
    CompilePlanning,
    Described,
    DeviceLoop,
    Prefill,
    PrefillLogits,
)
from jllama.generation.device_loop import DECODE_MODES, ConstrainedLoopDecoder, LoopDecoder, decode_mode
from jllama.errors import JllamaError
from jllama.generation.generate import Generation
from jllama.sampling import Sampler, SamplerConfig, restrict_to_vocabulary
from jllama.generation.session_slots import Slot, SlotsMixin
from jllama.generation.speculative import (
    DRAFTERS,
    SpeculativeDecoder,
    greedy,
    make_drafter,
    runc_sampled,
    verifier,
)
from jllama.generation.streaming import Completion, LogitsRecorder, Text

if TYPE_CHECKING:  # llguidance is imported where a grammar is used (it costs ~70 ms)
    from jllama.constrain import Grammar

PREFILL_MODES = ("chunked", "token")
"""chunked: a prompt goes through the backend's batched `prefill` where it has one; token: one
position at a time, as run.c."""


class Session(SlotsMixin):
    """A prepared model + backend + decoding plan.

    Args:
      model: a `jllama.model.loading.Model` (or anything with its `config`, `tokenizer`,
        `chat_template` and `source`).
      backend: a prepared backend for it (`jllama.backends.base.Backend`; the capability
        protocols beside it say what else it can do).
      decode: one of `jllama.generation.device_loop.DECODE_MODES`: auto, graph, fused (fixed when the
        backend was made) or loop.
      prefill: one of `PREFILL_MODES`.
      device_sampling: False where every generation brings its own sampler and the host
        samples (the server): auto then never picks the device loop.
      compile_ahead: compile each generation's programs before it starts (`compile_for`);
        False leaves them to compile where first run.
      draft: speculative decoding (`jllama.generation.speculative`): "none", "ngram",
        "ngram-pool" (n-grams shared by the session's generations, `jllama.generation.ngram`), or a
        `jllama.generation.draft_model.DraftModel` (`Session.prepare` also takes a checkpoint
        or self:q4 / self:int8 here and loads it); generations with run.c's sampler and no
        log-probs decode with drafts, to the same tokens (greedy) or the same distribution
        (sampled), under a grammar too (each row masked as plain decoding masks it).
      draft_tokens: the longest draft (1 .. 15).

    Raises:
      ValueError: an unknown decode or prefill mode, or drafter.
    """

    def __init__(self, model, backend: Backend, *, decode: str = "auto",
                 prefill: str = "chunked", device_sampling: bool = True,
                 compile_ahead: bool = True, draft="none", draft_tokens: int = 8):
        if decode not in DECODE_MODES:
            raise ValueError(f"decode={decode!r}; known: {', '.join(DECODE_MODES)}")
        if isinstance(draft, str) and draft not in DRAFTERS:
            raise ValueError(f"draft={draft!r}; known: {', '.join(DRAFTERS)}, or a DraftModel")
        self.draft, self.draft_tokens = draft, draft_tokens
        self.ngram_pool = None
        """The `NgramPool` every generation's drafter shares with draft="ngram-pool"."""
        if draft == "ngram-pool":
            from jllama.generation.ngram import NgramPool

            self.ngram_pool = NgramPool()
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill={prefill!r}; known: {', '.join(PREFILL_MODES)}")
        self.model = model
        self.backend = backend
        self.decode = decode
        self.prefill = prefill
        self.device_sampling = device_sampling
        self.compile_ahead = compile_ahead
        self._loops_compiled: set[tuple[str, bool]] = set()  # (kind, masked)
        self._default_slot = Slot(None)  # the caches `prepare` made: its `caches` once swapped
        self._current = self._default_slot
        self._slotted = False

    @classmethod
    def prepare(cls, model, backend: str | Backend = "jax", *, decode: str = "auto",
                matvec: str = "auto", devices: int = 1, cache_type_k="auto",
                cache_type_v="auto", say: Callable[[str], None] | None = None,
                weights_cache: bool = True, **options) -> Session:
        """The backend (a name or an unprepared one) prepared for `model` by
        `jllama.backends.prepared_backend` (its arguments and errors: decode, matvec, devices,
        cache_type_k, cache_type_v, say, weights_cache), then the session (**options: prefill,
        device_sampling, compile_ahead, draft, draft_tokens; a draft that names a checkpoint
        or self:q4 / self:int8, or a `Model` from `load_draft`, is prepared here, `open_draft`); `say` also gets the
        backend's notes."""
        started = time.perf_counter()
        backend_name = backend if isinstance(backend, str) else backend.name
        backend = prepared_backend(model, backend, decode=decode, matvec=matvec,
                                   devices=devices, cache_type_k=cache_type_k,
                                   cache_type_v=cache_type_v, say=say,
                                   weights_cache=weights_cache)
        draft = options.get("draft", "none")
        from jllama.generation.draft_model import DraftModel, open_draft

        if (isinstance(draft, str) and draft not in DRAFTERS  # a draft model: load it too
                or not isinstance(draft, (str, DraftModel))):  # one opened by `load_draft`
            options["draft"] = open_draft(draft, model, backend_name, matvec=matvec)
        session = cls(model, backend, decode=decode, **options)
        # prepare's time less its warm-up (the compile) is placing the weights on the device.
        session.place_seconds = time.perf_counter() - started - session.compile_seconds
        if say is not None and isinstance(backend, Described):
            for note in backend.notes():
                say(f"note: {note}")
        return session
    @classmethod
    def open(cls, checkpoint=None, tokenizer=None, *, seq_len: int | None = None,
             dtype: str | None = None, **options) -> Session:
        """`jllama.model.loading.open_model(checkpoint, tokenizer, seq_len, dtype=dtype)`, then
        `Session.prepare(model, **options)`: a session in one call (checkpoint None: the
        embedded stories260K)."""
        from jllama.model.loading import open_model

        return cls.prepare(open_model(checkpoint, tokenizer, seq_len=seq_len, dtype=dtype),
                           **options)

    place_seconds = 0.0
    """Seconds `prepare` spent converting and placing the weights (its compile not counted)."""

    @property
    def config(self):
        """The model's `ModelConfig` (seq_len: the context the KV cache holds)."""
        return self.model.config

    @property
    def tokenizer(self):
        """The model's tokenizer (`jllama.tokenizers.base.Tokenizer`)."""
        return self.model.tokenizer

    @property
    def compile_seconds(self) -> float:
        """Seconds the backend has spent compiling (0 for a backend that does not say)."""
        return self.backend.compile_seconds if isinstance(self.backend, CompilePlanning) else 0.0

    @property
    def padded(self) -> bool:
        """True when the model has more logits than the tokenizer has tokens (ids with no
        token are never sampled)."""
        return self.tokenizer.vocab_size < self.config.vocab_size

    def sampler(self, settings: SamplerConfig | Sampler | None = None, **values) -> Sampler:
        """A `Sampler` from `settings` or from keyword values (`SamplerConfig`'s fields); a
        Sampler given is returned as it is (it keeps its random state).

        Raises:
          SamplerError: a setting out of range.
        """
        if isinstance(settings, Sampler):
            return settings
        if settings is None:
            return Sampler(**values)
        return Sampler.from_config(settings)

    def decode_mode(self, sampler: Sampler | None, host_logits: bool = False) -> str:
        """The decode mode a generation with `sampler` runs in (`device_loop.decode_mode`)."""
        sampling = sampler.config if isinstance(sampler, Sampler) and self.device_sampling else None
        return decode_mode(self.decode, self.backend, sampling, self.padded, host_logits)

    def generate(self, prompt_ids: Sequence[int], sampler: Sampler | Callable[..., int],
                 steps: int | None = None, *, max_tokens: int | None = None,
                 start_pos: int = 0, context_ids: Sequence[int] = (),
                 started_at: float | None = None, host_logits: bool = False,
                 sample: Callable[..., int] | None = None, slot: Slot | None = None,
                 ignore_eos: bool = False, grammar: Grammar | None = None) -> Generation:
        """A `Generation` of `prompt_ids` from `start_pos`, its programs compiled.

        Args:
          prompt_ids: the tokens to feed, BOS included when wanted; at least one.
          sampler: a `Sampler` (the device loop samples with it where the decode mode is
            loop), or any `sample(logits[, history]) -> id` with a `uses_history` attribute.
          steps: positions to run from start_pos, prompt included (1 .. seq_len - start_pos);
            None: up to the end of the context, or len(prompt_ids) + max_tokens - 1 when
            max_tokens is given (the last token sampled is never fed back).
          max_tokens: the most tokens to generate (with steps None).
          start_pos: where the prompt starts; positions before it are kept in the cache (a
            conversation's earlier turns) and `context_ids` says what they hold.
          started_at: a `time.perf_counter()` reading `stats.first_token_seconds` counts from.
          host_logits: the caller reads each token's logits (log-probs): never the device loop.
          sample: what the host samples with instead of `sampler` itself (e.g. a
            `LogitsRecorder` around it).
          slot: the `Slot` (from `new_slot`) whose KV cache the generation runs in; None: the
            backend's own.
          ignore_eos: do not stop at the tokenizer's end-of-generation ids (benchmarks that
            want a fixed length, as llama.cpp's and vLLM's ignore_eos).
          grammar: a `jllama.constrain.Grammar` every generated token must keep to: a
            `ConstrainedSampler` masks the logits before `sample` sees them (log-probs are
            then over the allowed tokens) and the generation ends with the tokenizer's
            end-of-generation id once the grammar is complete (even with ignore_eos). In the
            loop decode mode the mask goes into the device loop, one token per call
            (`ConstrainedLoopDecoder`); the batched step never draws it; `generation.constraint`
            is the `ConstrainedSampler` (mask time).

        One sequence owns a KV cache at a time: an earlier generation in the same slot that
        has not finished cannot go on once this one starts (iterating it raises RuntimeError).

        Raises:
          ValueError: no prompt, a prompt longer than the context, steps out of range, or
            both steps and max_tokens.
          SamplerError: decode mode loop with a sampler it cannot run (`decode_mode`).
        """
        prompt_ids = [operator.index(t) for t in prompt_ids]
        seq_len = self.config.seq_len
        if not 0 <= start_pos < seq_len:
            raise ValueError(f"start_pos={start_pos} must be in 0..{seq_len - 1} (seq_len - 1)")
        room = seq_len - start_pos
        if len(prompt_ids) > room:
            raise ValueError(f"the prompt is {len(prompt_ids)} tokens, longer than the "
                             f"{room} positions left in the context (seq_len={seq_len})")
        if steps is not None and max_tokens is not None:
            raise ValueError("give steps or max_tokens, not both")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be at least 1")
        if steps is None:
            steps = room if max_tokens is None else min(room, len(prompt_ids) + max_tokens - 1)
        if not 1 <= steps <= room:
            raise ValueError(f"steps={steps} must be in 1..{room} (seq_len - start_pos)")
        slot = self._default_slot if slot is None else slot
        if slot.active is not None and not slot.active.finished:
            slot.active.supersede("another generation started in this KV cache (the Session's "
                                  "slot): it owns it now (finish one generation before the next)")
        self._use(slot)
        stop_ids = () if ignore_eos else tuple(self.tokenizer.stop_ids)
        vocabulary = None
        if grammar is not None:
            from jllama.constrain import ConstrainedSampler, vocabulary_for

            vocabulary = vocabulary_for(self.tokenizer, self.config.vocab_size)
            if vocabulary.end_id not in stop_ids:
                stop_ids += (vocabulary.end_id,)  # a complete grammar ends the generation
        loop = None
        speculation = plain = None
        # A padded vocabulary is masked on the host (restrict_to_vocabulary), so graph mode;
        # so is a grammar where the device loop takes no masks.
        masked = grammar is not None
        host_mask = masked and (self.padded or not (isinstance(self.backend, DeviceLoop)
                                                    and self.backend.loop_masks))
        if (self.draft != "none" and not host_logits and sample is None
                and (greedy(sampler) or runc_sampled(sampler))):
            plain = None
            if self.decode_mode(sampler, host_mask) == "loop":
                plain = LoopDecoder(self.backend, sampler, stop_ids)
                if (plain.kind, masked) not in self._loops_compiled and start_pos == 0:
                    self.backend.compile_loop(plain.kind, masked=masked)
                self._loops_compiled.add((plain.kind, masked))
                plain = self._bound(slot, plain)
            speculation = SpeculativeDecoder(
                self._bound(slot, verifier(self.backend)),
                make_drafter(self.draft, self.ngram_pool),
                [*context_ids, *prompt_ids], stop_ids, self.config.seq_len, self.draft_tokens,
                self.tokenizer.vocab_size if self.padded else None, plain,
                None if greedy(sampler) else sampler,
            )
        if speculation is not None:
            loop = speculation
        elif self.decode_mode(sampler, host_logits or host_mask) == "loop":
            loop = LoopDecoder(self.backend, sampler, stop_ids)
            if (loop.kind, masked) not in self._loops_compiled and start_pos == 0:
                # At position 0, before the sequence starts (it rewrites that position).
                self.backend.compile_loop(loop.kind, masked=masked)
            self._loops_compiled.add((loop.kind, masked))
        prefill = None
        if self.prefill == "chunked" and isinstance(self.backend, Prefill):
            prefill = self.backend.prefill
        if self.compile_ahead and isinstance(self.backend, CompilePlanning):
            # The prompt's chunk programs and the windows the decode grows into, now rather
            # than inside the timed prefill and in the middle of decoding.
            self.backend.compile_for(len(prompt_ids), start_pos + steps - 1,
                                     loop.kind if isinstance(loop, LoopDecoder) else None,
                                     chunked=prefill is not None, start=start_pos,
                                     masked=loop is not None and masked,
                                     **({"verify": True} if speculation is not None else {}))
        drawn_by = sampler if sample is None and isinstance(sampler, Sampler) else None
        sample = sample if sample is not None else sampler
        n_tokens = None
        if self.padded:
            n_tokens = self.tokenizer.vocab_size
            sample = restrict_to_vocabulary(sample, n_tokens)
        constraint = None
        if grammar is not None:
            constraint = sample = ConstrainedSampler(sample, grammar, vocabulary)
            drawn_by = None  # a batched draw would not see the mask
            if speculation is not None:  # rows masked, drafts cut by the same matcher
                if plain is not None:  # the masked device loop between drafts
                    plain = self._bound(slot, ConstrainedLoopDecoder(self.backend, sampler,
                                                                     stop_ids, constraint))
                speculation.constrain(constraint, plain)
            elif loop is not None:  # the device loop goes on with the same matcher
                loop = ConstrainedLoopDecoder(self.backend, sampler, stop_ids, constraint)
        sample = self._slot_sample(slot, drawn_by, sample, n_tokens)
        slot.generations += 1
        slot.active = Generation(
            self._slot_forward(slot), prompt_ids, sample, steps,
            stop_ids=stop_ids, start_pos=start_pos,
            prefill=None if prefill is None else self._bound(slot, prefill),
            decode_loop=None if loop is None else self._bound(slot, loop),
            context_ids=context_ids, started_at=started_at,
        )
        slot.active.constraint = constraint
        if speculation is not None:
            speculation.stats = slot.active.stats
        slot.active.speculation = speculation
        return slot.active

    def encode(self, prompt: str | Sequence[int], parse_special: bool = False) -> list[int]:
        """`prompt` as token ids: a text encoded by the tokenizer (BOS added where the model
        wants one), or ids as given.

        Raises:
          JllamaError: the prompt encodes to nothing (an empty text and no BOS).
        """
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, parse_special=parse_special)
        else:
            ids = [operator.index(t) for t in prompt]
        if not ids:
            raise JllamaError(f"the prompt is empty and {self.model.source} adds no BOS token")
        return ids

    def complete(self, prompt: str | Sequence[int], sampler: Sampler | SamplerConfig | None = None,
                 *, max_tokens: int | None = None, stop: Sequence[str] = (),
                 logprobs: int | None = None, cancelled: Callable[[], bool] | None = None,
                 slot: Slot | None = None, start_pos: int = 0, ignore_eos: bool = False,
                 each_token: bool = False, grammar: Grammar | None = None,
                 **sampling) -> Completion:
        """A raw completion of `prompt` as streamed text (`jllama.generation.streaming.Completion`).

        Args:
          prompt: a text (encoded with `encode`) or token ids.
          sampler: a `Sampler`, its `SamplerConfig`, or None: `Sampler(**sampling)`.
          max_tokens: the most tokens to generate; None: until the context is full.
          stop: stop strings, or one (the text ends before the first one found).
          logprobs: top log-probs per token (0: the chosen token's only), None: none.
          cancelled: checked before each token; True ends the stream.
          slot, start_pos, ignore_eos: as `generate` (prompt ids from start_pos, the positions
            before it kept in the slot's cache: a prefix shared with what it held).
          each_token: a piece for every token, empty when it releases no text yet
          (`Completion`'s each_token).
          grammar: a `jllama.constrain.Grammar` the generated text must match (`generate`);
            finish_reason is "stop" once it is complete.

        Returns:
          a `Completion`: iterate it for `Text` pieces; then its `finish_reason` ("stop" for
          an end-of-generation token or a stop string, "length", "cancelled") and its
          `generation` (ids, stats).

        Raises:
          ValueError: a prompt longer than the context, logprobs not an integer >= 0.
          TypeError: both a sampler and sampler settings.
          SamplerError: a sampler setting out of range.
        """
        if sampler is not None and sampling:
            raise TypeError(f"give a sampler or its settings ({', '.join(sampling)}), not both")
        if isinstance(stop, str):
            stop = [stop]  # one stop string, as OpenAI's API takes it
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or logprobs < 0):
            raise ValueError(f"logprobs={logprobs!r} must be an integer >= 0 (or None)")
        ids = self.encode(prompt)
        sampler = self.sampler(sampler, **sampling)
        recorder = LogitsRecorder(sampler) if logprobs is not None else None
        generation = self.generate(ids[start_pos:], sampler, max_tokens=max_tokens,
                                   host_logits=logprobs is not None, sample=recorder,
                                   slot=slot, start_pos=start_pos, context_ids=ids[:start_pos],
                                   ignore_eos=ignore_eos, grammar=grammar)
        return Completion(generation, self.tokenizer, stop=stop, logprobs=logprobs,
                          recorder=recorder, cancelled=cancelled, generation=generation,
                          each_token=each_token)

    def text(self, prompt: str | Sequence[int], sampler: Sampler | SamplerConfig | None = None,
             **options) -> str:
        """The whole completion of `prompt` as one string (`complete`'s arguments)."""
        return "".join(piece.text for piece in self.complete(prompt, sampler, **options))

    def logits_fn(self, ctx: int):
        """`logits(tokens, start_pos, first) -> f32[len(tokens) - first, vocab_size]`, the
        logits after each of tokens[first:] (`jllama.generation.perplexity.LogitsFn`): batched through
        the backend's `PrefillLogits` when prefill is chunked, else `forward` token by token;
        the programs for chunks of `ctx` tokens compiled first."""
        from jllama.generation.perplexity import forward_logits

        chunked = self.prefill == "chunked" and isinstance(self.backend, PrefillLogits)
        if self.compile_ahead and isinstance(self.backend, CompilePlanning):
            self.backend.compile_for(ctx, ctx - 1, chunked=chunked)
        return self.backend.prefill_logits if chunked else forward_logits(self.backend.forward)

    def chat(self, system_prompt: str | None = None, template=None, template_kwargs=None):
        """A new `jllama.generation.conversation.Conversation` over this session's KV cache (one at a
        time: a new one, or any other generation, starts the cache again from position 0).

        Args:
        A conversation owns the KV cache between its turns: when another generation of this
        session ran since its last turn, its next turn feeds the whole conversation again.

        Args:
          system_prompt: the first message's content, role "system" (None: the template's
            default).
          template: a `jllama.chat.ChatTemplate`; None: the model's own, with the
            tokenizer's BOS and EOS text (`ChatTemplate.for_tokenizer`).
          template_kwargs: more template variables for every turn (e.g.
            `{"enable_thinking": False}`); None: none.

        Raises:
          ChatError: the model has no chat template, or it does not compile.
        """
        from jllama.generation.conversation import Conversation
        from jllama.errors import ChatError

        if template is None and not self.model.chat_template:
            raise ChatError(f"{self.model.source} has no chat template: give one (a "
                            "jllama.chat.ChatTemplate)")
        return Conversation(self, template=template, system_prompt=system_prompt,
                            template_kwargs=template_kwargs)


__all__ = ["PREFILL_MODES", "Session", "Slot", "Text"]
