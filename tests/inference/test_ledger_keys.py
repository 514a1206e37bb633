"""One package names the ledger's keys, one module the registry's: a scan of the source tree for any other
code that builds them. Tests may still read raw keys (they play Redis losing records); shipped code may not."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("inference", "kvserve", "incidents", "bench", "scripts")
OWNERS = ("inference/ledger/", "inference/registry.py")
# the key builder itself, anywhere (tests included)
BUILDER = re.compile(r"\bledger_key\(|inference\.ledger\.keys\b|\bpool_keys\(|\bowner_prefix\(")
# a ledger or registry key spelled out, or the registry's key method called from outside it (shipped code)
SPELLED = re.compile(r"\}:pools?\b|:pool:|:workers:|registry(\(\))?\.key\(")


def _sources(dirs):
    for top in dirs:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def _offenders(pattern, dirs, allowed):
    return [f"{rel}:{n}: {line.strip()}" for rel, text in _sources(dirs) if not rel.startswith(allowed)
            for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]


def test_the_patterns_find_the_owners_own_keys():
    assert _offenders(BUILDER, ("inference",), ("inference/registry.py",))  # the ledger package builds its keys
    assert _offenders(SPELLED, ("inference",), ("inference/ledger/",))  # and the registry its own


def test_only_the_ledger_package_calls_the_key_builder():
    me = Path(__file__).relative_to(ROOT).as_posix()
    assert _offenders(BUILDER, SHIPPED + ("tests",), OWNERS + (me,)) == []


def test_no_shipped_code_outside_the_owners_spells_a_ledger_or_registry_key():
    assert _offenders(SPELLED, SHIPPED, OWNERS) == []
