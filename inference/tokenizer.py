"""Tokenizer and chat template: byte-level BPE from GGUF metadata or tokenizer.json, the template
rendered with jinja2 in a sandbox, EOS ids for stop handling, and the incremental detokenizer."""
import codecs
from dataclasses import dataclass, field
from functools import cached_property

import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types that are control/special tokens (llama.cpp: 3 = CONTROL, 4 = USER_DEFINED)
_SPECIAL_TYPES = (3, 4)


def bpe_from_gguf_vocab(tokens: list[str], merges: list[str], token_types: list[int], pre: str) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default", "tiny", ""):
        tk.pre_tokenizer = byte_level
    else:
        raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported; use an HF directory with tokenizer.json")
    tk.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(token_types) if t in _SPECIAL_TYPES]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tk


def _byte_symbols() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable symbol standing for each byte -> that byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BYTE_OF_SYMBOL = _byte_symbols()


class TextStream:
    """One sequence's output text, fed one token at a time. `text` always equals
    `tokenizer.decode(ids fed so far)` (special tokens skipped). `stable_len` is the length of the
    prefix of `text` that no later token can change: a byte-level tokenizer's text is the UTF-8
    decoding (invalid bytes replaced) of its tokens' bytes, so a token costs one incremental UTF-8
    decode; only an incomplete trailing character is re-decoded (as U+FFFD, as a full decode shows it).
    Other decoders (no byte-level decoding) re-decode the whole output each token: exact, slower."""

    def __init__(self, tokenizer: "ChatTokenizer"):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if tokenizer.byte_level else None
        self._stable = ""
        self._tail = ""

    @property
    def text(self) -> str:
        return self._stable + self._tail if self._tail else self._stable

    @property
    def settled(self) -> str:
        """`text` less an incomplete trailing character (bytes a later token may complete): what may be shown
        now, and all a sequence that ends here shows. Invalid bytes no token can complete stay U+FFFD, as a full
        decode shows them (byte level: exactly the incomplete tail is held; other decoders: trailing U+FFFD)."""
        return self._stable if self._utf8 is not None else self._stable.rstrip("\ufffd")

    @property
    def stable_len(self) -> int:
        return len(self._stable) if self._utf8 else 0

    def push(self, token_id: int) -> None:
        if self._utf8 is None:
            self._ids.append(token_id)
            self._stable = self._tok.decode(self._ids)
            return
        self._stable += self._utf8.decode(self._tok.token_bytes(token_id))
        pending = self._utf8.getstate()[0]
        self._tail = pending.decode("utf-8", "replace") if pending else ""


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


@dataclass
class ChatTokenizer:
    tokenizer: Tokenizer
    chat_template: str
    eos_ids: tuple[int, ...]
    bos_id: int | None = None
    add_bos: bool = False

    _token_bytes: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(self.chat_template)
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.byte_level = isinstance(self.tokenizer.decoder, decoders.ByteLevel)
        self._special = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}

    def token_bytes(self, token_id: int) -> bytes:
        """What one token adds to a byte-level decode: nothing for a special token; its symbols
        mapped back to bytes; a token with a symbol outside the alphabet (an added token) as its UTF-8."""
        b = self._token_bytes.get(token_id)
        if b is None:
            piece = None if token_id in self._special else self.tokenizer.id_to_token(token_id)
            if piece is None:
                b = b""
            elif all(c in BYTE_OF_SYMBOL for c in piece):
                b = bytes(BYTE_OF_SYMBOL[c] for c in piece)
            else:
                b = piece.encode("utf-8")
            self._token_bytes[token_id] = b
        return b

    def stream(self) -> TextStream:
        return TextStream(self)

    @cached_property
    def max_token_chars(self) -> int | None:
        """The most characters one token can stand for: its longest vocabulary or special-token string (a
        byte-level string has one character per byte, and a byte is at least one character). So a text of n
        characters is at least n / max_token_chars tokens. None with a normalizer, which may contract text."""
        if self.tokenizer.normalizer is not None:
            return None
        return max(len(token) for token in self.tokenizer.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] + ids) if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        bos = self.tokenizer.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos = self.tokenizer.id_to_token(self.eos_ids[0]) if self.eos_ids else ""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos, eos_token=eos)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render_chat(messages))
