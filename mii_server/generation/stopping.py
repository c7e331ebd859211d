"""Stop strings matched across token boundaries, with streaming hold-back.

Text that might be the start of a stop string is held back from the stream until it is either
completed (and then cut, stop string excluded) or ruled out.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self.text = ""  # all text generated so far (cut at a stop string once one matches)
        self.released = 0  # characters of `text` already handed out
        self.matched = False

    def feed(self, new_text: str) -> str:
        """Add generated text; return what can be released now. Sets ``matched`` on a stop string."""
        if self.matched:
            return ""
        if not self.stops:  # why: the common case, once per token of every request, keeps no text
            return new_text
        search_from = max(0, len(self.text) - self._longest + 1)
        self.text += new_text
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.matched = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def flush(self) -> str:
        """Release everything still held (the request has finished for another reason)."""
        return self._release(len(self.text))

    def _held_back(self) -> int:
        # Longest suffix of the text that is a proper prefix of some stop string.
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: int) -> str:
        upto = max(upto, self.released)
        out = self.text[self.released : upto]
        self.released = upto
        return out
