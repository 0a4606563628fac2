"""Token ids to text, a few tokens at a time, and stop strings.

Decoding each new token alone loses what only a token's neighbours tell: a multi-byte
character split over tokens, or a word's leading space in SentencePiece vocabularies.
So we decode a short window that starts a little before the new tokens (at first, in
the prompt's last tokens) and keep what the window adds beyond its first part; while the
window ends in an incomplete character ("\ufffd") we wait for more tokens. Tokens can be
pushed one by one and decoded later, several at once (`update`): the engine decodes only
when someone reads the text, or when stop strings must be looked for."""

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first completion token


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])  # window context + completion
        self.prefix_offset = 0  # the window starts here ...
        self.read_offset = len(self.ids)  # ... and its text up to here has been taken already
        self.text = ""  # the completion's text so far (cut before a stop string once one is found)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.emitted = 0  # characters of `text` handed out as deltas
        self.stopped = False  # a stop string was found: the text is final

    def push(self, token_id: int) -> None:
        self.ids.append(token_id)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, final: bool = False) -> None:
        """Decode the pushed tokens; `final`: the completion ends here, decode whatever is left."""
        if self.stopped or self.read_offset == len(self.ids):
            return
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if final or (len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR)):
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def find_stop(self, searched_from: int) -> bool:
        """Does the text past `searched_from` (minus a stop string's length) contain a stop
        string? If so, cut the text before the first one."""
        if not self.stop:
            return False
        start = max(0, searched_from - self.max_stop_len + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i != -1]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.stopped = True
        return True

    def delta(self, finished: bool) -> str:
        """The text not handed out yet, holding back a tail that could still grow into a stop string."""
        end = len(self.text)
        if not finished:
            end -= self._stop_prefix_len()
        delta, self.emitted = self.text[self.emitted : end], max(self.emitted, end)
        return delta

    def _stop_prefix_len(self) -> int:
        """The longest tail of the text that is the start of some stop string."""
        for k in range(min(self.max_stop_len - 1, len(self.text) - self.emitted), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
