"""A tiktoken-backed remote-code tokenizer for tests, in the interface Kimi K2.x checkpoints use.

Kimi ships ``tokenization_kimi.py`` (class ``TikTokenTokenizer``, vocabulary ``tiktoken.model``: one
``base64(token bytes) rank`` line per regular token, special tokens numbered after them), loaded through
``auto_map`` with ``trust_remote_code``. This file is our own stand-in with that interface (same class
name, file layout and special-token spelling), written for tests; it is not Moonshot's code. The writer
in ``tests/server/kimi_tokenizer_files.py`` copies it into a checkpoint directory next to a vocabulary.

Token strings (``tokenize``, ``convert_ids_to_tokens``) are the token's bytes read as Latin-1, a
one-to-one byte/character mapping; decoding works on bytes, so a UTF-8 character split over tokens
comes out as U+FFFD until the rest arrives, as the streaming detokenizer expects.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import AddedToken, PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}

# Pre-tokenization: letters with an optional leading space, single digits, punctuation runs, whitespace.
PAT_STR = r" ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Special tokens, numbered in this order right after the regular tokens.
SPECIAL_TOKENS: tuple[str, ...] = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
)
# A vision checkpoint's image markers (tokenizer_config.json ``"media_tokens": true``), numbered after those.
MEDIA_TOKENS: tuple[str, ...] = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")


def special_tokens(media: bool) -> tuple[str, ...]:
    return SPECIAL_TOKENS + (MEDIA_TOKENS if media else ())


class TikTokenTokenizer(PreTrainedTokenizer):
    """Byte-level BPE through ``tiktoken.Encoding``; special tokens are the added tokens of the HF side."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token: str = "[BOS]", eos_token: str = "<|im_end|>",
                 media_tokens: bool = False, **kwargs: Any) -> None:
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        self._n_regular = len(ranks)
        all_specials = special_tokens(media_tokens)
        specials = {tok: self._n_regular + i for i, tok in enumerate(all_specials)}
        self.encoding = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PAT_STR,
                                          mergeable_ranks=ranks, special_tokens=specials)
        self._token_to_id = {b.decode("latin-1"): r for b, r in ranks.items()}
        self._id_to_bytes = {r: b for b, r in ranks.items()}
        self._special_ids = set(specials.values())
        self._added_tokens_decoder = {
            i: AddedToken(tok, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
            for tok, i in specials.items()}
        kwargs.pop("added_tokens_decoder", None)  # the vocabulary file defines them
        named = {bos_token, eos_token}
        kwargs.setdefault("extra_special_tokens", [t for t in all_specials if t not in named])
        kwargs.pop("additional_special_tokens", None)
        super().__init__(bos_token=bos_token, eos_token=eos_token, **kwargs)

    # ---- vocabulary ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of regular (BPE) tokens; the special tokens follow them."""
        return self._n_regular

    def get_vocab(self) -> dict[str, int]:
        """Regular tokens (Latin-1 spelling of their bytes) plus the special tokens."""
        vocab = dict(self._token_to_id)
        vocab.update({t.content: i for i, t in self._added_tokens_decoder.items()})
        return vocab

    # ---- encoding ------------------------------------------------------------------------------------
    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        """Text without special tokens (the base class split them off) into regular token strings."""
        return [self._id_to_bytes[i].decode("latin-1") for i in self.encoding.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        try:
            return self._token_to_id[token]
        except KeyError:
            raise ValueError(f"{token!r} is not a token of this vocabulary") from None

    # ---- decoding ------------------------------------------------------------------------------------
    def _convert_id_to_token(self, index: int) -> str:
        if index in self._added_tokens_decoder:
            return self._added_tokens_decoder[index].content
        return self._id_to_bytes[index].decode("latin-1")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Regular token strings are Latin-1 bytes and special tokens are ASCII: join, then read as UTF-8."""
        return "".join(tokens).encode("latin-1").decode("utf-8", errors="replace")

    def _decode(self, token_ids: int | list[int], skip_special_tokens: bool = False,
                clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        """Bytes of all tokens joined, then UTF-8 (U+FFFD for an incomplete tail); ids past the
        vocabulary decode to nothing."""
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        out = bytearray()
        for i in ids:
            i = int(i)
            if i in self._special_ids:
                if not skip_special_tokens:
                    out += self._added_tokens_decoder[i].content.encode("utf-8")
            else:
                out += self._id_to_bytes.get(i, b"")
        return out.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        """Copy ``tiktoken.model`` into ``save_directory``."""
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        dest = os.path.join(save_directory, name)
        if os.path.abspath(dest) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, dest)
        return (dest,)
