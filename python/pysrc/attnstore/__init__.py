"""attnstore: a storage engine for the attention KV cache of long-context LLM inference.

>>> import numpy as np, attnstore
>>> eng = attnstore.Engine()
>>> ctx = eng.create_context(q_heads=8, kv_heads=2, head_dim=64, layers=1, dtype="f32")
>>> k = np.random.randn(2, 4096, 64).astype(np.float32)
>>> v = np.random.randn(2, 4096, 64).astype(np.float32)
>>> eng.prefill(ctx, 0, k, v)
>>> q = np.random.randn(8, 64).astype(np.float32)
>>> eng.attend(ctx, 0, q, exact=True).shape
(8, 64)
"""

from ._attnstore import (
    Attached,
    AttnstoreError,
    Budget,
    ClosedError,
    CorruptDataError,
    Engine,
    InvalidArgumentError,
    Plan,
    RemoteError,
    RemoteTier,
    ShapeError,
    StalePlanError,
    StorageError,
    UnknownContextError,
    model_id,
)

__all__ = [
    "Attached",
    "AttnstoreError",
    "Budget",
    "ClosedError",
    "CorruptDataError",
    "Engine",
    "InvalidArgumentError",
    "Plan",
    "RemoteError",
    "RemoteTier",
    "ShapeError",
    "StalePlanError",
    "StorageError",
    "UnknownContextError",
    "model_id",
]
