"""owners_held_tokens: what each owner really holds, over every registered pool (the fair-share count)."""
from inference.ledger import RedisLedger, owners_held_tokens


def test_holdings_follow_grants_extensions_and_frees_in_every_pool(redis_client, ledger_prefix):
    a = RedisLedger.register(redis_client, "pa", "prefill", 16, 4, prefix=ledger_prefix)
    b = RedisLedger.register(redis_client, "pb", "decode", 16, 8, prefix=ledger_prefix)
    assert owners_held_tokens(redis_client, ["r1", "r2"], ledger_prefix) == {"r1": 0, "r2": 0}
    g = a.allocate("r1", 2)
    b.allocate("r1", 1)
    b.allocate("r2", 3)
    assert owners_held_tokens(redis_client, ["r1", "r2", "r3"], ledger_prefix) == {"r1": 2 * 4 + 8, "r2": 24, "r3": 0}
    b.extend("r2", 2)  # pages on demand: the count grows with what is really held
    a.free("r1", g.pages[:1], g.epochs[:1])
    assert owners_held_tokens(redis_client, ["r1", "r2"], ledger_prefix) == {"r1": 4 + 8, "r2": 40}
    b.release("r2")
    b.unregister()
    assert owners_held_tokens(redis_client, ["r1", "r2"], ledger_prefix) == {"r1": 4, "r2": 0}
    assert owners_held_tokens(redis_client, [], ledger_prefix) == {}



def test_holdings_are_read_again_when_a_connection_drops_mid_read(redis_client, ledger_prefix):
    """Admission reads them for every tenant with requests in flight: a connection dropped under the read (as
    tests/e2e/test_redis_kills.py does every second) is a repeat, not a refused request. The drop is injected
    into a real client: its pools listing ran, its reply is lost with the connection."""
    import redis

    from tests.conftest import TEST_REDIS_URL

    class DropsOneReply(redis.Redis):
        dropped = 0

        def smembers(self, name):
            reply = super().smembers(name)
            if not self.dropped:
                self.dropped += 1
                self.connection_pool.disconnect()
                raise redis.ConnectionError("Connection closed by server (injected)")
            return reply

    a = RedisLedger.register(redis_client, "pa", "prefill", 16, 4, prefix=ledger_prefix)
    a.allocate("r1", 2)
    reader = DropsOneReply.from_url(TEST_REDIS_URL)
    assert owners_held_tokens(reader, ["r1", "r2"], ledger_prefix) == {"r1": 8, "r2": 0}
    assert reader.dropped == 1
