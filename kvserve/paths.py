"""Filesystem locations of the project: the repo root and the ignored runtime folder var/."""
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"


def var_dir() -> Path:
    """var/ (SQLite file, generated secrets), created on first use, private to this user."""
    VAR_DIR.mkdir(mode=0o700, exist_ok=True)
    return VAR_DIR
