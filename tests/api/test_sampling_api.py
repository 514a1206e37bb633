"""The sampling knobs on both endpoints against a fake worker: each reaches the stored request and the engine's
SamplingParams the workers build from it, and each out-of-range value is a 400 naming the field."""
import json

import pytest

from kvserve.chat.models import ChatRequest
from kvserve.chat.services import sampling_params
from kvserve.chat.tokenizer import tokenizer_get
from tests.api.test_chat_api import assert_error, auth, chat_env, key  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.django_db]
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TEXT = {"prompt": "The capital of France is"}
ENDPOINTS = [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)]
KNOBS = {"top_k": 40, "min_p": 0.05, "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.3,
         "logit_bias": {"17": -100, "3": 2.5}, "min_tokens": 4, "stop_token_ids": [2, 9],
         "include_stop_str_in_output": True, "ignore_eos": True, "temperature": 0.8, "max_tokens": 12}


def post(client, raw, url, body):
    return client.post(url, json.dumps(body), content_type="application/json", **auth(raw))


@pytest.mark.parametrize("url,base", ENDPOINTS)
def test_every_knob_reaches_the_engine(client, chat_env, key, url, base):
    assert post(client, key, url, {**base, **KNOBS}).status_code == 200
    sp = sampling_params(ChatRequest.objects.get())
    assert (sp.top_k, sp.min_p, sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty) == \
        (40, 0.05, 0.5, -0.5, 1.3)
    assert sp.logit_bias == ((3, 2.5), (17, -100.0)) and sp.stop_token_ids == (2, 9)
    assert (sp.min_tokens, sp.include_stop_str_in_output, sp.ignore_eos, sp.max_tokens) == (4, True, True, 12)


@pytest.mark.parametrize("url,base", ENDPOINTS)
@pytest.mark.parametrize("off", [-1, 0])
def test_top_k_minus_one_or_zero_is_off(client, chat_env, key, url, base, off):
    assert post(client, key, url, {**base, "top_k": off, "temperature": 1.0}).status_code == 200
    req = ChatRequest.objects.get()
    assert req.request_params.sampling.top_k is None and sampling_params(req).top_k == 0


def test_unset_knobs_leave_the_engine_defaults(client, chat_env, key):
    assert post(client, key, "/v1/chat/completions", CHAT).status_code == 200
    sp = sampling_params(ChatRequest.objects.get())
    assert (sp.top_k, sp.min_p, sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty, sp.logit_bias,
            sp.min_tokens, sp.stop_token_ids, sp.include_stop_str_in_output, sp.ignore_eos) == \
        (0, 0.0, 0.0, 0.0, 1.0, (), 0, (), False, False)


def bad_bodies():
    top = tokenizer_get()[0].vocab_size  # the first id past the served vocabulary
    return [
        ({"top_k": -2}, "top_k", "min_value"), ({"top_k": 2.5}, "top_k", "invalid"), ({"top_k": "5"}, "top_k", "invalid"),
        ({"min_p": -0.1}, "min_p", "min_value"), ({"min_p": 1.5}, "min_p", "max_value"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "max_value"),
        ({"frequency_penalty": -2.1}, "frequency_penalty", "min_value"),
        ({"presence_penalty": 3}, "presence_penalty", "max_value"),
        ({"presence_penalty": "1"}, "presence_penalty", "invalid"),
        ({"repetition_penalty": 0}, "repetition_penalty", "min_value"),
        ({"repetition_penalty": -1}, "repetition_penalty", "min_value"),
        ({"repetition_penalty": 2.5}, "repetition_penalty", "max_value"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "bias"), ({"logit_bias": {"5": -100.5}}, "logit_bias", "bias"),
        ({"logit_bias": {"5": "1"}}, "logit_bias", "bias"), ({"logit_bias": {"x": 1}}, "logit_bias", "token"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "token"), ({"logit_bias": {str(top): 1}}, "logit_bias", "token"),
        ({"logit_bias": [1]}, "logit_bias", "invalid"),
        ({"min_tokens": -1}, "min_tokens", "min_value"), ({"min_tokens": 13, "max_tokens": 12}, "min_tokens", "max_value"),
        ({"stop_token_ids": [top]}, "stop_token_ids", "token"), ({"stop_token_ids": 5}, "stop_token_ids", "invalid"),
        ({"stop_token_ids": [True]}, "stop_token_ids", "token"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "invalid"),
        ({"ignore_eos": "yes"}, "ignore_eos", "invalid"),
    ]


@pytest.mark.parametrize("url,base", ENDPOINTS)
@pytest.mark.parametrize("case", range(26))
def test_an_out_of_range_knob_is_a_400_naming_it(client, chat_env, key, url, base, case):
    body, param, code = bad_bodies()[case]
    assert_error(post(client, key, url, {**base, **body}), 400, code=code, param=param)
    assert ChatRequest.objects.count() == 0 and chat_env.calls == []


def test_the_case_list_is_walked_whole():
    assert len(bad_bodies()) == 26
