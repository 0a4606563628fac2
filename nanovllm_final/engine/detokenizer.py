"""Token ids to text, a few tokens at a time, and stop strings; O(1) work per token.

Decoding each new token alone loses what only a token's neighbours tell: a multi-byte
character split over tokens, or a word's leading space in SentencePiece vocabularies.
So we decode a short window that starts a little before the new tokens (at first, in
the prompt's last tokens) and keep what the window adds beyond its first part; while the
window ends in an incomplete character ("\ufffd") we wait for more tokens (at most
MAX_HELD_TOKENS: a character has at most 4 bytes). The text is kept in pieces; a stop
string is looked for only in the new text and the few characters before it, and the
tail that could still grow into a stop string is held back from deltas. Tokens can be
pushed without decoding and decoded later, several at once (the engine decodes only
when someone reads the text, or when stop strings must be looked for)."""

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first completion token
MAX_HELD_TOKENS = (
    6  # an incomplete character is given up on (kept as "\ufffd") after this many tokens
)


def decoder(tokenizer):
    """ids -> text without special tokens: the fast tokenizer's own decoder where the wrapper
    would add nothing (no clean-up of spaces), which costs a fraction of the wrapper's call."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        backend is not None
        and hasattr(backend, "decode")
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_token_ids: list[int], stop: list[str] = (), min_tokens: int = 0
    ):
        self._decode = decoder(tokenizer)
        self.ids = list(
            prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        )  # window context + completion tokens
        self.prefix_offset = 0  # the window starts here ...
        self.read_offset = len(self.ids)  # ... and its text up to here has been taken already
        self.stop = list(stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.min_tokens = min_tokens  # stop strings count only from this many tokens on
        self.num_tokens = 0  # completion tokens pushed
        self.pieces: list[
            str
        ] = []  # the completion's text (cut before a stop string once one is found)
        self.length = 0
        self.tail = ""  # the text's last max_stop_len - 1 characters: where a stop string may begin
        self.unsent: list[str] = []  # text not handed out as a delta yet
        self.stopped = False  # a stop string was found: the text is final
        self.waited_at = (
            -1
        )  # len(ids) when update last decoded (and waited for more, unless it took the text)

    @property
    def text(self) -> str:
        if len(self.pieces) > 1:
            self.pieces = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def add(self, token_id: int, final: bool = False) -> bool:
        """Push a completion token (`final`: the completion ends with it). With stop strings,
        decode now and return whether one was found (the text is then cut before it)."""
        if self.stopped:
            return True
        self.ids.append(token_id)  # push's body: this runs for every token of every sequence
        self.num_tokens += 1
        return self.update(final) if self.stop else False

    def push(self, token_id: int) -> None:
        """Push a completion token without decoding it yet."""
        self.ids.append(token_id)
        self.num_tokens += 1

    def update(self, final: bool = False) -> bool:
        """Decode the pushed tokens (`final`: whatever is left); True once a stop string was found."""
        if (
            self.stopped
            or self.read_offset == len(self.ids)
            or (self.waited_at == len(self.ids) and not final)
        ):
            return self.stopped
        self.waited_at = len(self.ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        complete = len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR)
        if not (final or complete or len(self.ids) - self.read_offset >= MAX_HELD_TOKENS):
            return False
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.prefix_offset > 4096:  # forget tokens no window will read again (amortized O(1))
            del self.ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset, self.waited_at = 0, -1
        return self._append(new_text[len(prefix_text) :])

    def _append(self, new: str) -> bool:
        if not new:
            return False
        if self.stop and self.num_tokens >= self.min_tokens:
            window = self.tail + new
            hits = [i for i in (window.find(s) for s in self.stop) if i != -1]
            if hits:
                self._cut(
                    self.length - len(self.tail) + min(hits), window[: min(hits)][len(self.tail) :]
                )
                return True
        self.pieces.append(new)
        self.unsent.append(new)
        self.length += len(new)
        if self.max_stop_len > 1:
            self.tail = (self.tail + new)[-(self.max_stop_len - 1) :]
        return False

    def _cut(self, end: int, kept_new: str) -> None:
        """A stop string begins at character `end` of the text: the text ends there."""
        text = self.text + kept_new
        sent = self.length - sum(len(p) for p in self.unsent)  # characters handed out already
        self.pieces, self.length, self.stopped = [text[:end]], end, True
        self.unsent = [text[sent:end]] if sent < end else []

    def delta(self, finished: bool) -> str:
        """The text not handed out yet (`finished`: all of it; else less a tail that could
        still grow into a stop string)."""
        self.update(final=finished)
        if not self.unsent:
            return ""
        unsent = "".join(self.unsent)
        hold = 0 if finished or self.stopped else self._stop_prefix_len(unsent)
        self.unsent = [unsent[len(unsent) - hold :]] if hold else []
        return unsent[: len(unsent) - hold]

    def _stop_prefix_len(self, unsent: str) -> int:
        """The longest tail of the unsent text that is the start of some stop string (looked for
        only where a stop string's first character stands)."""
        window, best = unsent[-(self.max_stop_len - 1) :] if self.max_stop_len > 1 else "", 0
        for stop in self.stop:
            p = window.find(stop[0], max(0, len(window) - len(stop) + 1))
            while p != -1 and len(window) - p > best:
                if stop.startswith(window[p:]):
                    best = len(window) - p  # the leftmost start is this stop string's longest tail
                    break
                p = window.find(stop[0], p + 1)
        return best
