"""Serving many requests with one model: `Scheduler` (slots, admission, round-robin steps,
prefix reuse) and `complete_all` (a list of prompts in, their completions out)."""

from jllama.engine.scheduler import Request, Scheduler, Stream, complete_all

__all__ = ["Request", "Scheduler", "Stream", "complete_all"]
