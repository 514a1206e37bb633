"""Tokenizer and chat template: byte-level BPE from GGUF metadata or tokenizer.json, the template
rendered with jinja2 in a sandbox, EOS ids for stop handling."""
from dataclasses import dataclass
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


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


@dataclass
class ChatTokenizer:
    tokenizer: Tokenizer
    chat_template: str
    eos_ids: tuple[int, ...]
    bos_id: int | None = None
    add_bos: bool = False

    def __post_init__(self):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(self.chat_template)
        self.vocab_size = self.tokenizer.get_vocab_size()

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
