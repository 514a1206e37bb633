"""The one admission rule (inference.admission) and every caller of it: engine, worker registration, registry,
sandbox replay."""
from inference import admission
from inference.registry import WorkerInfo


def info(**kw) -> WorkerInfo:
    base = dict(worker_id="w", role="decode", host="h", pid=1, num_pages=600, page_size=16, capacity_tokens=9600,
                window=8192, model_fingerprint="fp", dtype="float32", device="cpu", attention_backend="sdpa",
                scrub_policy="on_free")
    return WorkerInfo(**{**base, **kw})


def test_the_limit_is_the_smallest_of_window_pool_and_model_context():
    assert admission.serving_limit(8192, 9600, 2048) == 2048
    assert admission.serving_limit(8192, 4096, 16384) == 4096
    assert admission.serving_limit(1024, 4096) == 1024
    assert admission.deployment_limit([3000, 2048, 9000]) == 2048 and admission.deployment_limit([]) is None


def test_admission_error_names_the_numbers_and_lets_what_fits_through():
    assert admission.admission_error(100, 28, 128) is None
    reason = admission.admission_error(100, 29, 128, "window 128")
    assert "100 + max_tokens 29 = 129" in reason and "limit of 128" in reason and "window 128" in reason


def test_a_worker_registration_includes_the_models_context_length():
    assert info(max_position=2048).serving_limit == 2048  # the window (8192) is more than the model serves
    assert info().serving_limit == 8192  # an older registration without it: window and pool


def test_the_registry_limit_is_the_smallest_worker_limit(registry):
    registry.register(info(worker_id="p", role="prefill", max_position=4096))
    registry.register(info(worker_id="d", capacity_tokens=3000))
    assert registry.effective_limit() == 3000
    registry.register(info(worker_id="d2", max_position=2048))
    assert registry.effective_limit() == 2048


def test_the_engine_and_the_sandbox_use_the_same_rule(tiny_model):
    from inference.engine import Engine, EngineConfig
    from inference.sandbox import IncidentReplay

    engine = Engine(tiny_model, EngineConfig(num_pages=64, window=100_000))
    mp = tiny_model.config.max_position
    assert engine.effective_limit == admission.serving_limit(100_000, 1024, mp) == min(1024, mp)
    assert engine.admission_error(engine.effective_limit, 1) is not None
    replay = IncidentReplay(tiny_model, sentinel="X", prefill_pages=4, decode_pages=8)
    assert replay.admission_limit == min(replay.prefill.effective_limit, replay.decode.effective_limit) == 64
