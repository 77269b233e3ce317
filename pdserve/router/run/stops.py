"""Router-side stop strings: matched over the whole output text (P's first token and D's stream together), holding
back what could begin a stop string."""

from __future__ import annotations


class StopStrings:
    """Stop-string matching over the whole output text, holding back what could begin a stop string."""

    def __init__(self, stops: list[str], include: bool) -> None:
        self.stops = stops
        self.include = include
        self.maxlen = max((len(s) for s in stops), default=0)
        self.hold = 0 if include or not stops else self.maxlen - 1
        self.text = ""
        self.sent = 0
        self.matched_end = 0  # after a hit: where the stop string ends in the whole text (included or not)

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add text; return (text that may go out now, the stop string hit or None)."""
        if not self.stops:
            return delta, None
        start = max(0, len(self.text) - self.maxlen + 1)
        self.text += delta
        hit, at = None, -1
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (at < 0 or i < at):
                hit, at = s, i
        if hit is not None:
            self.matched_end = at + len(hit)
            end = at + (len(hit) if self.include else 0)
            out = self.text[self.sent:end]
            self.text = self.text[:end]
            self.sent = end
            return out, hit
        upto = len(self.text) - self.hold
        if upto > self.sent:
            out = self.text[self.sent:upto]
            self.sent = upto
            return out, None
        return "", None

    def flush(self) -> str:
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out
