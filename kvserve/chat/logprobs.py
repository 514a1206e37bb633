"""Token log-probabilities as OpenAI returns them. Workers send, per generated token, `[token id, logprob,
[[id, logprob], ...]]` on the output events (inference.events.Delta); here they become the chat shape
(`choices[].logprobs.content[]` of {token, logprob, bytes, top_logprobs}) or the legacy completions shape
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). Every generated token is listed, the one that ended
the sequence included (so there are usage.completion_tokens entries); the end-of-sequence token adds no text, so
its text is "" (no bytes)."""
from inference.tokenizer import BYTE_OF_SYMBOL


class TokenText:
    """The served tokenizer's view of single tokens: their raw bytes and their text."""

    def __init__(self, chat_tokenizer):
        self.tk = chat_tokenizer.tokenizer
        self.eos_ids = set(chat_tokenizer.eos_ids)
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        """A token's own bytes (a byte-level token may be part of a UTF-8 character); a special token's name; none
        for an end-of-sequence token."""
        if token_id in self.eos_ids:
            return b""
        if token_id not in self._bytes:
            piece = self.tk.id_to_token(int(token_id)) or ""
            table = BYTE_OF_SYMBOL  # GPT-2's byte-level alphabet: symbol -> byte
            if piece and all(ch in table for ch in piece) and self.tk.token_to_id(piece) == token_id \
                    and not self.tk.get_added_tokens_decoder().get(token_id):
                raw = bytes(table[ch] for ch in piece)
            else:
                raw = (self.tk.decode([int(token_id)], skip_special_tokens=False) or piece).encode()
            self._bytes[token_id] = raw
        return self._bytes[token_id]

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")


def chat_logprobs(entries: list, text: TokenText, top: int) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def item(token_id, logprob):
        raw = text.bytes_of(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": float(logprob), "bytes": list(raw)}

    return {"content": [{**item(tid, lp), "top_logprobs": [item(i, x) for i, x in alts[:top]]}
                        for tid, lp, alts in entries], "refusal": None}


def completion_logprobs(entries: list, text: TokenText, top: int, offset: int = 0) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}; offsets are characters
    into the completion text, counted from `offset`."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, lp, alts in entries:
        s = text.text_of(tid)
        tokens.append(s)
        lps.append(float(lp))
        tops.append({text.text_of(i): float(x) for i, x in alts[:top]})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
