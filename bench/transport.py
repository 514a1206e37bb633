"""KV transport against prefill compute: `python -m bench.transport`.

For 512-token prompts, times (a) the prefill forward pass and (b) the Redis transport round trip
of the resulting pages (send: serialize + HSET; accept: signature and contract, HGETALL + DEL, epoch fence, checksums, tensor),
interleaved over several repeats in one process, and reports the median ratio transfer / prefill
(target ≤ 0.25). Uses Redis DB 15 under a unique key prefix and deletes its own keys.
"""
import argparse
import os
import uuid

import redis

from bench.common import chat_prompts, emit_json, median, now, print_table
from inference.engine import Engine, EngineConfig
from inference.handoff import DecodeSide, Handoff, Verdict, blob_metadata, handoff_accept
from inference.loader import load_model
from inference.sequence import SamplingParams
from inference.transport import RedisTransport


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args(argv)
    model = load_model()
    engine = Engine(model, EngineConfig(num_pages=256))
    client = redis.Redis.from_url(os.environ.get("KVSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"))
    transport = RedisTransport(client, prefix=f"kvsbench-{uuid.uuid4().hex[:8]}", ttl_s=60)
    (prompt,) = chat_prompts(model.tokenizer, 1, args.tokens, args.tokens)
    key = b"bench-handoff-key"

    def side(rid):
        return DecodeSide(rid, len(prompt), engine.fingerprint, 16, "float32", tuple(engine.pool.data.shape[1:]))

    rows = []
    for i in range(args.repeats + 1):
        t0 = now()
        seq = engine.add_request(f"t{i}", prompt, SamplingParams(max_tokens=1), prefill_only=True)
        while not seq.is_done:
            engine.step()
        prefill_s = now() - t0
        blob, sums = engine.export_kv(seq)
        handoff = Handoff(request_id=f"t{i}", verdict=Verdict.OK, reason="", expected_tokens=len(prompt),
                          transferred_tokens=len(prompt), num_pages=blob.shape[0], page_checksums=tuple(sums),
                          page_epochs=tuple(seq.page_epochs[: blob.shape[0]]), model_fingerprint=engine.fingerprint,
                          page_size=16, dtype="float32", prefill_worker="bench", **blob_metadata(blob)).signed(key)
        engine.release(seq)
        t1 = now()
        transport.send(handoff, blob)
        t2 = now()
        handoff_accept(handoff, key, side(f"t{i}"), transport.take)
        t3 = now()
        if i:  # the first round warms caches
            rows.append({"prefill_ms": prefill_s * 1e3, "send_ms": (t2 - t1) * 1e3, "receive_ms": (t3 - t2) * 1e3,
                         "ratio": (t3 - t1) / prefill_s, "mb": blob.numel() * 4 / 2**20})
    print_table(rows, title=f"prefill vs transport, {len(prompt)}-token prompt")
    emit_json({"bench": "transport", "prompt_tokens": len(prompt), "kv_mb": rows[0]["mb"],
               "prefill_ms_p50": median(r["prefill_ms"] for r in rows),
               "transfer_ms_p50": median(r["send_ms"] + r["receive_ms"] for r in rows),
               "ratio_transfer_vs_prefill": median(r["ratio"] for r in rows)})


if __name__ == "__main__":
    main()
