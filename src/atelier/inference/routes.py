"""MoE routes as the sampler returns them and a trajectory stores them, without torch.

A route array is numpy uint8 (fewer than 255 experts) or uint16, shape
[tokens, MoE layers, k]: the expert ids the routers chose for each token,
the type's largest value where nothing was recorded (atelier.moe.replay
packs and unpacks them for the trainer). In JSON (a saved trajectory, the
`/v1/generate` answer) it is `{"dtype", "shape", "b64"}`: L * k bytes per
token in base64.
"""

from __future__ import annotations

import base64
from typing import Any


def merge_routes(old: Any, new: Any) -> Any:
    """`new` (one row per token) with the rows `old` already recorded kept (the first record wins)."""
    import numpy as np

    if old is None:
        return new
    merged = new.copy()
    n = min(len(old), len(new))
    kept = (old[:n] != np.iinfo(old.dtype).max).all(axis=(1, 2))
    merged[:n][kept] = old[:n][kept].astype(new.dtype)
    return merged


def pad_routes(routes: Any, n: int) -> Any:
    """`routes` with `n` more rows of no record (tokens appended that the sampler has not fed yet)."""
    import numpy as np

    if routes is None or n == 0:
        return routes
    pad = np.full((n, *routes.shape[1:]), np.iinfo(routes.dtype).max, dtype=routes.dtype)
    return np.concatenate([routes, pad])


def encode_routes(routes: Any) -> dict[str, Any] | None:
    """A packed routes array as JSON: dtype, shape and the bytes in base64."""
    if routes is None:
        return None
    return {"dtype": str(routes.dtype), "shape": list(routes.shape),
            "b64": base64.b64encode(routes.tobytes()).decode("ascii")}


def decode_routes(data: dict[str, Any] | None) -> Any:
    import numpy as np

    if data is None:
        return None
    return np.frombuffer(base64.b64decode(data["b64"]), dtype=data["dtype"]).reshape(data["shape"]).copy()
