"""Incremental detokenization of one request's output, with stop-string enforcement.

Text is decoded with the prefix/read-offset method: every step decodes only a short window of
recent token ids (``ids[prefix_offset:]``) and emits what the newest tokens added relative to the
window's already-emitted head (``ids[prefix_offset:read_offset]``). Decoding in the context of the
previous tokens, seeded with the tail of the prompt, keeps the spacing that the tokenizer's decoder
gives a token mid-text (a SentencePiece ``"▁Paris"`` after a prompt becomes ``" Paris"``, as in
vLLM), and a window whose text ends in U+FFFD (an incomplete multi-byte character) is held back
until a later token completes it.

``tokenizers.decoders.DecodeStream`` does the same thing in Rust, but it raises ``InvalidPrefix``
when a ByteFallback decoder rewrites already-emitted bytes (a run of ``<0x..>`` tokens that turns
out not to be valid UTF-8 becomes one U+FFFD per token, including bytes already shown) and it
cannot flush an incomplete trailing character when the request ends; a serving engine needs
neither failure mode, so this module owns the bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

from engine.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output so the first output token gets its in-text spacing.
_PROMPT_CONTEXT_TOKENS = 5
# How far the prompt context may grow backwards to start on a whole character.
_MAX_PROMPT_CONTEXT_TOKENS = 16


def _prompt_context(
    tokenizer: tokenizers.Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool
) -> list[int]:
    """Return the last few prompt ids, extended backwards until they start on a whole character.

    A context that starts mid-character decodes to a leading U+FFFD; with a ByteFallback decoder
    the validity of a byte run can then change when the output continues it, which would break
    the prefix property the incremental decode relies on.
    """
    max_tokens = min(len(prompt_token_ids), _MAX_PROMPT_CONTEXT_TOKENS)
    num_tokens = min(len(prompt_token_ids), _PROMPT_CONTEXT_TOKENS)
    while True:
        context = list(prompt_token_ids[len(prompt_token_ids) - num_tokens :])
        context_text = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
        if num_tokens == max_tokens or not context_text.startswith(_REPLACEMENT_CHAR):
            return context
        num_tokens += 1


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text incrementally, enforcing stop strings.

    Invariants:
    - ``output_text`` equals ``decode(prompt + output)`` minus ``decode(prompt)`` for any
      tokenizer whose decoder is prefix-stable (ByteLevel always; ByteFallback as long as the
      output is valid UTF-8), cut right before the earliest stop string. Without a prompt that is
      ``decode(output)``.
    - The concatenation of all ``take_delta`` results is ``output_text`` once ``take_delta(True)``
      was called, and no call ever returns a character that a stop string later removes.

    Each ``update`` costs two decodes of a window of a few tokens per new token, plus a stop-string
    search over the new text and the ``longest_stop - 1`` characters before it.
    Not thread-safe; one instance per request.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = params.stop
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self._ids = _prompt_context(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._text = ""
        self._num_returned_chars = 0
        self._stop_str: str | None = None
        self._flushed = False

    @property
    def output_text(self) -> str:
        """All text decoded so far (cut before a matched stop string); see ``take_delta``."""
        return self._text

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the text, or ``None``."""
        return self._stop_str

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append generated tokens; return the stop string that matched, else ``None``.

        On a match ``output_text`` is cut right before the stop string (the earliest match wins;
        on a tie, the one listed first in ``params.stop``) and the tokens after the matching one
        are ignored. Calling ``update`` again after a match or after ``take_delta(finished=True)``
        raises ``RuntimeError``. The caller should not pass a stop token (EOS / stop_token_ids)
        whose text must not appear.
        """
        if self._stop_str is not None or self._flushed:
            raise RuntimeError("update() after the detokenizer finished")
        for token_id in new_token_ids:
            self._ids.append(token_id)
            new_text = self._step()
            if new_text and self._append(new_text):
                return self._stop_str
        return None

    def take_delta(self, finished: bool) -> str:
        """Return the text not returned before.

        While not ``finished`` (and no stop string matched), the last ``longest_stop - 1``
        characters are withheld because a later stop-string match could still remove them.
        With ``finished=True`` the text of trailing tokens that the decoder was holding back
        (an incomplete multi-byte character, decoded as U+FFFD like a one-shot decode would) is
        flushed, stop strings are applied to it, and all remaining text is returned; after that
        ``update`` raises.
        """
        if finished and not self._flushed:
            self._flushed = True
            if self._stop_str is None and self._read_offset < len(self._ids):
                tail_text = self._decode(self._ids[self._prefix_offset :])
                self._append(tail_text[len(self._prefix_text) :])
        end = len(self._text)
        if not finished and self._stop_str is None and self._max_stop_len > 1:
            end = max(self._num_returned_chars, end - (self._max_stop_len - 1))
        delta = self._text[self._num_returned_chars : end]
        self._num_returned_chars = end
        return delta

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _step(self) -> str:
        """Decode the window after one appended id; return the text it completes ("" if none)."""
        window_text = self._decode(self._ids[self._prefix_offset :])
        # Length, not startswith: a ByteFallback run that turns invalid rewrites emitted bytes as
        # U+FFFD; text already sent cannot be taken back, so only the growth is emitted.
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        new_text = window_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return new_text

    def _append(self, new_text: str) -> bool:
        """Append text and search for a stop string ending inside it; True if one matched."""
        old_len = len(self._text)
        self._text += new_text
        match_pos = -1
        for stop in self._stop:
            # A match must end inside the new text, or an earlier update would have found it.
            pos = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if pos != -1 and (match_pos == -1 or pos < match_pos):
                match_pos, self._stop_str = pos, stop
        if match_pos == -1:
            return False
        self._text = self._text[:match_pos]
        return True
