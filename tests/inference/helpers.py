"""Small builders shared by the engine tests."""
from inference.engine import Engine, EngineConfig
from inference.sequence import SamplingParams


def make_engine(model, **config) -> Engine:
    config.setdefault("num_pages", 64)
    return Engine(model, EngineConfig(**config))


def greedy(max_tokens=16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def run_until_done(engine, seqs):
    while any(not s.is_done for s in seqs):
        engine.step()
    return seqs
