"""Generated tokens to text, one token at a time: stop strings, and deltas safe to stream.

The text of a generation is :func:`~kvq_export.runtime.base.continuation_text` of all its tokens, exactly what
``kvq generate`` prints, so a streamed answer (the deltas joined) equals the non-streamed one. A delta is held back
while the text ends in an incomplete character (U+FFFD from a split UTF-8 sequence) or in what could be the start
of a stop string, since either may still change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvq_export.runtime.base import continuation_text

_INCOMPLETE = "\ufffd"


class TextTracker:
    """Follows one request's tokens: its text so far, the part already sent, and whether a stop string matched."""

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_tokens: Sequence[int],
                 stop: Sequence[str] = ()) -> None:
        self.decode = decode  # token ids to text, special tokens left out (as KVQSession.decode)
        self.prompt_tokens = list(prompt_tokens)
        self.prompt_text = self.decode(self.prompt_tokens)
        self.stop = tuple(stop)
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False  # a stop string matched: the text ends before it
        self._text: str | None = ""

    @property
    def text(self) -> str:
        """The whole answer so far (cut before a matched stop string)."""
        if self._text is None:
            self._text = self._decode()
        return self._text

    def _decode(self) -> str:
        return continuation_text(self.decode, self.prompt_tokens, self.tokens, prompt_text=self.prompt_text)

    def add(self, token: int, *, stream: bool) -> str:
        """Record a token; return the text that can be sent now ("" when not streaming or nothing is safe yet)."""
        if self.stopped:
            return ""
        self.tokens.append(int(token))
        if not self.stop and not stream:  # decoded once at the end
            self._text = None
            return ""
        text = self._decode()
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped, self._text = True, text[:cut]
            return ""
        self._text = text
        return self._delta(self._safe(text)) if stream else ""

    def finish(self) -> str:
        """The text not sent yet (the whole answer when nothing was streamed)."""
        return self._delta(self.text)

    def _stop_at(self, text: str) -> int | None:
        """Where the earliest stop string starts (searching only where a new one can be), or None."""
        start = max(0, len(self.sent) - max((len(s) for s in self.stop), default=0))
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _safe(self, text: str) -> str:
        """``text`` without a tail that may still change: a split character, or a stop string's possible start."""
        end = len(text.rstrip(_INCOMPLETE))
        held = max((next((n for n in range(min(len(stop) - 1, end), 0, -1) if text[end - n:end] == stop[:n]), 0)
                    for stop in self.stop), default=0)
        return text[:end - held]

    def _delta(self, text: str) -> str:
        if not text.startswith(self.sent):  # an earlier character changed (rare): wait until it settles
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
