"""The Python package against a NumPy reference: exact attention equals softmax(qK^T/sqrt(d))V,
the default sparse plan stays close, errors are the documented exceptions, a durable engine
reopens with its contexts, and several threads share one engine."""

import threading

import numpy as np
import pytest

import attnstore


def reference(q, k, v):
    """Exact attention in float64: q [H, d], k/v [KV, T, d] with grouped query heads."""
    h, d = q.shape
    kv = k.shape[0]
    g = h // kv
    out = np.empty((h, d))
    for i in range(h):
        kh, vh = k[i // g].astype(np.float64), v[i // g].astype(np.float64)
        s = kh @ q[i].astype(np.float64) / np.sqrt(d)
        p = np.exp(s - s.max())
        out[i] = (p / p.sum()) @ vh
    return out


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture
def data():
    """Random KV, and queries that each point at one key of their KV head (a peaked attention
    that a sparse plan can serve, as real decode steps mostly are)."""
    rng = np.random.default_rng(7)
    k = rng.standard_normal((2, 4096, 64)).astype(np.float32)
    v = rng.standard_normal((2, 4096, 64)).astype(np.float32)
    targets = rng.integers(100, 3900, size=8)
    q = np.stack([2.0 * k[i // 4, t] for i, t in enumerate(targets)]).astype(np.float32)
    return q, k, v


def test_the_readme_example_exact_and_sparse(data):
    q, k, v = data
    eng = attnstore.Engine()
    ctx = eng.create_context(q_heads=8, kv_heads=2, head_dim=64, layers=1, dtype="f32")
    eng.prefill(ctx, 0, k, v)
    out = eng.attend(ctx, 0, q, exact=True)
    assert out.shape == (8, 64) and out.dtype == np.float32
    assert rel(out, reference(q, k, v)) < 1e-5
    sparse = eng.attend(ctx, 0, q)
    assert sparse.shape == (8, 64)
    assert rel(sparse, reference(q, k, v)) < 0.1
    assert "sparse" in eng.plan(ctx, 0, q).explain()
    assert eng.tokens(ctx, 0) == 4096


def test_plan_explain_execute_and_append(data):
    q, k, v = data
    eng = attnstore.Engine()
    ctx = eng.create_context(8, 2, 64, dtype="f16", method="pq")
    eng.prefill(ctx, 0, k.astype(np.float16), v.astype(np.float16))
    assert eng.wait_index(ctx, 0, timeout=120)
    rng = np.random.default_rng(1)
    k2 = rng.standard_normal((2, 10, 64)).astype(np.float32)
    v2 = rng.standard_normal((2, 10, 64)).astype(np.float32)
    eng.append(ctx, 0, k2, v2)
    plan = eng.plan(ctx, 0, q, exact=True)
    assert plan.explain().startswith("EXPLAIN") and str(plan) == plan.explain()
    (out,) = eng.execute(plan)
    want = reference(q, np.concatenate([k, k2], 1), np.concatenate([v, v2], 1))
    assert rel(out, want) < 2e-3  # f16 storage


def test_bad_input_raises_the_documented_exceptions(data):
    q, k, v = data
    eng = attnstore.Engine()
    ctx = eng.create_context(8, 2, 64, dtype="f32")
    with pytest.raises(attnstore.ShapeError, match=r"expected \[kv_heads=2, tokens, head_dim=64\]"):
        eng.prefill(ctx, 0, k[:1], v[:1])
    with pytest.raises(TypeError, match="float32, float16 or float64"):
        eng.prefill(ctx, 0, k.astype(np.int32), v)
    with pytest.raises(TypeError):
        eng.prefill(ctx, 0, [[1.0]], v)
    bad = k.copy()
    bad[0, 5, 3] = np.nan
    with pytest.raises(attnstore.ShapeError):
        eng.prefill(ctx, 0, bad, v)
    with pytest.raises(attnstore.UnknownContextError):
        eng.attend(ctx + 100, 0, q)
    with pytest.raises(attnstore.UnknownContextError):
        eng.prefill(ctx, 3, k, v)
    with pytest.raises(attnstore.InvalidArgumentError):
        eng.create_context(8, 2, 64, method="btree")
    with pytest.raises(attnstore.ShapeError):
        eng.create_context(8, 3, 64)
    # None of the failed calls changed anything.
    assert eng.contexts() == [ctx] and eng.tokens(ctx, 0) == 0
    eng.prefill(ctx, 0, k, v)
    with pytest.raises(attnstore.InvalidArgumentError):
        eng.prefill(ctx, 0, k, v)  # a layer is prefilled once
    with pytest.raises(attnstore.InvalidArgumentError):
        eng.attend(ctx, 0, q, retrieve=2.0)
    with pytest.raises(attnstore.ShapeError):
        eng.attend(ctx, 0, q[:4])
    with pytest.raises(attnstore.ShapeError):
        eng.append(ctx, 0, k[:, :3], v[:, :2])
    assert eng.tokens(ctx, 0) == k.shape[1]
    assert issubclass(attnstore.ShapeError, attnstore.AttnstoreError)


def test_a_durable_engine_reopens_with_its_contexts(data, tmp_path):
    q, k, v = data
    eng = attnstore.Engine(path=tmp_path / "db")
    ctx = eng.create_context(8, 2, 64, dtype="f32")
    eng.prefill(ctx, 0, k, v)
    before = eng.attend(ctx, 0, q, exact=True)
    eng.checkpoint()
    del eng
    eng = attnstore.Engine(path=tmp_path / "db")
    assert eng.contexts() == [ctx]
    np.testing.assert_array_equal(eng.attend(ctx, 0, q, exact=True), before)


def test_threads_share_one_engine(data):
    q, k, v = data
    eng = attnstore.Engine(host_blocks=4096)
    ctx = eng.create_context(8, 2, 64, dtype="f32")
    eng.prefill(ctx, 0, k, v)
    want = eng.attend(ctx, 0, q)
    results, errors = [], []

    def work():
        try:
            for _ in range(20):
                results.append(eng.attend(ctx, 0, q))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 80 and all(np.array_equal(r, want) for r in results)


class DLPackOnly:
    """A tensor seen only through DLPack (as a torch or JAX tensor would be)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_dlpack_tensors_contiguous_and_strided_read_like_numpy(data):
    q, k, v = data
    eng = attnstore.Engine()
    a = eng.create_context(8, 2, 64, dtype="f32")
    b = eng.create_context(8, 2, 64, dtype="f32")
    # A strided view (every other token) through DLPack, its copy through NumPy.
    ks, vs = k[:, ::2, :], v[:, ::2, :]
    assert not ks.flags["C_CONTIGUOUS"]
    eng.prefill(a, 0, np.ascontiguousarray(ks), np.ascontiguousarray(vs))
    eng.prefill(b, 0, DLPackOnly(ks), DLPackOnly(vs))
    want = eng.attend(a, 0, q, exact=True)
    np.testing.assert_array_equal(eng.attend(b, 0, DLPackOnly(q), exact=True), want)
    np.testing.assert_array_equal(eng.attend(b, 0, DLPackOnly(q.astype(np.float16)), exact=True),
                                  eng.attend(a, 0, q.astype(np.float16), exact=True))
    with pytest.raises(TypeError, match="DLPack dtype code 0"):
        eng.attend(b, 0, DLPackOnly(q.astype(np.int32)))
    with pytest.raises(attnstore.ShapeError):
        eng.attend(b, 0, DLPackOnly(q[:4]))
    with pytest.raises(TypeError, match="DLPack tensor"):
        eng.attend(b, 0, "not a tensor")


def test_ingests_through_the_kept_staging_buffers_leave_nothing_behind(data):
    """`prefill` and `append` read their arrays into buffers the engine keeps between calls: a
    long prefill, then shorter ones of other dtypes and an append, each give what a fresh
    engine gives for the same rows; a bad array after a good one fails alone."""
    q, k, v = data
    eng = attnstore.Engine()
    long = eng.create_context(8, 2, 64, dtype="f32")
    eng.prefill(long, 0, k, v)  # 2 x 4096 x 64: the kept buffers grow to this size
    for make in (lambda a: a[:, :1000].copy(), lambda a: a[:, :600].astype(np.float16), lambda a: DLPackOnly(a[:, :300])):
        short = eng.create_context(8, 2, 64, dtype="f32")
        eng.prefill(short, 0, make(k), make(v))
        eng.append(short, 0, k[:, 2000:2003].copy(), v[:, 2000:2003].copy())
        fresh = attnstore.Engine()
        alone = fresh.create_context(8, 2, 64, dtype="f32")
        fresh.prefill(alone, 0, make(k), make(v))
        fresh.append(alone, 0, k[:, 2000:2003].copy(), v[:, 2000:2003].copy())
        assert eng.tokens(short, 0) == fresh.tokens(alone, 0)
        np.testing.assert_array_equal(eng.attend(short, 0, q, exact=True), fresh.attend(alone, 0, q, exact=True))
    with pytest.raises(attnstore.ShapeError):
        eng.prefill(eng.create_context(8, 2, 64, dtype="f32"), 0, k, v[:, :10])
    np.testing.assert_array_equal(eng.attend(long, 0, q, exact=True), attnstore_exact(k, v, q))


def attnstore_exact(k, v, q):
    """Exact attention over `k`, `v` by a fresh in-memory engine."""
    eng = attnstore.Engine()
    ctx = eng.create_context(8, 2, 64, dtype="f32")
    eng.prefill(ctx, 0, k, v)
    return eng.attend(ctx, 0, q, exact=True)


def test_buffer_and_gpu_stats(data):
    q, k, v = data
    assert attnstore.Engine().buffer_stats() is None
    eng = attnstore.Engine(host_blocks=4096)
    ctx = eng.create_context(q_heads=8, kv_heads=2, head_dim=64, layers=1, dtype="f16")
    eng.prefill(ctx, 0, k, v)
    eng.attend(ctx, 0, q)
    stats = eng.buffer_stats()
    assert stats["block_bytes"] == 2048
    assert stats["host"]["capacity_blocks"] == 4096
    # 2 heads x 4096 tokens x 64 dims x 2 bytes x (K and V), clusters rounding blocks up.
    assert 2 * 4096 * 64 * 2 * 2 // 2048 <= stats["host"]["used_blocks"] <= 4096
    assert stats["gpu"]["capacity_blocks"] == 4096 // 20
    assert eng.gpu_stats() == {"on_gpu": 0, "on_cpu": 0, "device_clusters": 0, "device_missed": 0}


def test_a_closed_engine_raises_and_its_directory_reopens(data, tmp_path):
    q, k, v = data
    with attnstore.Engine(path=tmp_path / "db") as eng:
        ctx = eng.create_context(8, 2, 64, dtype="f32")
        eng.prefill(ctx, 0, k, v)
        before = eng.attend(ctx, 0, q, exact=True)
    assert eng.closed
    for call in (
        lambda: eng.attend(ctx, 0, q),
        lambda: eng.prefill(ctx, 0, k, v),
        lambda: eng.create_context(8, 2, 64),
        eng.contexts,
        eng.checkpoint,
        lambda: eng.tokens(ctx, 0),
    ):
        with pytest.raises(attnstore.ClosedError, match="closed"):
            call()
    eng.close()  # twice is fine
    # The same directory opens again in the same process, with the context's rows.
    again = attnstore.Engine(path=tmp_path / "db")
    assert again.contexts() == [ctx]
    np.testing.assert_array_equal(again.attend(ctx, 0, q, exact=True), before)
    again.close()


def exact_errors_with_outlier_keys(seed, codecs, method="wave"):
    """Relative error of exact attention over each codec's rows against attention over the
    f32 rows, for keys with outlier channels (as real models' post-RoPE keys have): 2 KV
    heads × 4,096 tokens × 64 dims, 8 query heads, contexts of `method`; and the engine the
    contexts live in."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((2, 4096, 64)).astype(np.float32)
    k[:, :, [3, 17, 40]] = 15.0 + 0.5 * k[:, :, [3, 17, 40]]
    mu = rng.standard_normal(64).astype(np.float32)
    v = (2.0 * mu + 0.5 * rng.standard_normal((2, 4096, 64))).astype(np.float32)
    q = (0.5 * rng.standard_normal((8, 64))).astype(np.float32)
    want = reference(q, k, v)
    eng = attnstore.Engine()
    errors = {}
    for codec in codecs:
        ctx = eng.create_context(q_heads=8, kv_heads=2, head_dim=64, dtype="f16", method=method, codec=codec)
        eng.prefill(ctx, 0, k, v)
        errors[codec] = rel(eng.attend(ctx, 0, q, exact=True), want)
    return errors, eng


def test_two_bit_codecs_per_token_and_per_channel_keys():
    """Keys with outlier channels: exact attention over 2-bit rows whose keys are normalized
    per channel (hack2c) stays near f16, HACK's per-token keys (hack2) do not; a codec that
    does not exist is an InvalidArgumentError naming it."""
    errors, eng = exact_errors_with_outlier_keys(11, ("hack2", "hack2c"))
    assert errors["hack2c"] < 0.05, errors
    assert errors["hack2c"] * 2 < errors["hack2"], errors
    with pytest.raises(attnstore.InvalidArgumentError, match="hack2c"):
        eng.create_context(q_heads=8, kv_heads=2, head_dim=64, codec="hack3")


def test_kv43_rows_stay_near_f16_with_wave_and_pq():
    """Keys with outlier channels: exact attention over kv43 rows (4-bit keys per channel,
    3-bit values) stays near f16 (1.1e-3 here), nearer than hack2c (2.8e-3), in a wave or a
    pq context (whose base rows are kv43 once its codebook build starts); a head dimension
    kv43 cannot take is an InvalidArgumentError saying why."""
    errors, eng = exact_errors_with_outlier_keys(12, ("hack2c", "kv43"))
    assert errors["kv43"] < 0.005, errors
    assert errors["kv43"] < errors["hack2c"], errors
    pq_errors, pq_eng = exact_errors_with_outlier_keys(12, ("kv43",), method="pq")
    assert pq_errors["kv43"] < 0.005, pq_errors
    q = np.ones((8, 64), dtype=np.float32)
    assert "kv43 (64.0 B per token" in pq_eng.plan(pq_eng.contexts()[-1], 0, q).explain()
    with pytest.raises(attnstore.InvalidArgumentError, match="multiple of 64"):
        eng.create_context(q_heads=8, kv_heads=2, head_dim=32, method="pq", codec="kv43")


def test_a_codec_per_range_of_layers():
    """`codec="kv43,1=kv43:k5"`: layer 1 keeps 5-bit keys (EXPLAIN counts its 72 bytes per
    token and KV head at d = 64, layer 0 its 64) and answers as a one-layer kv43:k5 context
    does; a range beyond the layers, or overlapping another, is an InvalidArgumentError."""
    rng = np.random.default_rng(13)
    k = rng.standard_normal((2, 1024, 64)).astype(np.float32)
    v = rng.standard_normal((2, 1024, 64)).astype(np.float32)
    q = rng.standard_normal((8, 64)).astype(np.float32)
    eng = attnstore.Engine()
    ctx = eng.create_context(q_heads=8, kv_heads=2, head_dim=64, layers=2, codec="kv43,1=kv43:k5")
    one = eng.create_context(q_heads=8, kv_heads=2, head_dim=64, codec="kv43:k5")
    for c, layer in ((ctx, 0), (ctx, 1), (one, 0)):
        eng.prefill(c, layer, k, v)
    assert "kv43 (64.0 B per token" in eng.plan(ctx, 0, q).explain()
    assert "kv43:k5 (72.0 B per token" in eng.plan(ctx, 1, q).explain()
    np.testing.assert_array_equal(eng.attend(ctx, 1, q, exact=True), eng.attend(one, 0, q, exact=True))
    with pytest.raises(attnstore.InvalidArgumentError, match="layer 2"):
        eng.create_context(q_heads=8, kv_heads=2, head_dim=64, layers=2, codec="kv43,2=kv43:k5")
    with pytest.raises(attnstore.InvalidArgumentError, match="overlap"):
        eng.create_context(q_heads=8, kv_heads=2, head_dim=64, layers=4, codec="kv43,0-2=kv43:k5,2=f16")
