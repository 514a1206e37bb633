"""Prefix caching: how much faster a re-sent conversation's turns start, and whether a cache hit leaks across tenants.

    python -m bench.prefix [--quick] [--redis-url URL] [--threads N]

(a) A 10-turn conversation with a 1,000-token system prompt, every turn re-sending the whole conversation
(as chat clients do), on two engines side by side that differ only in the prefix cache: time to first
token per turn (prefill of the whole prompt; the cached engine computes only what follows its longest
cached prefix) and the greedy answers, which must be identical. Target: turns 2-10 at least 3x faster.

(b) The timing side channel (CVE-2025-46570): tenant A sends prefixes; then tenant B probes, once each,
prefixes A did and did not send (interleaved at random), and so does A itself. A classifier on the probe's
time to first token (the ROC AUC of "faster means sent") must not tell B's two kinds apart (AUC <= 0.6,
taken symmetric: max(AUC, 1 - AUC)), while it tells A's apart (AUC >= 0.9: the test has power).

Both engines use the Redis ledger (pools under a throwaway key prefix, removed at the end). One JSON line.
"""
import argparse
import os
import random
import time
import uuid

import redis
import torch

from bench.common import emit_json, log, median, print_table
from bench.guards import shared_model
from inference.engine import Engine, EngineConfig
from inference.ledger import RedisLedger
from inference.loader import load_model
from inference.sequence import SamplingParams
from inference.threads import threads_set

DEFAULT_REDIS_URL = os.environ.get("KVSERVE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
SALT_A, SALT_B = "a" * 64, "b" * 64  # what kvserve/chat/salt.py derives for two tenants (any two differ)


def ttft(engine: Engine, rid: str, prompt: list[int], salt: str | None, max_tokens: int):
    """(seconds to the first token, the greedy output ids); the request runs to its end."""
    seq = engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), salt=salt)
    t0 = time.perf_counter()
    first = None
    while not seq.is_done:
        engine.step()
        if first is None and seq.output_ids:
            first = time.perf_counter() - t0
    engine.seqs.pop(rid, None)
    if seq.error:
        raise RuntimeError(f"{rid} failed: {seq.error}")
    return first, list(seq.output_ids)


def auc(positive: list[float], negative: list[float]) -> float:
    """P(score of a positive > score of a negative), ties half (Mann-Whitney): here score = -TTFT, positive =
    a prefix that was sent (a hit would make it faster)."""
    wins = sum((p > n) + 0.5 * (p == n) for p in positive for n in negative)
    return wins / (len(positive) * len(negative))


def words(tokenizer, rng: random.Random, n: int) -> list[int]:
    vocab = ("cargo vessel harbour customs manifest tonnage container route port weather delay invoice "
             "freight insurance crane berth pilot tide draft ballast ledger").split()
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" " + " ".join(rng.choice(vocab) for _ in range(64)))
    return ids[:n]


def conversation(engines: dict[str, Engine], tokenizer, system_tokens: int, turns: int, answer_tokens: int):
    rng = random.Random(1)
    system = words(tokenizer, rng, system_tokens)
    users = [words(tokenizer, rng, 24) for _ in range(turns)]
    rows, answers = [], {name: [] for name in engines}
    history = {name: list(system) for name in engines}
    for t in range(turns):
        row = {"turn": t + 1}
        for name, engine in engines.items():
            prompt = history[name] + users[t]
            secs, out = ttft(engine, f"{name}-turn{t}", prompt, SALT_A, answer_tokens)
            row[f"{name}_ttft_ms"] = secs * 1000
            row["prompt_tokens"] = len(prompt)
            answers[name].append(out)
            history[name] = prompt + out
        row["speedup"] = row["nocache_ttft_ms"] / row["cache_ttft_ms"]
        rows.append(row)
        log(f"turn {t + 1}: {row['prompt_tokens']} tokens, no cache {row['nocache_ttft_ms']:.0f} ms, "
            f"cache {row['cache_ttft_ms']:.0f} ms ({row['speedup']:.1f}x)")
    return rows, answers["cache"] == answers["nocache"]


def side_channel(engine: Engine, tokenizer, probes: int, prefix_tokens: int, suffix_tokens: int):
    rng = random.Random(2)
    half = probes // 2
    sent = [words(tokenizer, rng, prefix_tokens) for _ in range(half)]
    unsent = [words(tokenizer, rng, prefix_tokens) for _ in range(half)]
    for i, prefix in enumerate(sent):  # tenant A's traffic
        ttft(engine, f"a-send{i}", prefix + words(tokenizer, rng, suffix_tokens), SALT_A, 1)
    timings = {"B": ([], []), "A": ([], [])}
    # pairs (a sent and an unsent prefix, in random order) probed back to back, so that load from other
    # processes falls on both kinds alike; B probes each pair before A (A's misses then add A's pages)
    for i, pair in enumerate(zip(sent, unsent)):
        kinds = [(True, pair[0]), (False, pair[1])]
        rng.shuffle(kinds)
        for who, salt in (("B", SALT_B), ("A", SALT_A)):
            for was_sent, prefix in kinds:
                secs, _ = ttft(engine, f"{who}-probe{i}-{was_sent}", prefix + words(tokenizer, rng, suffix_tokens),
                               salt, 1)
                timings[who][0 if was_sent else 1].append(-secs)
    out = {}
    for who, (pos, neg) in timings.items():
        a = auc(pos, neg)
        out[who] = {"auc": a, "auc_symmetric": max(a, 1 - a), "probes": len(pos) + len(neg),
                    "sent_ttft_ms_median": -median(pos) * 1000, "unsent_ttft_ms_median": -median(neg) * 1000}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 turns, 200-token system prompt, 40 probes")
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    parser.add_argument("--threads", type=int, help="torch threads (default: all CPUs; 1 with --quick)")
    args = parser.parse_args(argv)
    threads_set(args.threads or (1 if args.quick else os.cpu_count() or 1))
    system_tokens, turns, probes = (200, 3, 40) if args.quick else (1000, 10, 200)
    answer_tokens, prefix_tokens, suffix_tokens, page_size = 16, 64, 4, 16
    started = time.perf_counter()
    model = load_model()
    client = redis.Redis.from_url(args.redis_url)
    client.ping()
    prefix = f"kvbench-{uuid.uuid4().hex[:10]}"
    ledgers: list[RedisLedger] = []

    def ledger_factory(num_pages: int) -> RedisLedger:
        ledgers.append(RedisLedger.register(client, f"prefix{len(ledgers)}", "prefill", num_pages, page_size,
                                            prefix=prefix))
        return ledgers[-1]

    conv_pages = -(-(system_tokens + turns * (24 + answer_tokens) + answer_tokens) // page_size) * 2 + 16
    probe_pages = (probes * 2 + probes // 2) * -(-(prefix_tokens + suffix_tokens + 1) // page_size) + 16

    def engine(cache: bool, pages: int) -> Engine:
        config = EngineConfig(num_pages=pages, page_size=page_size, chunk_size=2048, prefix_cache=cache)
        return Engine(model, config, allocator_factory=ledger_factory)

    try:
        with shared_model():
            engines = {"nocache": engine(False, conv_pages), "cache": engine(True, conv_pages)}
            probing = engine(True, probe_pages)
        log(f"bench.prefix: model {model.source}, {torch.get_num_threads()} threads, ledger prefix {prefix} "
            f"(set up in {time.perf_counter() - started:.1f}s)")
        for e in (*engines.values(), probing):  # warm-up, without a salt: nothing cached
            ttft(e, "warm", list(range(100, 164)), None, 2)
        rows, identical = conversation(engines, model.tokenizer, system_tokens, turns, answer_tokens)
        print_table(rows, ["turn", "prompt_tokens", "nocache_ttft_ms", "cache_ttft_ms", "speedup"],
                    title="(a) time to first token per turn")
        later = [r["speedup"] for r in rows[1:]]
        channel = side_channel(probing, model.tokenizer, probes, prefix_tokens, suffix_tokens)
        print_table([{"prober": who, **v} for who, v in channel.items()],
                    title="(b) probes of sent vs unsent prefixes (AUC of 'faster means sent')")
        for ledger in ledgers:
            ledger.check_integrity()
    finally:
        for ledger in ledgers:
            ledger.unregister()
    result = {
        "bench": "prefix", "model": os.path.basename(model.source), "quick": args.quick,
        "threads": torch.get_num_threads(), "system_tokens": system_tokens, "turns": turns,
        "ttft_ms_nocache": [r["nocache_ttft_ms"] for r in rows], "ttft_ms_cache": [r["cache_ttft_ms"] for r in rows],
        "speedup_turns_2_on_median": median(later), "speedup_turns_2_on_min": min(later) if later else None,
        "answers_identical": identical,
        "probes_per_tenant": channel["B"]["probes"], "prefix_tokens": prefix_tokens,
        "auc_cross_tenant": channel["B"]["auc_symmetric"], "auc_same_tenant": channel["A"]["auc"],
        "side_channel": channel,
        "targets": {"speedup_3x": bool(later) and min(later) >= 3, "answers_identical": identical,
                    "cross_tenant_auc_le_0.6": channel["B"]["auc_symmetric"] <= 0.6,
                    "same_tenant_auc_ge_0.9": channel["A"]["auc"] >= 0.9},
        "seconds": time.perf_counter() - started,
    }
    emit_json(result)
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
