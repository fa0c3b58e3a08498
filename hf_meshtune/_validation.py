"""One way to reject bad input: a ``ValueError`` that names the field, the value and the rule."""

from __future__ import annotations

from typing import Any


def require(ok: bool, field: str, value: Any, rule: str) -> None:
    """Raise ``ValueError("<field>=<value> is invalid: it must <rule>")`` unless ``ok``.

    ``rule`` is phrased as what is required, e.g. ``"lie in [0, 1)"`` or ``"be > 0"``.
    """
    if not ok:
        raise ValueError(f"{field}={value!r} is invalid: it must {rule}")
