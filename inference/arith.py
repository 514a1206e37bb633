"""Integer arithmetic shared across the package (no torch: Django-side modules import it too)."""


def cdiv(a, b):
    """Ceiling division, for ints and integer tensors alike (pages needed for `a` tokens)."""
    return (a + b - 1) // b
