"""Type stubs of the extension module (see src/lib.rs for the full docs)."""

import os
from typing import Any, List, Optional, Union

import numpy as np
import numpy.typing as npt

# NumPy float32/float16/float64 arrays, or any CPU tensor with __dlpack__ (torch, JAX).
ArrayLike = Union[npt.NDArray[Union[np.float32, np.float16, np.float64]], Any]

class AttnstoreError(Exception): ...
class ShapeError(AttnstoreError): ...
class UnknownContextError(AttnstoreError): ...
class InvalidArgumentError(AttnstoreError): ...
class CorruptDataError(AttnstoreError): ...
class StorageError(AttnstoreError): ...
class StalePlanError(AttnstoreError): ...

class Plan:
    def explain(self) -> str:
        """The plan as text, one line per request and zone (EXPLAIN)."""

class Engine:
    def __init__(self, path: Optional[Union[str, os.PathLike]] = None, host_blocks: Optional[int] = None) -> None:
        """In memory, or durable at `path`; `host_blocks`: a buffer manager of that many 2 KiB blocks."""
    def create_context(
        self,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        layers: int = 1,
        dtype: str = "f16",
        method: str = "wave",
        codec: Optional[str] = None,
    ) -> int:
        """Creates a context (dtype f32/f16/bf16, method wave/pq/flat, codec None or "hack2")."""
    def drop_context(self, ctx: int) -> None: ...
    def prefill(self, ctx: int, layer: int, k: ArrayLike, v: ArrayLike) -> None:
        """Stores a layer's prompt KV, `k` and `v` of shape [kv_heads, tokens, head_dim]."""
    def append(self, ctx: int, layer: int, k: ArrayLike, v: ArrayLike) -> None:
        """Appends decode tokens' KV, [kv_heads, tokens, head_dim]."""
    def wait_index(self, ctx: int, layer: int, timeout: float = 600.0) -> bool: ...
    def plan(self, ctx: int, layer: int, q: ArrayLike, exact: bool = False, retrieve: Optional[float] = None) -> Plan:
        """Plans attention of `q` [q_heads, head_dim] over a layer."""
    def execute(self, plan: Plan) -> List[npt.NDArray[np.float32]]:
        """Executes a plan: one [q_heads, head_dim] float32 array per request."""
    def attend(
        self, ctx: int, layer: int, q: ArrayLike, exact: bool = False, retrieve: Optional[float] = None
    ) -> npt.NDArray[np.float32]:
        """Plans and executes in one call; returns [q_heads, head_dim] float32."""
    def tokens(self, ctx: int, layer: int) -> int: ...
    def checkpoint(self) -> None: ...
    def contexts(self) -> List[int]: ...
