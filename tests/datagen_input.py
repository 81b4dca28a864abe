"""The samples of the stand-in data scripts (``tests/stock_datagen.py``, ``tests/fake_datagen.py``).

The stock script reads its dataset through speculators' preprocessing (chat template, HF datasets);
the stand-ins read pre-tokenized samples (``input_ids``, ``loss_mask``) from a local JSON-lines file.
Kept out of the scripts because it is not the stock code: the runner recognises a script by its
save and resume functions, which stay in each script.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_samples(path: str, max_samples: int | None = None) -> list[dict]:
    """The JSON-lines file's samples, blank lines skipped, the first ``max_samples`` (all if None)."""
    lines = Path(path).read_text().splitlines()
    dataset = [json.loads(line) for line in lines if line]
    return dataset if max_samples is None else dataset[:max_samples]
