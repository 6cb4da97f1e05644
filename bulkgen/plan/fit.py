"""The least-squares fit the planner's measured costs share (profile.py's step costs, encoder.py's image
costs): coefficients that cannot be negative, since a negative cost is noise."""

from __future__ import annotations

import numpy as np


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares, dropping a coefficient that comes out negative (a negative cost is noise)."""
    keep = np.ones(x.shape[1], bool)
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            return [float(c) for c in coef]
        keep &= coef > 0
