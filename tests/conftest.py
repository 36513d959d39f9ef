"""Shared test fixtures: the per-dtype tolerances (`tolerances.py`)."""
from __future__ import annotations

import pytest
import torch
from tolerances import TOL, Tolerances


@pytest.fixture
def tol() -> dict[torch.dtype, Tolerances]:
    """The tolerance table by dtype: ``tol[torch.float64].converged`` and so on."""
    return TOL
