"""Incremental detokenization equals decoding the whole output again, token by token, on random
streams (multi-byte characters split across tokens, invalid bytes, special tokens), and the
engine's deltas, text and finish reasons equal those of a full-decode rule (stop strings across token
boundaries, held-back partial characters and partial stop strings, EOS; an ending never shows a partial
character as U+FFFD)."""
import codecs
import random

import pytest

from inference.engine import Engine, EngineConfig
from inference.sequence import SamplingParams, Sequence, SeqStatus

TEXTS = ["naïve café — 日本語のテキスト 🎉🎉 and ÿ", "Привет, мир! 😀 ok", "a\u00a0b\u200dc 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 END"]


def random_stream(tok, rng, n=60):
    """Pieces of real multi-byte text (BPE splits characters across tokens) mixed with random ids
    (single bytes that are invalid or incomplete UTF-8, specials, anything in the vocabulary)."""
    ids = []
    while len(ids) < n:
        if rng.random() < 0.5:
            ids += tok.encode(rng.choice(TEXTS))[: rng.randint(1, 12)]
        else:
            ids.append(rng.randrange(tok.vocab_size))
    return ids[:n]


@pytest.mark.parametrize("which", ["tiny", "real"])
def test_text_stream_equals_a_full_decode_after_every_token(which, tiny_model, real_model):
    tok = (tiny_model if which == "tiny" else real_model).tokenizer
    assert tok.byte_level  # the incremental path, not the re-decode fallback
    rng = random.Random(0)
    for _ in range(40):
        ids = random_stream(tok, rng)
        stream = tok.stream()
        for i, t in enumerate(ids):
            stable_before = stream.text[: stream.stable_len]
            stream.push(t)
            assert stream.text == tok.decode(ids[: i + 1])
            assert stream.text.startswith(stable_before)  # the stable part never changes


def settled_decode(tokenizer, ids) -> str:
    """The whole output's bytes decoded less an incomplete trailing character (invalid bytes are U+FFFD)."""
    data = b"".join(tokenizer.token_bytes(i) for i in ids)
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=False)


def full_decode_rule(tokenizer, seq, token, max_position):
    """What `_append_token` must give, decoding the whole output every step (the oracle): text shown is the
    decode less a character still incomplete (invalid bytes stay U+FFFD); an ending (EOS, a stop string, length)
    shows all of that text up to the stop string, the part held back for a possible stop string included."""
    seq.output_ids.append(token)
    params = seq.params

    def finish(reason, final):
        delta = final[len(seq.text):] if len(final) > len(seq.text) else ""
        seq.text = max(final, seq.text, key=len)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        return delta

    text = settled_decode(tokenizer, seq.output_ids)
    if token in tokenizer.eos_ids and not params.ignore_eos:
        return finish("stop", settled_decode(tokenizer, seq.output_ids[:-1]))
    if params.stop:
        hits = [text.find(s) for s in params.stop if s and s in text]
        if hits:
            return finish("stop", text[:min(hits)])
    if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= max_position:
        return finish("length", text)
    safe = len(text)
    for s in params.stop:
        for k in range(min(len(s) - 1, safe), 0, -1):
            if text[:safe].endswith(s[:k]):
                safe -= k
                break
    if safe <= len(seq.text):
        return ""
    delta, seq.text = text[len(seq.text):safe], text[:safe]
    return delta


@pytest.mark.parametrize("which", ["tiny", "real"])
def test_engine_deltas_and_finish_match_the_full_decode_rule(which, tiny_model, real_model):
    model = tiny_model if which == "tiny" else real_model
    engine = Engine(model, EngineConfig(num_pages=8))
    tok = model.tokenizer
    rng = random.Random(1)
    finished = {"stop": 0, "length": 0}
    for case in range(150):
        ids = random_stream(tok, rng, n=rng.randint(5, 50))
        full = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(0, 3)):  # substrings of what will be said: they span token boundaries
            if full and rng.random() < 0.7:
                a = rng.randrange(len(full))
                stops.append(full[a: a + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(["日本", "🎉 a", "zzq", "é", "\ufffd"]))
        params = SamplingParams(max_tokens=rng.randint(1, 60), stop=tuple(stops), ignore_eos=rng.random() < 0.5, seed=0)
        ours, ref = Sequence("o", [1], params), Sequence("r", [1], params)
        for t in ids:
            got = engine._append_token(ours, t)
            want = full_decode_rule(tok, ref, t, model.config.max_position)
            assert (got, ours.text, ours.status, ours.finish_reason) == (want, ref.text, ref.status, ref.finish_reason), \
                (case, ids, stops)
            if ref.status is SeqStatus.FINISHED:
                finished[ref.finish_reason] += 1
                break
    assert finished["stop"] > 20 and finished["length"] > 20  # both endings were exercised
