"""inference/settings.py: strict parsers that refuse a malformed value with a SettingError naming the variable
and the forms it accepts (an empty value is the default), and the engine's and runtime's settings read there."""
import re
from pathlib import Path

import pytest

from inference.engine import EngineConfig
from inference.settings import (SettingError, engine_settings, env_bool, env_choice, env_float, env_int, env_list,
                                env_parsed, port_setting, redis_url_setting, runtime_settings)
from inference.worker import RuntimeOptions


@pytest.mark.parametrize("raw, value", [("1", True), ("TRUE", True), ("Yes", True), ("on", True), (" on ", True),
                                        ("0", False), ("false", False), ("NO", False), ("Off", False)])
def test_booleans_in_every_accepted_form(raw, value):
    assert env_bool("X_FLAG", not value, env={"X_FLAG": raw}) is value


@pytest.mark.parametrize("raw", ["2", "maybe", "y", "enabled", "tru", "-1"])
def test_anything_else_is_not_a_boolean(raw):
    with pytest.raises(SettingError, match=r"X_FLAG='.*' is not valid: use 1/0, true/false, yes/no or on/off"):
        env_bool("X_FLAG", False, env={"X_FLAG": raw})


def test_unset_or_empty_is_the_default():
    for env in ({}, {"X": ""}, {"X": "  "}):
        assert env_bool("X", True, env=env) is True and env_int("X", 7, env=env) == 7
        assert env_float("X", 0.5, env=env) == 0.5 and env_choice("X", "a", ("a", "b"), env=env) == "a"


@pytest.mark.parametrize("parse, raw, fragment", [
    (lambda e: env_int("X_N", 1, env=e), "1.5", "whole number"),
    (lambda e: env_int("X_N", 1, env=e), "ten", "whole number"),
    (lambda e: env_int("X_N", 1, low=1, env=e), "0", ">= 1"),
    (lambda e: env_int("X_N", 1, low=1, high=9, env=e), "10", ">= 1 and <= 9"),
    (lambda e: env_float("X_N", 1.0, env=e), "fast", "a number"),
    (lambda e: env_float("X_N", 1.0, env=e), "nan", "finite"),
    (lambda e: env_float("X_N", 0.5, low=0, high=1, env=e), "1.5", "<= 1"),
    (lambda e: env_choice("X_N", "a", ("a", "b"), env=e), "c", "one of a, b"),
])
def test_numbers_and_choices_are_strict_and_name_the_variable(parse, raw, fragment):
    with pytest.raises(SettingError, match="X_N") as err:
        parse({"X_N": raw})
    assert fragment in str(err.value) and err.value.name == "X_N"


def test_parsed_values_report_the_parsers_reason_and_the_form():
    def parse(text):
        if "=" not in text:
            raise ValueError("no '=' in it")
        return text

    assert env_parsed("X_G", "", parse, "g=a,b", env={"X_G": "g=a"}) == "g=a"
    with pytest.raises(SettingError, match=r"X_G='oops' is not valid: no '=' in it \(the form: g=a,b\)"):
        env_parsed("X_G", "", parse, "g=a,b", env={"X_G": "oops"})
    assert env_list("X_L", "a, b,,c", env={}) == ["a", "b", "c"]


def test_engine_and_runtime_defaults_are_the_dataclasses():
    engine, config = engine_settings(env={}), EngineConfig()
    for name in ("num_pages", "page_size", "chunk_size", "max_num_seqs", "window", "scrub_policy", "watermark",
                 "dtype", "precision"):
        assert engine[name] == getattr(config, name), name
    assert engine["prefix_cache"] is True and engine["device"] is None and "pool_mb" not in engine
    assert RuntimeOptions(**runtime_settings(env={})) == RuntimeOptions()


@pytest.mark.parametrize("name, raw", [("KVSERVE_NUM_PAGES", "1k"), ("KVSERVE_PAGE_SIZE", "0"),
                                       ("KVSERVE_SCRUB", "sometimes"), ("KVSERVE_WATERMARK", "2"),
                                       ("KVSERVE_DTYPE", "int4"), ("KVSERVE_PREFIX_CACHE", "maybe"),
                                       ("KVSERVE_WINDOW", "-1"), ("KVSERVE_POOL_MB", "lots"),
                                       ("KVSERVE_PRECISION", "int8"), ("KVSERVE_KV_DTYPE", "fp8")])
def test_a_malformed_engine_setting_is_refused(name, raw):
    with pytest.raises(SettingError, match=name):
        engine_settings(env={name: raw})


@pytest.mark.parametrize("name, raw", [("KVSERVE_CLAMP_WINDOW", "maybe"), ("KVSERVE_LEASE_TTL_S", "30s"),
                                       ("KVSERVE_LOOP_MAX_FAILURES", "0"), ("KVSERVE_TRANSPORT_TTL_S", "1.5")])
def test_a_malformed_runtime_setting_is_refused(name, raw):
    with pytest.raises(SettingError, match=name):
        runtime_settings(env={name: raw})


def test_precision_is_read_and_its_choices_are_the_engines():
    from inference.precision import SETTING_CHOICES
    from inference.settings import PRECISIONS

    assert sorted(PRECISIONS) == sorted(SETTING_CHOICES)
    assert engine_settings(env={})["precision"] == "fp32"
    assert engine_settings(env={"KVSERVE_PRECISION": "BF16"})["precision"] == "bf16"


@pytest.mark.parametrize("name", ["KVSERVE_INT4_ROWS", "KVSERVE_W4A8_ROWS"])
def test_coded_rows_are_auto_or_a_positive_count(name):
    from inference.settings import int4_rows_setting, w4a8_rows_setting

    read = {"KVSERVE_INT4_ROWS": int4_rows_setting, "KVSERVE_W4A8_ROWS": w4a8_rows_setting}[name]
    assert read(env={}) is None and read(env={name: "Auto"}) is None
    assert read(env={name: "8"}) == 8
    for raw in ("0", "eight"):
        with pytest.raises(SettingError, match=name):
            read(env={name: raw})


def test_from_env_reads_the_same_settings(monkeypatch):
    monkeypatch.setenv("KVSERVE_NUM_PAGES", "77")
    monkeypatch.setenv("KVSERVE_CLAMP_WINDOW", "ON")
    monkeypatch.setenv("KVSERVE_POOL_MB", "9")  # ignored: KVSERVE_NUM_PAGES wins
    assert EngineConfig.from_env().num_pages == 77 and EngineConfig.from_env().pool_mb is None
    assert RuntimeOptions.from_env().clamp_window is True
    monkeypatch.setenv("KVSERVE_CLAMP_WINDOW", "maybe")
    with pytest.raises(SettingError, match="KVSERVE_CLAMP_WINDOW"):
        RuntimeOptions.from_env()


def test_redis_url_and_port_are_read_here_and_the_port_is_strict():
    assert redis_url_setting(env={}) == "redis://127.0.0.1:6379/0" and port_setting(env={}) == 8000
    assert redis_url_setting(env={"REDIS_URL": "redis://r:6380/2"}) == "redis://r:6380/2"
    for raw in ("http", "0", "65536"):
        with pytest.raises(SettingError, match="KVSERVE_PORT"):
            port_setting(env={"KVSERVE_PORT": raw})


_STRICT = re.compile(r"""env_(?:raw|str|int|float|bool|choice|list|parsed)\(\s*["']([A-Z][A-Z0-9_]+)["']""")
_RAW = re.compile(r"""os\.(?:environ\.get\(|getenv\(|environ\[)\s*["']([A-Z][A-Z0-9_]+)["'](?!\s*\]\s*=)""")
OURS = re.compile(r"KVSERVE_|DJANGO_|DATABASE_|REDIS_URL$")  # kvserve's settings (not PATH, MALLOC_ARENA_MAX, ...)
ROOT = Path(__file__).resolve().parents[2]


def _reads(pattern, *packages) -> dict[str, list[str]]:
    """Each environment variable a read of `pattern` names in the packages' sources -> where (path:line)."""
    found: dict[str, list[str]] = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            for match in pattern.finditer(text):
                where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
                found.setdefault(match.group(1), []).append(where)
    return found


def test_each_setting_is_read_in_one_place_through_the_strict_readers():
    production = ("kvserve", "incidents", "inference", "scripts")
    strict = _reads(_STRICT, *production)
    assert {name: at for name, at in strict.items() if len(at) > 1} == {}
    raw = {name: at for name, at in _reads(_RAW, *production, "bench").items() if OURS.match(name)}
    # bench reads its own variables (KVSERVE_BENCH_REDIS_URL, KVSERVE_TEST_REDIS_URL) directly, never kvserve's
    assert {name: at for name, at in raw.items() if name in strict or not name.startswith(("KVSERVE_BENCH_",
                                                                                            "KVSERVE_TEST_"))} == {}
    assert len(strict) > 60  # the scan sees the reads (engine, runtime, web, database, logs)
