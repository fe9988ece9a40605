"""The remote tier from Python: a context published to a real Redis server by one engine is
attached by another with equal outputs; prefixes that diverge share exactly their common
chunks; another model's identity never matches; sliding-window layers attach their window;
and a transformers model reuses a prompt another cache published, generating the same
tokens. Skipped, saying why, where `redis-server` is missing (`scripts/install-redis`)."""

import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

import attnstore

REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (scripts/install-redis)")


@pytest.fixture
def redis_url(tmp_path):
    """A Redis server of its own on a free loopback port, stopped after the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"redis-server did not start on port {port}")
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


SHAPE = dict(q_heads=4, kv_heads=2, head_dim=32)
MODEL = attnstore.model_id(data=b"a test model")


def kv(tokens, seed):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((2, tokens, 32)).astype(np.float32)
    v = rng.standard_normal((2, tokens, 32)).astype(np.float32)
    return k, v


def publish(url, layers, ids, dtype="f32", codec=None, windows=None):
    """Engine A: a context of `layers` ((k, v) per layer) published under MODEL, flushed."""
    eng = attnstore.Engine()
    ctx = eng.create_context(layers=len(layers), dtype=dtype, codec=codec, windows=windows, **SHAPE)
    for layer, (k, v) in enumerate(layers):
        eng.prefill(ctx, layer, k, v)
    tier = attnstore.RemoteTier(url)
    tier.publish(eng, ctx, MODEL, ids, layers)
    assert tier.flush(60)
    stats = tier.stats()
    assert stats["publishes_done"] == 1 and stats["bytes_out"] > 0, stats
    return eng, ctx


@pytest.mark.parametrize("dtype,codec", [("f32", None), ("f16", "hack2")])
def test_attached_context_answers_like_the_published_one(redis_url, dtype, codec):
    layers = [kv(5120, 1), kv(5120, 2)]
    ids = np.arange(5120) * 7 % 5000
    a, actx = publish(redis_url, layers, ids, dtype, codec)
    b = attnstore.Engine()
    tier = attnstore.RemoteTier(redis_url)
    got = tier.attach(b, MODEL, ids, layers=2, dtype=dtype, codec=codec, **SHAPE)
    assert got is not None and got.tokens == 5120 and got.layouts_used == 2, got
    q = np.random.default_rng(3).standard_normal((4, 32)).astype(np.float32)
    for layer in range(2):
        for kwargs in ({"exact": True}, {}):
            np.testing.assert_array_equal(b.attend(got.context, layer, q, **kwargs), a.attend(actx, layer, q, **kwargs))
        k, v = got.kv(layer)
        assert k.shape == v.shape == (2, 5120, 32)
        if dtype == "f32":
            np.testing.assert_array_equal(k, layers[layer][0])
    stats = tier.stats()
    assert stats["attach_tokens_reused"] == 5120 and stats["hits"] >= 40 and stats["misses"] == 0, stats


def test_diverging_prefixes_share_their_common_chunks_and_other_models_none(redis_url):
    layers = [kv(1024, 4)]
    ids = list(range(1024))
    publish(redis_url, layers, ids)
    tier = attnstore.RemoteTier(redis_url)
    b = attnstore.Engine()
    # Diverging inside the third chunk: the first two are shared.
    other = ids[:600] + [9999] * 424
    got = tier.attach(b, MODEL, other, layers=1, dtype="f32", **SHAPE)
    assert got.tokens == 512
    assert b.tokens(got.context, 0) == 512
    np.testing.assert_array_equal(got.kv(0)[1], layers[0][1][:, :512])
    # Another model's identity, or another namespace, never matches.
    assert tier.attach(b, attnstore.model_id(data=b"another model"), ids, layers=1, dtype="f32", **SHAPE) is None
    assert attnstore.RemoteTier(redis_url, namespace="elsewhere").attach(b, MODEL, ids, layers=1, dtype="f32", **SHAPE) is None


def test_sliding_window_layers_attach_their_window(redis_url):
    layers = [kv(768, 5), kv(768, 6)]
    ids = list(range(100, 868))
    publish(redis_url, layers, ids, windows=[None, 128])
    b = attnstore.Engine()
    got = attnstore.RemoteTier(redis_url).attach(b, MODEL, ids, layers=2, dtype="f32", windows=[None, 128], **SHAPE)
    assert got.tokens == 768
    assert got.kv(0)[0].shape == (2, 768, 32)
    np.testing.assert_array_equal(got.kv(1)[0], layers[1][0][:, -128:])


def test_bad_arguments_are_clear_errors(redis_url):
    tier = attnstore.RemoteTier(redis_url, chunk_tokens=128)
    assert tier.chunk_tokens == 128
    eng = attnstore.Engine()
    with pytest.raises(attnstore.InvalidArgumentError, match="64 hex digits"):
        tier.attach(eng, "not-a-hash", [1, 2, 3], **SHAPE)
    with pytest.raises(attnstore.InvalidArgumentError, match="windows"):
        eng.create_context(layers=2, windows=[None], **SHAPE)
    with pytest.raises(ValueError, match="token id"):
        tier.attach(eng, MODEL, [-1], **SHAPE)
    with pytest.raises(attnstore.ShapeError, match="one dimension"):
        tier.attach(eng, MODEL, np.zeros((2, 2), dtype=np.int64), **SHAPE)
    ctx = eng.create_context(layers=1, dtype="f32", **SHAPE)
    k, v = kv(300, 7)
    eng.prefill(ctx, 0, k, v)
    with pytest.raises(attnstore.ShapeError):
        tier.publish(eng, ctx, MODEL, list(range(300)), [(k[:1], v[:1])])
    with pytest.raises(attnstore.InvalidArgumentError):
        attnstore.RemoteTier(redis_url, chunk_tokens=0)
    with pytest.raises(attnstore.RemoteError):
        attnstore.RemoteTier("redis://127.0.0.1:1", timeout=0.2)
    with pytest.raises(ValueError, match="exactly one"):
        attnstore.model_id()


def test_transformers_model_reuses_a_prompt_another_cache_published(redis_url):
    torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-torch installs it)")
    pytest.importorskip("transformers", reason="transformers is not installed (scripts/install-torch)")
    import attnstore.hf
    from test_hf import generate, tiny_llama

    model = tiny_llama()
    ids = torch.randint(0, 256, (1, 700), generator=torch.Generator().manual_seed(8))
    want = generate(model.set_attn_implementation("sdpa") or model, ids)
    tier = attnstore.RemoteTier(redis_url)
    first = attnstore.hf.cache_for(model, remote=tier, prompt=ids, exact=True)
    assert first.reused == 0
    assert torch.equal(generate(model, ids, first), want)
    assert tier.flush(60) and tier.stats()["publishes_done"] == 1
    # A second process: a new engine and cache attach 512 of the 699 tokens before the last.
    second = attnstore.hf.cache_for(model, attnstore.Engine(), remote=attnstore.RemoteTier(redis_url), prompt=ids, exact=True)
    assert second.reused == 512
    assert torch.equal(generate(model, ids, second), want)
    assert second.engine.tokens(second.contexts[0], 1) == 700 + 16 - 1
    # Other weights never reuse it.
    other = tiny_llama()
    with torch.no_grad():
        other.model.embed_tokens.weight.mul_(1.5)
    third = attnstore.hf.cache_for(other, remote=attnstore.RemoteTier(redis_url), prompt=ids, exact=True)
    assert third.reused == 0
    model.set_attn_implementation("sdpa")
