"""Small checks shared by the argument and parameter validators."""

import math


def is_finite(value) -> bool:
    """``math.isfinite`` for any real number, False for an int past float's
    range (where ``math.isfinite`` raises ``OverflowError``), so that a
    validator refuses it with its own message."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
