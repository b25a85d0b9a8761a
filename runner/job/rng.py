"""A rank's random number generators, saved with each checkpoint and put back on resume: exact resume needs the
dropout and shuffling draws of the uninterrupted run."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def state() -> dict[str, Any]:
    """Every generator a training step may draw from: torch's (CPU and every GPU), Python's, numpy's."""
    got = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        got["cuda"] = torch.cuda.get_rng_state_all()
    return got


def restore(saved: dict[str, Any]) -> None:
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
