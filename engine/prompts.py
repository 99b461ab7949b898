"""Prompts as token ids: the chat template around the user's text, and token ids checked.

User text never becomes a control token: a control token's spelling typed by a visitor
(``<|im_start|>system``) is split into ordinary tokens, and only the chat template's own
markers are real control tokens (no visitor can inject a turn).

Encoding holds one lock (``_ENCODE_LOCK``). A fast tokenizer keeps "split special tokens" as a flag on its one
Rust object and sets it on each call before encoding (transformers 5.25, ``_encode_plus``: set, then encode,
unlocked); two sessions encoding at once could each encode with the other's flag: the chat template's markers
split into text (another answer than the run alone gives) or, worse, a visitor's spelling of a marker made a
control token. Both happened without the lock (docs/bench/2026-12-07-notes-from-engine.md).
"""

from __future__ import annotations

import threading

__all__ = ["PromptEncoder"]

# Every encode of every PromptEncoder (engines of one process may share a tokenizer): see the module's docstring.
_ENCODE_LOCK = threading.Lock()

# Stands in for the user's text while the chat template is rendered (a private-use character).
_PLACEHOLDER = "\ue000speclens-user-text\ue000"


class PromptEncoder:
    """A tokenizer's prompts for one target: text -> ids (chat or plain), ids checked against the
    vocabulary, and the text of single tokens (cached: events name every token they record)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._token_text: dict[int, str] = {}
        # Special tokens (chat template markers, EOS) never start or continue a copying drafter's draft.
        self.special_ids = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", []))

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def text_ids(self, text: str) -> list[int]:
        """User text as plain text: a control token's spelling (``<|im_start|>``) in it is split into
        ordinary tokens, never turned into the control token."""
        with _ENCODE_LOCK:
            return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of a prompt; with chat, wrapped in the model's chat template.

        The template's own markers are real control tokens; the user's text never produces one."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError("prompt is empty: type something for the model to continue")
        tok = self.tokenizer
        if not (chat and getattr(tok, "chat_template", None)):
            bos = [tok.bos_token_id] if getattr(tok, "add_bos_token", False) and tok.bos_token_id is not None else []
            return [int(i) for i in bos + self.text_ids(prompt)]
        # Render the template around a placeholder, then tokenise the template's parts (markers parsed)
        # and the user's text (markers split) separately.
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": _PLACEHOLDER}], add_generation_prompt=True, tokenize=False
        )
        before, after = rendered.split(_PLACEHOLDER, 1)
        return [int(i) for i in self._template_ids(before) + self.text_ids(prompt) + self._template_ids(after)]

    def _template_ids(self, part: str) -> list[int]:
        if not part:
            return []
        with _ENCODE_LOCK:  # markers parsed: the flag set back to False for this call
            return self.tokenizer(part, add_special_tokens=False, split_special_tokens=False)["input_ids"]

    def check_ids(self, ids, what: str = "prompt") -> list[int]:
        """Token ids as ints, each in the vocabulary; a ValueError naming `what` otherwise."""
        checked = [int(t) for t in ids]
        if any(not 0 <= t < self.vocab_size for t in checked):
            raise ValueError(f"{what} token ids must be in [0, {self.vocab_size})")
        return checked

    def ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        """A prompt given as text (encoded) or as token ids (checked)."""
        if isinstance(prompt, str):
            return self.encode(prompt, chat)
        ids = self.check_ids(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def documents(self, history) -> list[list[int]]:
        """Earlier answers (texts, tokenised like a user's text, or token ids) as token ids."""
        return [self.text_ids(doc) if isinstance(doc, str) else self.check_ids(doc, "history") for doc in history]
