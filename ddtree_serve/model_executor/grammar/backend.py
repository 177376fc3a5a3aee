"""Grammar compilation for structured outputs (xgrammar, https://github.com/mlc-ai/xgrammar).

Two stages:
- ``check_grammar`` parses a constraint without a tokenizer (milliseconds): it runs in
  ``SamplingParams.validate``, so a schema, regex or EBNF that cannot compile is a ValueError at admission
  (an HTTP 400), never a failed step.
- ``GrammarBackend.submit`` compiles it against the tokenizer (the per-token mask tables) on a worker
  thread, off the scheduler's step; the scheduler holds the request back until its future resolves.
  Compiled grammars are cached by ``(kind, text)`` (the future itself, so concurrent requests with the same
  schema share one compilation).

JSON schemas compile with ``any_whitespace=False``: one line, separators ``", "`` and ``": "`` (a small
model given free whitespace can emit newlines until max_tokens); ``{"type": "object"}`` (what the server
sends for ``response_format: json_object``) allows any JSON object. Properties follow the schema's order
(xgrammar's strict mode: no properties beyond those the schema names).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)


def check_grammar(kind: str, text: str) -> None:
    """Raise ValueError (starting with ``kind``, the field name, then xgrammar's reason) when the constraint
    cannot compile."""
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
        else:
            raise ValueError(f"unknown grammar kind {kind!r}")
    except RuntimeError as e:
        raise ValueError(f"{kind} cannot be compiled: {_reason(e)}") from None


def _reason(e: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix (``[time] file.cc:line: ``)."""
    msg = str(e).strip()
    if msg.startswith("[") and ".cc:" in msg:
        msg = msg.split(": ", 1)[-1]
    return msg.splitlines()[0] if msg else type(e).__name__


class GrammarBackend:
    """Compiles constraints for one tokenizer and vocabulary. ``vocab_size`` is the model's (lm_head rows,
    possibly padded past the tokenizer); ids the tokenizer does not know are never allowed.
    ``stop_token_ids``: the tokens a complete grammar allows (the model's EOS ids). ``tokenizer``: a Hugging
    Face tokenizer, or a callable returning one: the tokenizer tables (seconds for a large vocabulary) are
    then built on the worker thread with the first compilation, not at start-up."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], max_cached: int = 256,
                 threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._tokenizer = tokenizer
        self._threads = threads
        self.compiler = None  # xgrammar.GrammarCompiler, built on the worker thread
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.max_cached = max_cached
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()

    @classmethod
    def from_model_path(cls, model_path: str, vocab_size: int, stop_token_ids: tuple[int, ...],
                        trust_remote_code: bool = False) -> GrammarBackend:
        def load():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)

        return cls(load, vocab_size, stop_token_ids)

    def _ensure_compiler(self):
        if self.compiler is None:
            import xgrammar as xgr

            tok = self._tokenizer() if callable(self._tokenizer) and not hasattr(self._tokenizer, "get_vocab") \
                else self._tokenizer
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.stop_token_ids) or None)
            self.compiler = xgr.GrammarCompiler(info, max_threads=self._threads)
        return self.compiler

    def submit(self, kind: str, text: str) -> Future:
        """A future of the ``xgrammar.CompiledGrammar`` (its exception: a ValueError naming the reason)."""
        key = (kind, text)
        fut = self.cache.get(key)
        if fut is not None:
            self.cache.move_to_end(key)
            return fut
        fut = self.pool.submit(self._compile, kind, text)
        self.cache[key] = fut
        while len(self.cache) > self.max_cached:
            self.cache.popitem(last=False)
        return fut

    def compile(self, kind: str, text: str):
        """Synchronous compile (tests, warm-up); cached like ``submit``."""
        return self.submit(kind, text).result()

    def _compile(self, kind: str, text: str):
        compiler = self._ensure_compiler()
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf":
                return compiler.compile_grammar(text)
        except RuntimeError as e:
            raise ValueError(f"{kind} cannot be compiled: {_reason(e)}") from None
        raise ValueError(f"unknown grammar kind {kind!r}")

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
