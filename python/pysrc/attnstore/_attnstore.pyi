"""Type stubs of the extension module (see src/lib.rs for the full docs)."""

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

# NumPy float32/float16/float64 arrays, or any tensor with __dlpack__ (torch, JAX); a device
# tensor is copied to the CPU by its producer (__dlpack__(dl_device=(1, 0), copy=True)).
ArrayLike = Union[npt.NDArray[Union[np.float32, np.float16, np.float64]], Any]

class AttnstoreError(Exception): ...
class ShapeError(AttnstoreError): ...
class UnknownContextError(AttnstoreError): ...
class InvalidArgumentError(AttnstoreError): ...
class CorruptDataError(AttnstoreError): ...
class StorageError(AttnstoreError): ...
class StalePlanError(AttnstoreError): ...
class ClosedError(AttnstoreError): ...
class RemoteError(AttnstoreError): ...

# Token ids: a sequence of ints or a 1-D integer array.
Tokens = Union[Sequence[int], npt.NDArray[np.integer]]

class Budget:
    def __init__(
        self,
        exact: bool = False,
        retrieve: Optional[float] = None,
        floor: Optional[int] = None,
        estimate: Optional[Union[float, str]] = None,
        short_context: Optional[int] = None,
    ) -> None:
        """A sparse budget: retrieved share and floor in tokens, estimated share or "rest",
        contexts of at most `short_context` tokens attended exactly; `exact=True`: everything."""
    @property
    def exact(self) -> bool: ...
    @property
    def retrieve(self) -> float: ...
    @property
    def floor(self) -> int: ...
    @property
    def short_context(self) -> int: ...

class Plan:
    def explain(self) -> str:
        """The plan as text, one line per request and zone (EXPLAIN)."""

class Engine:
    def __init__(
        self,
        path: Optional[Union[str, os.PathLike]] = None,
        host_blocks: Optional[int] = None,
        gpu_blocks: Optional[int] = None,
        gpu: bool = False,
    ) -> None:
        """In memory, or durable at `path`; `host_blocks`: a buffer manager of that many 2 KiB
        blocks (`gpu_blocks` of them cached on the GPU, default 5%); `gpu=True`: plan and
        execute on the GPU (a `cuda` build; needs `host_blocks`)."""
    @property
    def gpu(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None:
        """Closes the engine (later calls raise ClosedError); a durable directory can be reopened."""
    def __enter__(self) -> "Engine": ...
    def __exit__(self, *args: Any) -> bool: ...
    def create_context(
        self,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        layers: int = 1,
        dtype: str = "f16",
        method: str = "wave",
        codec: Optional[str] = None,
        windows: Optional[Sequence[Optional[int]]] = None,
    ) -> int:
        """Creates a context (dtype f32/f16/bf16, method wave/pq/flat, codec None, "hack2", "hack2c" or "kv43" ("kv43:k5": 5-bit keys, ":v4": 4-bit values, ":b128": 128-token value blocks; "kv43:256:b128,3-10=kv43:v4": a codec per range of layers); encoded codecs need dtype f16;
        windows: per layer None (global) or a sliding window's length)."""
    def drop_context(self, ctx: int) -> None: ...
    def prefill(self, ctx: int, layer: int, k: ArrayLike, v: ArrayLike) -> None:
        """Stores a layer's prompt KV, `k` and `v` of shape [kv_heads, tokens, head_dim]."""
    def append(self, ctx: int, layer: int, k: ArrayLike, v: ArrayLike) -> None:
        """Appends decode tokens' KV, [kv_heads, tokens, head_dim]."""
    def wait_index(self, ctx: int, layer: int, timeout: float = 600.0) -> bool: ...
    def plan(
        self,
        ctx: int,
        layer: int,
        q: ArrayLike,
        exact: bool = False,
        retrieve: Optional[float] = None,
        budget: Optional[Budget] = None,
    ) -> Plan:
        """Plans attention of `q` [q_heads, head_dim] over a layer."""
    def execute(self, plan: Plan) -> List[npt.NDArray[np.float32]]:
        """Executes a plan: one [q_heads, head_dim] float32 array per request."""
    def attend(
        self,
        ctx: int,
        layer: int,
        q: ArrayLike,
        exact: bool = False,
        retrieve: Optional[float] = None,
        budget: Optional[Budget] = None,
        out: Any = None,
        stream: Optional[int] = None,
    ) -> Any:
        """Plans and executes in one call; returns [q_heads, head_dim] float32 (a NumPy
        array). On an Engine(gpu=True) with a CUDA q (a DLPack tensor: float32, float16 or
        bfloat16, contiguous, device 0) the query is read and the output written in place:
        returns `out` (a CUDA tensor of q's shape and dtype; q.new_empty(...) when None),
        ordered after the work queued on `stream` (torch's current stream when None)."""
    def attend_many(
        self,
        ctxs: List[int],
        layer: int,
        q: ArrayLike,
        exact: bool = False,
        retrieve: Optional[float] = None,
        budget: Optional[Budget] = None,
        out: Any = None,
        stream: Optional[int] = None,
    ) -> Any:
        """One query per context (q: [len(ctxs), q_heads, head_dim]) as one batch; returns
        [len(ctxs), q_heads, head_dim] float32, or, with a CUDA q on an Engine(gpu=True),
        `out` written in place as attend does."""
    def time_steps(
        self, ctxs: List[int], layer: int, q: ArrayLike, iters: int, exact: bool = False, budget: Optional[Budget] = None
    ) -> List[float]:
        """Seconds per call of attend_many's step timed inside Rust (the boundary's baseline)."""
    def tokens(self, ctx: int, layer: int) -> int: ...
    def buffer_stats(self) -> Optional[Dict[str, Any]]:
        """The buffer manager's counters per tier (None without host_blocks)."""
    def gpu_stats(self) -> Dict[str, int]:
        """The GPU executor's sums: on_gpu, on_cpu, device_clusters, device_missed."""
    def checkpoint(self) -> None: ...
    def contexts(self) -> List[int]: ...

def model_id(path: Optional[Union[str, os.PathLike]] = None, data: Optional[bytes] = None) -> str:
    """The sha256 (64 hex digits) of a weights file, or of `data`: the identity KV is shared under."""

class Attached:
    """A context attached from the remote tier."""
    @property
    def context(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def layouts_used(self) -> int: ...
    @property
    def fetch_seconds(self) -> float: ...
    @property
    def build_seconds(self) -> float: ...
    def kv(self, layer: int) -> Tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """The layer's attached keys and values, [kv_heads, rows, head_dim] float32."""

class RemoteTier:
    def __init__(
        self,
        url: str,
        chunk_tokens: int = 256,
        timeout: float = 2.0,
        namespace: str = "attnstore",
        queue_publishes: int = 4,
    ) -> None:
        """A remote tier on Redis (redis://HOST:PORT) or a Redis Cluster (seeds separated by commas)."""
    @property
    def chunk_tokens(self) -> int: ...
    def publish(
        self, engine: Engine, ctx: int, model: str, tokens: Tokens, kv: Sequence[Tuple[ArrayLike, ArrayLike]]
    ) -> None:
        """Queues a context's whole chunks and index layouts for the background writer."""
    def flush(self, timeout: float = 60.0) -> bool:
        """Waits until every queued publish is written; whether it was."""
    def attach(
        self,
        engine: Engine,
        model: str,
        tokens: Tokens,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        layers: int = 1,
        dtype: str = "f16",
        method: str = "wave",
        codec: Optional[str] = None,
        windows: Optional[Sequence[Optional[int]]] = None,
    ) -> Optional[Attached]:
        """A new context from the longest published prefix of `tokens` (whole chunks), or None."""
    def stats(self) -> Dict[str, int]:
        """Bytes, values, hits, misses, corrupt values, failures, publishes, attaches, calls."""
