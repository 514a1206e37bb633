"""Secrets from the environment, else from the ignored var/secrets.json (generated on first use).

Never commit var/. Every process on one host shares the file, so a lock serialises first-run generation.
"""
import fcntl
import json
import os
import secrets
import tempfile
from pathlib import Path

from inference.settings import env_raw
from kvserve.paths import var_dir


def _default_path() -> Path:
    """KVSERVE_SECRETS_FILE, else var/secrets.json (two stacks on one host may keep separate files)."""
    explicit = env_raw("KVSERVE_SECRETS_FILE")
    return Path(explicit) if explicit else var_dir() / "secrets.json"


def _read(path: Path) -> dict[str, str]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _write_atomic(path: Path, data: dict[str, str]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".secrets-", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def secret_get(name: str, *, path: Path | None = None, generate: bool = True) -> str:
    """The secret `name`: env var first, then the secrets file; generated (32 random bytes, hex) if
    absent, or KeyError when `generate` is False."""
    if env_raw(name) is not None:
        return env_raw(name)
    path = Path(path) if path else _default_path()
    value = _read(path).get(name)
    if value:
        return value
    if not generate:
        raise KeyError(name)
    return _update(path, name, None)


def secret_set(name: str, value: str, *, path: Path | None = None) -> None:
    """Stores a value generated elsewhere (the demo API key) in the secrets file."""
    _update(Path(path) if path else _default_path(), name, value)


def _update(path: Path, name: str, value: str | None) -> str:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = _read(path)  # another process may have generated it while we waited
        if value is not None or not data.get(name):
            data[name] = value if value is not None else secrets.token_hex(32)
            _write_atomic(path, data)
        return data[name]
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
