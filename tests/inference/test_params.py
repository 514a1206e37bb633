"""RequestParams: the sampling choices a request set, apart from who asked and through which endpoint; stored
versioned, the flat form requests had before read as version 1, an unknown version or field refused."""
import pytest

from inference.params import VERSION, ParamsFormatError, RequestParams, Sampling
from inference.sequence import SamplingParams

ASKED = RequestParams(Sampling(temperature=0.7, top_p=0.9, seed=-5, stop=("\n",), logprobs=2), user="u-1",
                      endpoint="completions")


@pytest.mark.parametrize("params", [RequestParams(), ASKED, RequestParams(Sampling(seed=3, stop=[]))])
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
    ({"v": 1, "sampling": {"top_k": 5}}, "malformed request parameters"),
    ({"v": 1, "sampling": {}, "tenant": "someone"}, r"unknown fields \['tenant'\]"),
    ({"v": 1, "sampling": {}, "endpoint": "embeddings"}, "endpoint 'embeddings' is not one of"),
    ({"frequency_penalty": 1.0}, "malformed request parameters"),
    (["temperature", 0.7], "a JSON object, not list"),
])
def test_anything_else_is_refused_by_name(stored, words):
    with pytest.raises(ParamsFormatError, match=words):
        RequestParams.from_dict(stored)


def test_request_params_are_frozen():
    with pytest.raises(AttributeError):
        ASKED.user = "someone else"
