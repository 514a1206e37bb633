"""RequestParams: the sampling choices a request set, apart from who asked and through which endpoint; stored
versioned, the flat form requests had before read as version 1, an unknown version or field refused."""
import pytest

from inference.params import VERSION, ParamsFormatError, RequestParams, Sampling
from inference.sequence import SamplingParams

ASKED = RequestParams(Sampling(temperature=0.7, top_p=0.9, seed=-5, stop=("\n",), logprobs=2), user="u-1",
                      endpoint="completions")


KNOBS = Sampling(temperature=0.8, seed=1, top_k=40, min_p=0.05, frequency_penalty=0.5, presence_penalty=-0.25,
                 repetition_penalty=1.2, logit_bias=[(17, -100), (3, 2.5)], min_tokens=4, stop_token_ids=[2, 9],
                 include_stop_str_in_output=True, ignore_eos=False)


@pytest.mark.parametrize("params", [RequestParams(), ASKED, RequestParams(Sampling(seed=3, stop=[])),
                                    RequestParams(KNOBS)])
def test_the_stored_form_reads_back_as_itself(params):
    stored = params.to_dict()
    assert stored["v"] == VERSION and RequestParams.from_dict(stored) == params


def test_the_stored_form_keeps_sampling_apart_from_identity_and_routing():
    assert ASKED.to_dict() == {"v": 1, "sampling": {"temperature": 0.7, "top_p": 0.9, "seed": -5, "stop": ["\n"],
                                                    "logprobs": 2}, "user": "u-1", "endpoint": "completions"}


def test_the_flat_form_of_earlier_requests_reads_as_version_1_and_is_what_the_api_shows():
    legacy = {"temperature": 0.7, "top_p": 0.9, "seed": -5, "stop": ["\n"], "endpoint": "completions",
              "logprobs": 2, "user": "u-1"}
    assert RequestParams.from_dict(legacy) == ASKED and ASKED.flat() == legacy
    assert RequestParams.from_dict({}) == RequestParams() and RequestParams(Sampling(seed=1)).flat() == {"seed": 1}


def test_the_engine_samples_what_was_asked_and_its_defaults_for_the_rest():
    assert ASKED.sampling_params(9, tenant="7") == SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=-5,
                                                                   stop=("\n",), logprobs=2, tenant="7")
    assert RequestParams().with_seed(11).sampling_params(4, tenant="") == SamplingParams(max_tokens=4, seed=11)


@pytest.mark.parametrize("stored, words", [
    ({"v": 2, "sampling": {}}, "version 2 are unknown"),
    ({"v": 1, "sampling": {"mirostat_tau": 5}}, "malformed request parameters"),
    ({"v": 1, "sampling": {}, "tenant": "someone"}, r"unknown fields \['tenant'\]"),
    ({"v": 1, "sampling": {}, "endpoint": "embeddings"}, "endpoint 'embeddings' is not one of"),
    ({"typical_p": 1.0}, "malformed request parameters"),
    (["temperature", 0.7], "a JSON object, not list"),
])
def test_anything_else_is_refused_by_name(stored, words):
    with pytest.raises(ParamsFormatError, match=words):
        RequestParams.from_dict(stored)


def test_request_params_are_frozen():
    with pytest.raises(AttributeError):
        ASKED.user = "someone else"


def test_every_sampling_knob_is_stored_and_reaches_the_engine():
    stored = RequestParams(KNOBS).to_dict()
    assert stored["sampling"]["logit_bias"] == [[17, -100.0], [3, 2.5]] and stored["sampling"]["stop_token_ids"] == [2, 9]
    import json
    back = RequestParams.from_dict(json.loads(json.dumps(stored)))  # as the row's JSON column gives it back
    assert back == RequestParams(KNOBS)
    sp = back.sampling_params(16, tenant="t")
    assert (sp.top_k, sp.min_p, sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty) == \
        (40, 0.05, 0.5, -0.25, 1.2)
    assert sp.logit_bias == ((17, -100.0), (3, 2.5)) and sp.stop_token_ids == (2, 9)
    assert (sp.min_tokens, sp.include_stop_str_in_output, sp.ignore_eos) == (4, True, False)


def test_a_stored_form_from_before_the_knobs_reads_with_the_engine_defaults():
    old = RequestParams.from_dict({"v": 1, "sampling": {"temperature": 0.5, "seed": 2}, "endpoint": "chat"})
    assert old.sampling_params(8, tenant="") == SamplingParams(max_tokens=8, temperature=0.5, seed=2)


@pytest.mark.parametrize("bad", [dict(top_k=-2), dict(min_p=1.5), dict(frequency_penalty=2.5),
                                 dict(presence_penalty=-3), dict(repetition_penalty=0), dict(repetition_penalty=2.5),
                                 dict(logit_bias=((1, 101),)), dict(logit_bias=((-1, 1),)), dict(min_tokens=9),
                                 dict(min_tokens=-1), dict(stop_token_ids=(-3,))])
def test_the_engine_refuses_knobs_out_of_range(bad):
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=8, **bad)


def test_top_k_minus_one_is_off():
    assert SamplingParams(top_k=-1).top_k == 0
