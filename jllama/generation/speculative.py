"""Speculative decoding whose output is the plain decode's, bit for bit: drafted tokens checked
by one verification call over consecutive positions (`jllama.backends.base.Verify`), each row's
logits the bits `forward` gives for that position alone.

A greedy generation's next token is run.c's argmax of the logits at its position. Given a
draft d1 .. dk of what follows `token` at `pos`, one call computes the logits of
[token, d1, .., dk] at pos .. pos + k; the target's tokens g0, g1, .. are their argmaxes, and
g_r is accepted as the next token whenever every draft before it matched (d_i == g_{i-1} for
i <= r): then the rows up to r saw exactly the tokens plain decoding would have fed, so g_r is
plain decoding's token. The first mismatch ends the run (its g is still the right token, from
a row whose inputs were right); the cache positions after it hold rejected tokens' keys and
are written over by the next call before anything reads them (attention at a position reads
positions up to it only). So the tokens are plain greedy decoding's, whatever the drafts.

A sampled generation (run.c's sampler at a temperature above 0) accepts a drafted token d
with probability p(d) under the sampler's distribution p and otherwise draws from p without
d, renormalised: the speculative sampling rule for a one-hot draft, so each token's
distribution is exactly the sampler's. Its random stream (the sampler's own generator): one
coin per drafted token tested, one more for a draw (a rejection's, or a row without a draft);
the plain stretches draw as the sampler does, one coin a token. A seeded sampled generation
with drafts is reproducible; its tokens are not those of the same seed without drafts (only
their distribution is).

Under a grammar (a `jllama.constrain.ConstrainedSampler`) each row's logits are masked by the
grammar's state after the tokens before it, as plain constrained decoding masks them: the
matcher consumes the row's chosen token before the next row's mask is computed, and since a
row is only reached when every draft before it was accepted, its state is the one plain
decoding would reach; the rejected tail is never consumed, so nothing needs rolling back. A
draft is first cut at the first token the grammar forbids (llguidance's `validate_tokens`,
which leaves the matcher as it is): such a token would be rejected anyway (greedy: the masked
argmax is never a forbidden id; sampled: its masked probability is 0). So greedy constrained
ids are plain constrained decoding's, and a sampled token's distribution is the masked one.

Drafters:

  NgramDrafter  prompt lookup: the tokens that followed the latest earlier occurrence of the
                sequence's last n tokens (n from `max_n` down to `min_n`); free to compute,
                right where a reply repeats its prompt (editing, code, quoting).

`SpeculativeDecoder` is a `decode_loop(token, pos, n) -> (ids, finite)` for
`jllama.generation.generate.Generation`: each call returns the accepted tokens of one
verification (1 .. k + 1 of them). The draft length adapts: it grows by one after a draft
accepted whole and halves after one rejected at its first token (and after a one-token draft
is rejected, drafting rests for `REST_CALLS` calls); where the drafter finds nothing the
generation's plain decode runs (`plain`), so text that does not repeat costs what plain
decoding costs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jllama.backends.base import Verify
from jllama.generation.device_loop import runc_settings_only
from jllama.generation.generate import GenerationStats
from jllama.generation.ngram import NgramDrafter
from jllama.sampling import Sampler, argmax, softmax
from jllama.sampling.runc import first_above, nucleus

DRAFTERS = ("none", "ngram", "ngram-pool")
"""What `--draft` takes besides a draft model (ngram, ngram-pool: `jllama.generation.ngram`)."""

REST_CALLS = 4
"""Calls decoded without drafts after a one-token draft is rejected (text that does not
repeat: each rejected draft costs a verification of two rows for one token)."""

MAX_DRAFT_TOKENS = 15
"""The most tokens one draft proposes (the verification program's largest row count, 16,
less the token fed)."""


def make_drafter(draft, pool=None):
    """A new drafter for one generation: `draft` is "none" (None), "ngram", "ngram-pool" (a
    `PooledNgramDrafter` reading and adding to `pool`, the session's `NgramPool`; a new one if
    None) or a `jllama.generation.draft_model.DraftModel` (a `ModelDrafter` on a KV cache of
    its own).

    Raises:
      ValueError: an unknown name.
    """
    from jllama.generation.draft_model import DraftModel, ModelDrafter

    if isinstance(draft, DraftModel):
        return ModelDrafter(draft)
    if draft == "none":
        return None
    if draft == "ngram":
        return NgramDrafter()
    if draft == "ngram-pool":
        from jllama.generation.ngram import NgramPool, PooledNgramDrafter

        return PooledNgramDrafter(NgramPool() if pool is None else pool)
    raise ValueError(f"draft={draft!r}; known: {', '.join(DRAFTERS)}, or a draft model")


def runc_sampled(sampler) -> bool:
    """Whether `sampler` draws exactly run.c's way at a temperature above 0 (temperature, then
    top_p; no penalty or bias): its distribution is `runc_distribution`'s."""
    return (isinstance(sampler, Sampler) and sampler.runc_settings is not None
            and sampler.runc_settings[0] != 0)


def runc_distribution(logits: np.ndarray, temperature: np.float32,
                      top_p: np.float32) -> np.ndarray:
    """The distribution run.c's sampler draws the next token from: f64[vocab_size], softmax of
    logits / temperature (float32, as run.c), restricted to the nucleus of `sample_topp` and
    renormalised where 0 < top_p < 1 (the most likely token alone where no token reaches
    run.c's cutoff)."""
    probs = softmax(np.asarray(logits, np.float32) / np.float32(temperature))
    out = probs.astype(np.float64)
    if 0 < top_p < 1 and probs.shape[0] > 1:
        found = nucleus(probs, np.float32(top_p))
        out = np.zeros(probs.shape[0], np.float64)
        if found is None:
            out[int(np.argmax(probs))] = 1.0
        else:
            kept, cdf = found
            out[kept] = probs[kept].astype(np.float64) / np.float64(cdf[-1])
    return out


def draw(probs: np.ndarray, coin: np.float32) -> int:
    """The first token whose cumulative probability exceeds `coin` (`probs`: f64, summing to
    1 up to rounding)."""
    return first_above(np.cumsum(probs), np.float64(coin))


def greedy(sampler) -> bool:
    """Whether `sampler` draws run.c's argmax: a `Sampler` at temperature 0 with run.c's
    settings only (a repetition penalty or the like reads more than the logits)."""
    return (isinstance(sampler, Sampler) and sampler.config.temperature == 0
            and runc_settings_only(sampler.config))


def verifier(backend) -> Callable[[Sequence[int], int], np.ndarray]:
    """`verify(tokens, start_pos) -> f32[R, vocab]` of `backend`: its own (`Verify`), or
    `forward` one position at a time (the same logits, no faster)."""
    if isinstance(backend, Verify):
        return backend.verify
    forward = backend.forward

    def one_at_a_time(tokens: Sequence[int], start_pos: int) -> np.ndarray:
        return np.stack([forward(t, start_pos + r) for r, t in enumerate(tokens)])

    return one_at_a_time


class SpeculativeDecoder:
    """`decode_loop(token, pos, n) -> (ids, finite)` for a greedy `Generation`: `token` fed at
    `pos` with a draft after it in one `verify` call, the accepted tokens returned.

    Args:
      verify: `verify(tokens, start_pos) -> f32[R, vocab]` (`jllama.backends.base.Verify`, or
        `forward` per token where the backend has none: the same tokens, no faster).
      drafter: an `NgramDrafter` (anything with `draft(history, k) -> list[int]`).
      history: the tokens at positions 0 .. (context and prompt): what the drafter reads.
      stop_ids: tokens that end the generation (none drafted past one).
      seq_len: the context: no position at or past it is fed.
      max_draft: the longest draft (1 .. MAX_DRAFT_TOKENS).
      n_logits: the logits that are tokens (a padded vocabulary's tail is never chosen), or
        None for all of them.
      sampler: None for greedy decoding (argmaxes, bit-exact); a `Sampler` drawing run.c's
        way (`runc_sampled`) for sampled decoding with the accept/reject rule below.
      constraint: the generation's `jllama.constrain.ConstrainedSampler`, or None (set with
        `constrain` once it exists): rows masked and drafts cut by its grammar.
      plain: the generation's own `decode_loop` without drafts (the device loop, greedy), for
        stretches where nothing is drafted: 2, 4, 8, 16 tokens a call while no draft is
        accepted (its tokens are the same argmaxes), so text that does not repeat decodes at
        the plain loop's speed. None: one `verify` of one token.
    """

    def __init__(self, verify: Callable[[Sequence[int], int], np.ndarray], drafter,
                 history: Sequence[int], stop_ids: Sequence[int], seq_len: int,
                 max_draft: int = 8, n_logits: int | None = None,
                 plain: Callable[[int, int, int], tuple[list[int], bool]] | None = None,
                 sampler: Sampler | None = None, constraint=None):
        if not 1 <= max_draft <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens={max_draft} must be in 1..{MAX_DRAFT_TOKENS}")
        self._verify, self._drafter = verify, drafter
        self.history = [int(t) for t in history]
        self._stop_ids = frozenset(stop_ids)
        self._seq_len = seq_len
        self.max_draft = max_draft
        self.k = min(4, max_draft)
        self._n_logits = n_logits
        self._plain = plain
        self._sampler = sampler
        self.constraint = None
        if constraint is not None:
            self.constrain(constraint)
        self._misses = 0  # plain calls since a draft was last accepted
        self._rest = 0  # calls left before drafting again, after drafts that failed
        self.calls = 0
        self.enabled: Callable[[], bool] | None = None
        """Asked before each call where set (a scheduler: only while the sequence decodes
        alone); False: the generation takes its next token from one `forward` instead (the
        batched step's row), the same token."""
        self.stats = GenerationStats()
        """Where drafted and accepted tokens are counted: the generation's own stats once
        `Session.generate` hands them over."""

    def constrain(self, constraint, plain=None) -> None:
        """Keep the generation to `constraint`'s grammar (a `ConstrainedSampler` whose matcher
        has consumed every token generated so far): rows masked, drafts cut; `plain` replaces
        the plain decode (the constrained device loop, which consumes its own tokens), or None
        (one `verify` of one token, masked here). A drafter with a `constraint` attribute (a
        draft model) is given it too, to draft only what the grammar allows."""
        self.constraint = constraint
        self._plain = plain
        if hasattr(self._drafter, "constraint"):
            self._drafter.constraint = constraint

    def active(self) -> bool:
        """Whether the generation's next tokens come from this decoder (`enabled`)."""
        return self.enabled is None or self.enabled()

    def __call__(self, token: int, pos: int, n: int) -> tuple[list[int], bool]:
        history = self.history
        del history[pos:]  # positions 0 .. pos - 1 hold what was fed; `token` goes at pos
        history.append(int(token))
        room = min(n, self._seq_len - pos) - 1  # draft tokens the call may feed after token
        draft = []
        if room > 0 and self._rest == 0:
            draft = self._drafter.draft(history, min(self.k, room))
        self._rest = max(0, self._rest - 1)
        for i, drafted in enumerate(draft):
            if drafted in self._stop_ids:  # a run ends at a stop token: feed none
                del draft[i:]
                break
        constraint = self.constraint
        if draft and constraint is not None:
            # A token the grammar forbids would be rejected: verify none from it on.
            del draft[constraint.valid_prefix(draft):]
        if not draft and self._plain is not None:
            # 2, 4, 8, 16, 16, .. tokens a call while nothing is drafted (and accepted).
            self._misses += 1
            ids, finite = self._plain(token, pos, min(n, 1 << min(self._misses, 4)))
            self.calls += 1
            history.extend(ids[:-1])
            return ids, finite
        rows = np.asarray(self._verify([int(token), *draft], pos))
        ids: list[int] = []
        for r in range(len(draft) + 1):
            logits = rows[r] if self._n_logits is None else rows[r][:self._n_logits]
            if not np.isfinite(logits).all():
                return ids, False
            proposed = draft[r] if r < len(draft) else None
            chosen = self._choose(logits, proposed)
            ids.append(chosen)
            if chosen in self._stop_ids or proposed is None or chosen != proposed:
                break
        # ids[:-1] matched the draft; the last is the target's own (the draft holds no stop
        # token, so a stop token ending the run is never a match).
        self._adapt(len(draft), len(ids) - 1)
        history.extend(ids[:-1])
        return ids, True

    def _choose(self, logits: np.ndarray, proposed: int | None) -> int:
        """The token at a row: the argmax, or `_sampled`'s, of the logits masked by the
        grammar's state after the rows before it (the matcher then consumes it); once the
        grammar is done, its end-of-generation id with nothing drawn (`ConstrainedSampler`'s
        rule)."""
        constraint = self.constraint
        if constraint is not None:
            from jllama.constrain.sampler import masked  # llguidance only where a grammar is

            bits = constraint.next_mask()
            if bits is None:
                chosen = constraint.vocabulary.end_id
                constraint.consume(chosen)
                return chosen
            logits = masked(logits, bits)
        chosen = int(argmax(logits)) if self._sampler is None else self._sampled(logits, proposed)
        if constraint is not None:
            constraint.consume(chosen)
        return chosen

    def _sampled(self, logits: np.ndarray, proposed: int | None) -> int:
        """The token at a row of a sampled generation: a drafted token `proposed` is
        accepted with probability p(proposed) under the sampler's distribution p (one coin);
        otherwise (or with no draft) the token is drawn from p with the rejected token's mass
        removed and renormalised (one more coin). The draft is one-hot, so this is the
        speculative sampling rule (accept with min(1, p/q), resample from norm(max(p - q, 0)))
        and the token's distribution is exactly p."""
        temperature, top_p = self._sampler.runc_settings
        probs = runc_distribution(logits, temperature, top_p)
        rng = self._sampler.rng
        if proposed is not None:
            if rng.random_f32() < probs[proposed]:
                return proposed
            probs[proposed] = 0.0
            probs /= probs.sum()
        return draw(probs, rng.random_f32())

    def _adapt(self, drafted: int, accepted: int) -> None:
        self.calls += 1
        if not drafted:
            return
        self.stats.drafted_tokens += drafted
        self.stats.accepted_tokens += accepted
        if accepted:
            self._misses = 0
        if accepted == drafted:
            self.k = min(2 * self.k, self.max_draft)
        elif accepted == 0:
            if self.k == 1:
                self._rest = REST_CALLS  # one-token drafts fail too: rest from drafting
            self.k = max(1, self.k // 2)
