"""attnstore under torch and transformers: exact plans equal torch's SDPA for every dtype,
an unmodified transformers model generates the same tokens with attnstore's exact method as
with its own SDPA (Llama and Gemma-3 shapes with random weights, and SmolLM2 from
`scripts/fetch-model`), sliding-window layers stay with transformers, and what the cache
cannot do is a clear error. Skipped, saying why, where torch or transformers is missing
(`scripts/install-torch` installs them)."""

import math
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-torch installs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/install-torch)")

import attnstore  # noqa: E402
import attnstore.hf  # noqa: E402

MODELS = pathlib.Path(__file__).resolve().parents[2] / "models"
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def sdpa(q, k, v):
    """torch's SDPA of one decode query: q [H, d], k/v [KV, T, d] -> [H, d] float32."""
    g = q.shape[0] // k.shape[0]
    k = k.float().repeat_interleave(g, dim=0)
    v = v.float().repeat_interleave(g, dim=0)
    out = torch.nn.functional.scaled_dot_product_attention(q.float()[:, None, :], k, v)
    return out[:, 0, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("store", ["f32", "f16", "bf16"])
def test_full_budget_plans_equal_torch_sdpa(dtype, store):
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, 3000, 64, generator=gen).to(dtype)
    v = torch.randn(2, 3000, 64, generator=gen).to(dtype)
    q = torch.randn(8, 64, generator=gen).to(dtype)
    eng = attnstore.Engine()
    ctx = eng.create_context(q_heads=8, kv_heads=2, head_dim=64, layers=1, dtype=store)
    eng.prefill(ctx, 0, k, v)  # torch tensors through DLPack
    want = sdpa(q, k, v)
    for out in (eng.attend(ctx, 0, q, exact=True), eng.execute(eng.plan(ctx, 0, q, exact=True))[0]):
        got = torch.from_numpy(out)
        # f16 tolerance: rows stored in 16 bits round to ~1e-3 relative.
        assert torch.allclose(got, want, atol=2e-3, rtol=2e-3), (got - want).abs().max()


def test_attend_many_equals_one_call_per_context():
    gen = torch.Generator().manual_seed(5)
    eng = attnstore.Engine()
    ctxs = [eng.create_context(q_heads=4, kv_heads=2, head_dim=32, layers=2, dtype="f32") for _ in range(3)]
    for ctx in ctxs:
        for layer in range(2):
            eng.prefill(ctx, layer, torch.randn(2, 700, 32, generator=gen), torch.randn(2, 700, 32, generator=gen))
    q = torch.randn(3, 4, 32, generator=gen)
    for kwargs in ({"exact": True}, {}, {"budget": attnstore.hf.model_budget()}):
        batch = eng.attend_many(ctxs, 1, q, **kwargs)
        assert batch.shape == (3, 4, 32)
        for i, ctx in enumerate(ctxs):
            np.testing.assert_array_equal(batch[i], eng.attend(ctx, 1, q[i], **kwargs))
    with pytest.raises(attnstore.ShapeError, match=r"\[3, q_heads=4, head_dim=32\]"):
        eng.attend_many(ctxs, 1, q[:2])
    with pytest.raises(ValueError, match="empty"):
        eng.attend_many([], 1, q)
    with pytest.raises(attnstore.UnknownContextError):
        eng.attend_many([ctxs[0], 999], 1, q[:2])
    other = eng.create_context(q_heads=4, kv_heads=1, head_dim=32, layers=2, dtype="f32")
    with pytest.raises(attnstore.ShapeError, match="one shape"):
        eng.attend_many([ctxs[0], other], 1, q[:2])


def test_torch_cpu_tensors_read_like_numpy_and_keep_dlpack_errors():
    # Plain torch CPU tensors skip Tensor.__dlpack__ (torch.utils.dlpack.to_dlpack); what
    # __dlpack__ refuses still goes through it and raises its own error.
    gen = torch.Generator().manual_seed(9)
    eng = attnstore.Engine()
    ctx = eng.create_context(q_heads=4, kv_heads=2, head_dim=32, layers=1, dtype="f32")
    eng.prefill(ctx, 0, torch.randn(2, 300, 32, generator=gen), torch.randn(2, 300, 32, generator=gen))
    q = torch.randn(4, 32, generator=gen)
    want = eng.attend(ctx, 0, q.numpy(), exact=True)
    np.testing.assert_array_equal(eng.attend(ctx, 0, q, exact=True), want)
    np.testing.assert_array_equal(eng.attend(ctx, 0, q.t().contiguous().t(), exact=True), want)  # strided
    np.testing.assert_array_equal(eng.attend(ctx, 0, torch.cat([q, q], 1)[:, 32:], exact=True), want)  # offset
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        np.testing.assert_array_equal(eng.attend(ctx, 0, q.to(dtype), exact=True),
                                      eng.attend(ctx, 0, q.to(dtype).float().numpy(), exact=True))
    np.testing.assert_array_equal(eng.attend_many([ctx], 0, q[None], exact=True), want[None])

    class Sub(torch.Tensor):
        pass

    np.testing.assert_array_equal(eng.attend(ctx, 0, q.as_subclass(Sub), exact=True), want)
    with pytest.raises(BufferError, match="require gradient"):
        eng.attend(ctx, 0, q.clone().requires_grad_())
    with pytest.raises(BufferError, match="layout"):
        eng.attend(ctx, 0, q.to_sparse())
    with pytest.raises(TypeError, match="DLPack dtype code 0"):
        eng.attend(ctx, 0, q.to(torch.int32))
    with pytest.raises(attnstore.ShapeError):
        eng.attend(ctx, 0, q[:2])


def test_budget_arguments_are_checked():
    b = attnstore.Budget(retrieve=0.05, floor=1024, estimate="rest", short_context=6144)
    assert (b.retrieve, b.floor, b.short_context, b.exact) == (0.05, 1024, 6144, False)
    assert attnstore.Budget(exact=True).exact
    base, twice = attnstore.hf.model_budget(), attnstore.hf.model_budget(2.0)
    assert (base.floor, base.short_context) == (1024, 6144)
    assert (twice.floor, twice.retrieve, twice.short_context) == (2048, 2 * base.retrieve, 6144)
    with pytest.raises(attnstore.InvalidArgumentError, match="rest"):
        attnstore.Budget(estimate="all")
    with pytest.raises(TypeError, match="estimate"):
        attnstore.Budget(estimate=[1])
    with pytest.raises(attnstore.InvalidArgumentError):
        attnstore.Budget(retrieve=1.5)
    with pytest.raises(ValueError, match="cuda|host_blocks"):
        attnstore.Engine(gpu=True)
    with pytest.raises(ValueError, match="host_blocks"):
        attnstore.Engine(gpu_blocks=8)


def tiny_llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(cfg).eval()


def generate(model, ids, cache=None, n=16):
    mask = torch.ones_like(ids)
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, do_sample=False, pad_token_id=0
        )


def test_exact_generation_equals_sdpa_llama_batch_of_two():
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(1))
    want = generate(model.set_attn_implementation("sdpa") or model, ids)
    cache = attnstore.hf.cache_for(model, exact=True)
    got = generate(model, ids, cache)
    assert torch.equal(got, want)
    assert model.config._attn_implementation == "attnstore"
    assert cache.served_layers() == [0, 1] and len(cache.contexts) == 2
    # Every token but the last generated one went through the engine.
    for ctx in cache.contexts:
        assert cache.engine.tokens(ctx, 0) == 300 + 16 - 1
    cache.close()
    assert cache.engine.contexts() == []
    model.set_attn_implementation("sdpa")


def test_sparse_generation_runs_and_stays_close():
    model = tiny_llama()
    ids = torch.randint(0, 256, (1, 2000), generator=torch.Generator().manual_seed(2))
    exact_cache = attnstore.hf.cache_for(model, exact=True)
    with torch.no_grad():
        full = model(ids, past_key_values=exact_cache).logits[:, -1]
        sparse_cache = attnstore.hf.cache_for(model, budget=attnstore.Budget(retrieve=0.05))
        model(ids, past_key_values=sparse_cache)
        nxt = full.argmax(-1, keepdim=True)
        a = model(nxt, past_key_values=exact_cache).logits[0, -1].log_softmax(-1)
        b = model(nxt, past_key_values=sparse_cache).logits[0, -1].log_softmax(-1)
    kl = torch.sum(a.exp() * (a - b)).item()
    assert 0.0 <= kl < 0.05, kl
    model.set_attn_implementation("sdpa")


def test_gemma3_sliding_layers_stay_with_transformers_and_scaling_is_folded():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=64,  # scaling 1/8, not 1/sqrt(32): exercises the folding
        sliding_window=64,
        sliding_window_pattern=2,
        max_position_embeddings=4096,
    )
    model = Gemma3ForCausalLM(cfg).eval()
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    assert not math.isclose(model.model.layers[1].self_attn.scaling, 32**-0.5)
    ids = torch.randint(0, 256, (1, 400), generator=torch.Generator().manual_seed(4))
    want = generate(model.set_attn_implementation("sdpa") or model, ids)
    cache = attnstore.hf.cache_for(model, exact=True)
    got = generate(model, ids, cache)
    assert torch.equal(got, want)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert cache.served_layers() == full
    model.set_attn_implementation("sdpa")


def test_what_the_cache_cannot_do_is_a_clear_error():
    model = tiny_llama(layers=1)
    cache = attnstore.hf.cache_for(model)
    ids = torch.randint(0, 256, (1, 50))
    with torch.no_grad():
        model(ids, past_key_values=cache)
        with pytest.raises(NotImplementedError, match="one forward pass"):
            model(ids[:, :5], past_key_values=cache)
        with pytest.raises(NotImplementedError, match="batch changed"):
            model(torch.randint(0, 256, (2, 1)), past_key_values=cache)
    model.set_attn_implementation("sdpa")


@pytest.mark.skipif(not (MODELS / SMOLLM2).exists(), reason="SmolLM2 is not fetched (scripts/fetch-model)")
def test_smollm2_exact_generation_equals_sdpa():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODELS, gguf_file=SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(MODELS, gguf_file=SMOLLM2, dtype=torch.float32).eval()
    text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()[:3000]
    ids = tok(f"Summarize:\n\n{text}\n\nSummary:", return_tensors="pt").input_ids[:, -700:]
    want = generate(model.set_attn_implementation("sdpa") or model, ids, n=24)
    got = generate(model, ids, attnstore.hf.cache_for(model, exact=True), n=24)
    assert torch.equal(got, want), (tok.decode(got[0, -24:]), tok.decode(want[0, -24:]))


def gpu_engine(host_blocks):
    """An `Engine(gpu=True)` where ATTNSTORE_GPU=1, torch sees a GPU and the wheel has the
    `cuda` feature; else the test is skipped, saying which is missing."""
    import os

    if os.environ.get("ATTNSTORE_GPU") != "1" or not torch.cuda.is_available():
        pytest.skip("GPU tests run where ATTNSTORE_GPU=1 and torch sees a GPU")
    try:
        return attnstore.Engine(host_blocks=host_blocks, gpu=True)
    except ValueError as e:
        pytest.skip(f"this build has no GPU executor: {e}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_full_budget_plans_equal_torch_sdpa_on_cuda(dtype):
    eng = gpu_engine(host_blocks=65536)
    assert eng.gpu
    gen = torch.Generator(device="cuda").manual_seed(3)
    k = torch.randn(8, 8192, 128, generator=gen, device="cuda").to(dtype)
    v = torch.randn(8, 8192, 128, generator=gen, device="cuda").to(dtype)
    q = torch.randn(32, 128, generator=gen, device="cuda").to(dtype)
    ctx = eng.create_context(q_heads=32, kv_heads=8, head_dim=128, layers=1, dtype="f16")
    eng.prefill(ctx, 0, k, v)  # CUDA tensors: copied to the CPU by torch through DLPack
    want = sdpa(q, k, v)
    # A CUDA query on a GPU engine comes back as a CUDA tensor of its dtype, written in place
    # (an exact plan: the query read to the host, the output written back).
    got = eng.attend(ctx, 0, q, exact=True)
    assert got.is_cuda and got.dtype == dtype and got.shape == q.shape
    tol = 3e-3 if dtype == torch.float16 else 2e-2
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol), (got.float() - want).abs().max()
    # The device-planned sparse step runs and stays near exact on these peaked queries.
    peaked = (3.0 * k[torch.arange(32, device="cuda") // 4, torch.arange(32, device="cuda") * 200]).cpu()
    exact = torch.from_numpy(eng.attend(ctx, 0, peaked, exact=True))
    sparse = torch.from_numpy(eng.attend(ctx, 0, peaked))
    assert (sparse - exact).norm() / exact.norm() < 0.1


def peaked_context(eng, tokens=8192, contexts=1):
    """Contexts of 32 q / 8 kv heads, d = 128, f16 rows, wave-indexed (long enough for the
    device-selected step), and a peaked f32 CUDA query per context: [contexts, 32, 128]."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    ctxs, qs = [], []
    for _ in range(contexts):
        k = torch.randn(8, tokens, 128, generator=gen, device="cuda")
        v = torch.randn(8, tokens, 128, generator=gen, device="cuda")
        ctx = eng.create_context(q_heads=32, kv_heads=8, head_dim=128, layers=1, dtype="f16")
        eng.prefill(ctx, 0, k.cpu(), v.cpu())
        eng.wait_index(ctx, 0, 120.0)
        ctxs.append(ctx)
        qs.append(3.0 * k[torch.arange(32, device="cuda") // 4, torch.arange(32, device="cuda") * 200])
    return ctxs, torch.stack(qs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_cuda_queries_are_read_and_outputs_written_in_place(dtype):
    eng = gpu_engine(host_blocks=65536)
    ctxs, q = peaked_context(eng, contexts=2)
    q = q.to(dtype)
    host = q.float().cpu()  # the same values, through the host path
    clusters = eng.gpu_stats()["device_clusters"]
    out = torch.full_like(q[0], 7.0)
    got = eng.attend(ctxs[0], 0, q[0], out=out)
    assert got is out
    assert eng.gpu_stats()["device_clusters"] > clusters, "the step was not device-selected"
    want = torch.from_numpy(eng.attend(ctxs[0], 0, host[0].numpy())).cuda()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert torch.allclose(out.float(), want, atol=tol, rtol=tol), (out.float() - want).abs().max()
    # A batch: one query per context from one [2, 32, 128] tensor, the output made for it.
    many = eng.attend_many(ctxs, 0, q)
    assert many.is_cuda and many.dtype == dtype and many.shape == q.shape
    want = torch.from_numpy(eng.attend_many(ctxs, 0, host.numpy())).cuda()
    assert torch.allclose(many.float(), want, atol=tol, rtol=tol), (many.float() - want).abs().max()


def test_gpu_cuda_queries_wait_for_the_callers_stream():
    eng = gpu_engine(host_blocks=65536)
    ctxs, q = peaked_context(eng)
    want = torch.from_numpy(eng.attend(ctxs[0], 0, q[0].cpu().numpy())).cuda()
    side = torch.cuda.Stream()
    late = torch.zeros_like(q[0])
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time before the query is written
        late.copy_(q[0])
        got = eng.attend(ctxs[0], 0, late)  # ordered after the copy on `side`
    torch.cuda.synchronize()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_gpu_bad_cuda_tensors_raise_and_change_nothing():
    eng = gpu_engine(host_blocks=65536)
    ctxs, q = peaked_context(eng)
    q = q[0]
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match="non-contiguous"):
        eng.attend(ctxs[0], 0, torch.cat([q, q], dim=1)[:, ::2], out=out)
    with pytest.raises(TypeError, match="float64"):
        eng.attend(ctxs[0], 0, q.double())
    with pytest.raises(attnstore.ShapeError, match="shape"):
        eng.attend(ctxs[0], 0, q[:16], out=out)
    with pytest.raises(attnstore.ShapeError, match="expected q's"):
        eng.attend(ctxs[0], 0, q, out=out.half())
    with pytest.raises(ValueError, match="out= is for CUDA queries"):
        eng.attend(ctxs[0], 0, q.cpu(), out=out)
    bad = q.clone()
    bad[3, 17] = float("nan")
    for exact in (False, True):  # the device-selected step, and the exact plan's host path
        with pytest.raises(attnstore.ShapeError, match="non-finite"):
            eng.attend(ctxs[0], 0, bad, out=out, exact=exact)
    with pytest.raises(attnstore.UnknownContextError):
        eng.attend(12345, 0, q, out=out)
    torch.cuda.synchronize()
    assert bool((out == 7.0).all()), "a refused call wrote its output"
    # The engine still serves the same query afterwards.
    assert torch.isfinite(eng.attend(ctxs[0], 0, q, out=out)).all()


def test_gpu_exact_generation_equals_sdpa_on_cuda():
    eng = gpu_engine(host_blocks=65536)
    model = tiny_llama().to("cuda")
    ids = torch.randint(0, 256, (2, 600), generator=torch.Generator().manual_seed(1)).to("cuda")
    want = generate(model.set_attn_implementation("sdpa") or model, ids)
    got = generate(model, ids, attnstore.hf.cache_for(model, eng, exact=True))
    assert torch.equal(got, want)
    model.set_attn_implementation("sdpa")
