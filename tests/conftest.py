import os
from pathlib import Path

import pytest
from ports import free_port

# Triton kernels run on CPU through its interpreter.
if os.environ.get("REDKNOT_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ANCHORS = Path(os.environ.get("REDKNOT_ANCHORS", Path(__file__).resolve().parents[2] / "shared" / "anchors"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(family, rope=..., tie_word_embeddings=..., ...) -> directory, built once per spec."""
    from redknot.tiny import make_tiny_checkpoint

    cache = {}

    def make(family="llama", **kw):
        key = (family, repr(sorted(kw.items())))  # repr: overrides may be lists (mlp_only_layers)
        if key not in cache:
            name = "-".join([family] + [f"{k}={v}" for k, v in sorted(kw.items())])
            cache[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(name), family, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def anchor_head_config():
    path = ANCHORS / "head_config" / "mistral-7B_optimal_g15_lf_ret.json"
    if not path.is_file():
        pytest.skip(f"anchor head config not found at {path} (set REDKNOT_ANCHORS)")
    return path


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A redis-server of the tests' own on a free loopback port: its URL (skips without the binary)."""
    import shutil
    import subprocess
    import time

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    redis = pytest.importorskip("redis")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--protected-mode", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
    yield url
    client.close()
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def dead_redis_url():
    """A Redis URL on a loopback port nothing listens on (connections are refused at once)."""
    port = free_port()
    return f"redis://127.0.0.1:{port}/0"
