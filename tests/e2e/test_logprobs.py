"""Log-probabilities and /v1/completions on the real stack with the official `openai` client, checked against
the model's own log-softmax: Hugging Face transformers runs the same GGUF here, in the test, greedily, and each
returned token, its log-probability and its top alternatives must be what that run gives (float32 on both
sides: they differ by rounding only, measured ~1e-5)."""
import openai
import pytest
import torch

from inference.loader import resolve_model_path

pytestmark = pytest.mark.timeout(900)  # loading transformers' GGUF path takes ~30 s on 2 busy cores
MODEL = "SmolLM2-135M-Instruct"
TOL = 1e-4


@pytest.fixture(scope="module")
def reference():
    """greedy(ids, n) -> [(token id, log_softmax row)] from transformers, EOS included."""
    transformers = pytest.importorskip("transformers")
    path = resolve_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()

    def greedy(ids: list[int], n: int):
        out, ids = [], list(ids)
        with torch.inference_mode():
            for _ in range(n):
                lsm = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
                out.append((int(lsm.argmax()), lsm))
                ids.append(out[-1][0])
        return out

    return greedy


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.api_key, max_retries=0, timeout=240)


def text_of(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def check(tokens: list[str], logprobs: list[float], tops: list[list[tuple[str, float]]], ref, tokenizer):
    """The returned tokens against the reference's greedy tokens, one per completion token: the EOS that ends
    the answer is listed too (its text is "")."""
    ref = ref[: len(tokens)]
    assert len(tokens) == len(ref) >= 4
    worst = 0.0
    for token, lp, top, (rid, lsm) in zip(tokens, logprobs, tops, ref):
        assert token == text_of(tokenizer, rid)
        worst = max(worst, abs(lp - lsm[rid].item()))
        values, ids = lsm.topk(len(top))
        assert [t for t, _ in top][:1] == [text_of(tokenizer, int(ids[0]))]
        for (_, got), want in zip(top, values.tolist()):
            worst = max(worst, abs(got - want))
    print(f"max |logprob - reference| {worst:.2e}")
    assert worst < TOL


def test_chat_logprobs_match_the_models_log_softmax(client, real_model, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = real_model.tokenizer.encode_chat(messages)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert len(content) == r.usage.completion_tokens  # the EOS that ended it included
    assert all(bytes(c.bytes).decode() == c.token and len(c.top_logprobs) == 5 for c in content)
    ref = reference(ids, len(content) + 1)
    check([c.token for c in content], [c.logprob for c in content],
          [[(t.token, t.logprob) for t in c.top_logprobs] for c in content], ref, real_model.tokenizer)
    # streamed: the same entries, spread over the chunks, and usage as before
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, logprobs=True,
                                                 top_logprobs=5, stream=True, stream_options={"include_usage": True}))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    # (the second request reads the first one's prompt pages from the prefix cache: the same tokens, logprobs
    # equal up to float rounding of a differently chunked prefill)
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(abs(a.logprob - b.logprob) <= TOL for a, b in zip(streamed, content))
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_completions_with_a_raw_prompt_and_legacy_logprobs(client, real_model, reference, stream):
    prompt = "The capital of France is"
    ids = real_model.tokenizer.encode(prompt)
    kwargs = dict(model=MODEL, max_tokens=8, logprobs=3)
    if stream:
        chunks = list(client.completions.create(prompt=ids, stream=True, stream_options={"include_usage": True},
                                                **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        lps = [x for p in parts for x in p.token_logprobs]
        tops = [list(d.items()) for p in parts for d in p.top_logprobs]
        offsets = [o for p in parts for o in p.text_offset]
        assert chunks[-1].usage.prompt_tokens == len(ids)
    else:
        r = client.completions.create(prompt=prompt, **kwargs)
        assert r.object == "text_completion" and r.id.startswith("cmpl-")
        assert r.usage.prompt_tokens == len(ids)  # the prompt as given: no chat template
        text, lp = r.choices[0].text, r.choices[0].logprobs
        tokens, lps, offsets = lp.tokens, lp.token_logprobs, lp.text_offset
        tops = [list(d.items()) for d in lp.top_logprobs]
    assert "".join(tokens) == text and offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert len(tokens) == (chunks[-1].usage if stream else r.usage).completion_tokens
    assert all(len(t) == 3 for t in tops)
    check(tokens, lps, [sorted(t, key=lambda kv: -kv[1]) for t in tops], reference(ids, len(tokens) + 1),
          real_model.tokenizer)


def test_completions_errors_and_tenancy_are_the_chat_ones(client, stack):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=["one", "two"])
    assert exc.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x" * 100, max_tokens=9000)
    assert exc.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "xml"})
    assert exc.value.body["param"] == "response_format.type"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.url + "/v1", api_key="kvs-nope", max_retries=0).completions.create(
            model=MODEL, prompt="hi")
