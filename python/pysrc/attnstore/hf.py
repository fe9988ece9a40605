"""transformers integration: a model's decode attention served by attnstore.

An unmodified ``AutoModelForCausalLM`` generates with it::

    import attnstore.hf
    cache = attnstore.hf.cache_for(model)                   # registers "attnstore" on first use
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)

How a step runs:

- **Prefill** (the prompt in one forward pass) is exact, by transformers' own SDPA; the
  cache hands each layer's post-RoPE keys and values to attnstore (``Engine.prefill``, one
  context per sequence of the batch), which builds its index.
- **Decode** (one token per sequence): the cache appends the token's keys and values
  (``Engine.append``) and the attention function sends the query of every sequence to
  attnstore as one batch (``Engine.attend_many``), which plans and executes it on the CPU
  or, for an ``Engine(gpu=True)``, the GPU.
- Layers the model declares ``sliding_attention`` (Gemma-3, Qwen2 with ``use_sliding_window``)
  or ``chunked_attention`` keep transformers' own cache and exact SDPA: their windows are
  short. ``dense_layers`` more layers from the first can be attended exactly by attnstore.

**Prefix reuse across processes and nodes** (``remote=attnstore.RemoteTier(url)``, a batch of
one, models whose layers are all full attention): the cache first attaches the longest
prefix of ``prompt`` that any engine published under the same weights (:func:`model_identity`),
so ``generate`` runs its prompt forward only over the rest (exact SDPA over the attached and
the new rows), and then publishes the whole prompt for the next process.

What it does not do: padded batches (sequences of one batch have one length), a second
multi-token forward after the prompt (chunked prefill, speculative decoding), beam search,
cache cropping. Each of these raises ``NotImplementedError`` saying so.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import Budget, Engine, RemoteTier

#: The name attnstore's attention is registered under (``config._attn_implementation``).
NAME = "attnstore"

#: The budget the Rust runtime (``attnstore_runtime::default_budget``) measured on real
#: models: the engine's default with a 1,024-token retrieval floor, every cluster that is
#: not retrieved estimated, and contexts of at most 6,144 tokens attended exactly
#: (``docs/realmodel.md``).
def model_budget(scale: float = 1.0) -> Budget:
    """The real-model default budget (see ``docs/realmodel.md``); `scale` multiplies its
    retrieved share and floor (as the Rust runtime's ``AttnConfig::scaled`` does)."""
    base = Budget(floor=1024, estimate="rest", short_context=6144)
    if scale == 1.0:
        return base
    return Budget(
        retrieve=base.retrieve * scale,
        floor=round(base.floor * scale),
        estimate="rest",
        short_context=base.short_context,
    )


def register() -> None:
    """Registers ``"attnstore"`` with transformers' attention and mask interfaces (the mask
    is SDPA's: prefill runs SDPA). Idempotent."""
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def _store_dtype(dtype: torch.dtype) -> str:
    """How rows are stored for a model of `dtype`: f32 models keep f32 (so exact plans
    equal SDPA's float32 arithmetic), half-precision ones f16 (what the GPU path reads)."""
    return "f32" if dtype == torch.float32 else "f16"


def model_identity(model: Any) -> str:
    """The sha256 of a model's weights as loaded (every entry of its ``state_dict``, by
    name, in order: its name, dtype, shape and bytes), 64 hex digits: the identity under
    which the remote tier publishes and attaches its KV. Cached on the model."""
    cached = getattr(model, "_attnstore_identity", None)
    if cached is not None:
        return cached
    h = hashlib.sha256(b"attnstore-hf-weights-v1")
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    model._attnstore_identity = h.hexdigest()
    return model._attnstore_identity


def _rows(t: torch.Tensor, copy: bool = False):
    """`[kv_heads, tokens, head_dim]` float32 NumPy rows of one sequence (`copy`: never a
    view of `t`'s memory)."""
    return t.detach().to(device="cpu", dtype=torch.float32, copy=copy).contiguous().numpy()


class AttnstoreCache(Cache):
    """A transformers ``Cache`` whose full-attention layers live in an attnstore engine.

    ``config``: the model's config. ``engine``: an ``attnstore.Engine`` (a new in-memory one
    if None). ``method``: wave (default), pq or flat; ``dtype``: how rows are stored (f32,
    f16, bf16; by default f32 for float32 models, else f16); ``codec``: None, "hack2", "hack2c" or "kv43";
    ``exact``: plan every decode step exactly; ``budget``: an ``attnstore.Budget`` (default:
    :func:`model_budget`); ``dense_layers``: the first this many layers are attended exactly.
    ``remote``: an ``attnstore.RemoteTier`` to attach the longest published prefix of
    ``prompt`` (token ids, a batch of one) from and to publish the prompt to, under
    ``model_id`` (:func:`model_identity`); ``model_dtype``: the model's dtype (how attached
    rows are stored). ``reused`` is then the number of prompt tokens attached.
    """

    def __init__(
        self,
        config: Any,
        engine: Optional[Engine] = None,
        *,
        method: str = "wave",
        dtype: Optional[str] = None,
        codec: Optional[str] = None,
        exact: bool = False,
        budget: Optional[Budget] = None,
        dense_layers: int = 0,
        remote: Optional[RemoteTier] = None,
        prompt: Optional[Any] = None,
        model_id: Optional[str] = None,
        model_dtype: Optional[torch.dtype] = None,
    ):
        text = config.get_text_config(decoder=True)
        n = text.num_hidden_layers
        kinds = getattr(text, "layer_types", None) or ["full_attention"] * n
        layers: list = []
        for i, kind in enumerate(kinds):
            if kind == "full_attention":
                layers.append(_EngineLayer(self, i))
            elif kind == "sliding_attention":
                layers.append(DynamicSlidingWindowLayer(sliding_window=text.sliding_window))
            elif kind == "chunked_attention":
                layers.append(DynamicSlidingWindowLayer(sliding_window=text.attention_chunk_size))
            else:
                layers.append(DynamicLayer())
        super().__init__(layers=layers)
        self.engine = engine if engine is not None else Engine()
        self.q_heads = text.num_attention_heads
        self.kv_heads = getattr(text, "num_key_value_heads", None) or self.q_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.q_heads
        self.n_layers = n
        self.method, self.dtype, self.codec = method, dtype, codec
        self.exact = exact
        self.budget = budget if budget is not None else model_budget()
        self.dense_layers = dense_layers
        #: One engine context per sequence of the batch, created at the first prefill.
        self.contexts: Optional[list[int]] = None
        #: Seconds spent, summed over calls: ``prefill`` and ``append`` (the engine's ingest,
        #: conversions included), ``to_host`` (the query's copy to host memory, which waits
        #: for the work queued on its device), ``engine`` (planning and executing the step),
        #: ``to_device`` (the output's copy back).
        self.seconds = {"prefill": 0.0, "append": 0.0, "to_host": 0.0, "engine": 0.0, "to_device": 0.0}
        #: Prompt tokens attached from the remote tier.
        self.reused = 0
        self.remote, self.model_id = remote, model_id
        self._prompt: Optional[list[int]] = None
        #: Per served layer, the prompt's rows to publish once every layer has them.
        self._publish: dict[int, tuple] = {}
        #: Pinned host buffers a prompt's device rows are copied through (`_staged`).
        self._staging: list[Optional[torch.Tensor]] = [None, None]
        if remote is not None:
            self._attach(prompt, model_dtype or torch.float32)

    def served_layers(self) -> list[int]:
        """The layers attnstore serves (the model's full-attention layers)."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, _EngineLayer)]

    def _ensure_contexts(self, batch: int, dtype: torch.dtype) -> list[int]:
        if self.contexts is None:
            self.contexts = [self.engine.create_context(**self._create_args(dtype)) for _ in range(batch)]
        elif len(self.contexts) != batch:
            raise NotImplementedError(
                f"the batch changed from {len(self.contexts)} to {batch} sequences; an AttnstoreCache serves one batch"
            )
        return self.contexts

    def _create_args(self, dtype: torch.dtype) -> dict:
        # a 2-bit codec keeps its steady zone in f16
        store = self.dtype or ("f16" if self.codec else _store_dtype(dtype))
        return dict(
            q_heads=self.q_heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            layers=self.n_layers,
            dtype=store,
            method=self.method,
            codec=self.codec,
        )

    def _attach(self, prompt: Any, dtype: torch.dtype) -> None:
        """Attaches the longest published prefix of `prompt` (without its last token, whose
        logits the prompt forward must compute) and leaves its rows to the layers."""
        if prompt is None or self.model_id is None:
            raise ValueError("a remote tier needs prompt= (the token ids) and model_id= (attnstore.hf.model_identity)")
        ids = torch.as_tensor(prompt)
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise NotImplementedError("the remote tier serves a batch of one sequence")
        if len(self.served_layers()) != self.n_layers:
            raise NotImplementedError(
                "the remote tier needs every layer served by attnstore; this model has sliding-window or other "
                "layers that transformers keeps"
            )
        self._prompt = [int(t) for t in ids.reshape(-1).tolist()]
        got = self.remote.attach(self.engine, self.model_id, self._prompt[:-1], **self._create_args(dtype))
        if got is None:
            return
        self.contexts, self.reused = [got.context], got.tokens
        for layer in self.layers:
            layer.tokens = got.tokens
            layer.attached = got.kv(layer.index)

    def _published(self, layer: int, k, v) -> None:
        """Records `layer`'s prompt rows; once every layer has them, publishes the prompt."""
        if self.remote is None or self._prompt is None:
            return
        self._publish[layer] = (k, v)
        if len(self._publish) == self.n_layers:
            kv = [self._publish[i] for i in range(self.n_layers)]
            self._publish = {}
            self.remote.publish(self.engine, self.contexts[0], self.model_id, self._prompt, kv)

    def _staged(self, t: torch.Tensor, slot: int) -> torch.Tensor:
        """`t` (one sequence's `[kv_heads, tokens, head_dim]` prompt rows) in host memory for
        `Engine.prefill`, in its own dtype (the engine reads bf16 / f16 through DLPack and
        widens them itself): a CPU tensor as it is; a device tensor copied into staging
        buffer `slot` (0: keys, 1: values), pinned host memory kept between layers, so a long
        prompt's layers after the first copy by DMA into memory already faulted in instead of
        into a gibibyte of new pages each (``docs/python.md``, "Ingest")."""
        if t.device.type == "cpu":
            return t.detach().contiguous()
        need = t.numel()
        buf = self._staging[slot]
        if buf is None or buf.numel() < need or buf.dtype != t.dtype:
            self._staging[slot] = None  # freed before the larger one is pinned
            try:
                buf = torch.empty(need, dtype=t.dtype, pin_memory=True)
            except RuntimeError:  # no pinned memory to be had: pageable, copied by the driver
                buf = torch.empty(need, dtype=t.dtype)
            self._staging[slot] = buf
        out = buf[:need].view(t.shape)
        out.copy_(t.detach())  # waits for the copy (and the work queued before it)
        return out

    def _plan_args(self, layer: int) -> dict:
        if self.exact or layer < self.dense_layers:
            return {"exact": True}
        return {"budget": self.budget}

    def close(self) -> None:
        """Drops the cache's contexts from the engine (their rows are freed) and its staging
        buffers."""
        for ctx in self.contexts or []:
            self.engine.drop_context(ctx)
        self.contexts = None
        self._staging = [None, None]

    def reorder_cache(self, beam_idx):  # noqa: D102 - documented in the module
        raise NotImplementedError("beam search is not supported by AttnstoreCache")

    def crop(self, tokens_to_remove: int) -> None:  # noqa: D102
        raise NotImplementedError("cropping is not supported by AttnstoreCache")


class _EngineLayer(CacheLayerMixin):
    """One full-attention layer: its KV in the engine, its token count here."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: AttnstoreCache, index: int):
        super().__init__()
        self.cache = cache
        self.index = index
        self.tokens = 0
        #: Rows attached from the remote tier (``[kv_heads, tokens, head_dim]`` float32 keys
        #: and values) until the prompt forward that continues them.
        self.attached: Optional[tuple[np.ndarray, np.ndarray]] = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        ctxs = self.cache._ensure_contexts(key_states.shape[0], key_states.dtype)
        new = key_states.shape[-2]
        prompt = self.tokens == 0 or self.attached is not None
        if not prompt and new != 1:
            raise NotImplementedError(
                f"layer {self.index} got {new} tokens after its prompt; attnstore takes the prompt in one forward "
                "pass and then one token per step (no chunked prefill or speculative decoding)"
            )
        store = self.cache.engine.prefill if self.tokens == 0 else self.cache.engine.append
        start = time.perf_counter()
        first = None  # the first sequence's prompt rows, where the remote tier publishes them
        if prompt:
            for b, ctx in enumerate(ctxs):
                k, v = self.cache._staged(key_states[b], 0), self.cache._staged(value_states[b], 1)
                store(ctx, self.index, k, v)
                if b == 0 and self.cache.remote is not None:
                    first = (_rows(k, copy=True), _rows(v, copy=True))  # the staging is reused
        else:
            # A decode step's token: the whole batch's keys and values cross to the host in one
            # copy, so the layer waits for the device's queue once, not twice per sequence.
            kv = _rows(torch.stack((key_states, value_states)))  # [2, batch, kv_heads, 1, head_dim]
            for b, ctx in enumerate(ctxs):
                store(ctx, self.index, kv[0, b], kv[1, b])
        self.cache.seconds["prefill" if prompt else "append"] += time.perf_counter() - start
        self.tokens += new
        if prompt and self.attached is not None:
            # The rest of an attached prompt: exact SDPA over the attached and the new rows;
            # the prompt's rows to publish are the attached ones and the new ones as stored.
            (ak, av), self.attached = self.attached, None
            nk, nv = first
            self.cache._published(self.index, np.concatenate([ak, nk], 1), np.concatenate([av, nv], 1))
            ak, av = (torch.from_numpy(t)[None].to(device=key_states.device, dtype=key_states.dtype) for t in (ak, av))
            return torch.cat([ak, key_states], -2), torch.cat([av, value_states], -2)
        if prompt:
            if first is not None:
                self.cache._published(self.index, *first)
            return key_states, value_states  # the prompt's own attention: exact, by SDPA
        # A decode step: the attention function finds the layer through the key tensor.
        served = key_states.view_as(key_states)
        served._attnstore_layer = self
        return served, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("an AttnstoreCache cannot be reset; make a new one (cache_for)")


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
):
    """The attention function registered as ``"attnstore"``: SDPA for prompts and for layers
    attnstore does not serve; one batched attnstore step for a decode step of a served
    layer. Returns ``(output [batch, 1, q_heads, head_dim], None)``."""
    layer: Optional[_EngineLayer] = getattr(key, "_attnstore_layer", None)
    if layer is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention logit soft-capping and attention sinks are not supported by attnstore")
    cache = layer.cache
    batch, heads, steps, d = query.shape
    q = query[:, :, 0, :]
    if scaling is not None and not math.isclose(scaling * math.sqrt(d), 1.0, rel_tol=1e-6):
        # attnstore scales scores by 1/sqrt(d); fold the model's scale into the query.
        q = q * (scaling * math.sqrt(d))
    seconds = cache.seconds
    start = time.perf_counter()
    if q.is_cuda and cache.engine.gpu:
        # In place: the engine reads the CUDA query and writes the CUDA output itself,
        # ordered after this stream's work (no host copy either way).
        q = q.detach().contiguous()
        copied = time.perf_counter()
        out = cache.engine.attend_many(
            cache.contexts, layer.index, q, out=torch.empty_like(q), **cache._plan_args(layer.index)
        )
        stepped = time.perf_counter()
    else:
        # A CPU query goes in as it is: the engine reads a torch CPU tensor of any float
        # dtype and layout through DLPack, converting while it copies: on the 2-core VM,
        # 0.5 us a layer against 4 us for torch's .to(float32).contiguous().numpy() of an
        # f32 query, 9 us of a bf16 one.
        q = q.detach() if q.is_cpu else q.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
        copied = time.perf_counter()
        out = cache.engine.attend_many(cache.contexts, layer.index, q, **cache._plan_args(layer.index))
        stepped = time.perf_counter()
        out = torch.from_numpy(out).to(device=query.device, dtype=query.dtype)
    seconds["to_host"] += copied - start
    seconds["engine"] += stepped - copied
    seconds["to_device"] += time.perf_counter() - stepped
    return out.view(batch, 1, heads, d), None


def cache_for(model: Any, engine: Optional[Engine] = None, **options) -> AttnstoreCache:
    """Registers attnstore's attention (once), switches `model` to it and returns a new
    :class:`AttnstoreCache` for one generation (pass it as ``past_key_values``). `options`
    are :class:`AttnstoreCache`'s; with ``remote=`` (and ``prompt=``) the model's identity
    and dtype are filled in."""
    register()
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
    if options.get("remote") is not None:
        options.setdefault("model_id", model_identity(model))
        options.setdefault("model_dtype", model.dtype)
    return AttnstoreCache(model.config, engine, **options)


__all__: Sequence[str] = [
    "NAME",
    "AttnstoreCache",
    "attention",
    "cache_for",
    "model_budget",
    "model_identity",
    "register",
]
