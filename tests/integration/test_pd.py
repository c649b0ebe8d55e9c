"""Prefill/decode disaggregation end to end: a prefill instance, a decode instance and vllm-router
(``--vllm-pd-disaggregation``) as three processes on the bundled model. Greedy answers through the
PD path equal the decode instance's own colocated answers for dense, headsparse and the reuse
methods; a prefill killed mid-transfer, an expired lease and a plan mismatch all end in a
recomputed answer (or a clean 503 under ``--pd-on-failure fail``), and both pools return to idle."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from ports import free_port

ROUTER = shutil.which("vllm-router") or shutil.which("vllm-router", path=os.path.dirname(sys.executable))
MODEL = "redknot-testbed"
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango").split()
# ~300 tokens: longer than the bundled head config's 256-token windows, so local heads drop pages
LONG = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(300))
DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120 beside the river. " * 6,
        "The old mill at the river's bend grinds barley every spring for the city. " * 6]


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^redknot:(\w+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            labels.pop("model_name", None)
            key = m.group(1) + "".join(f"[{k}={v}]" for k, v in sorted(labels.items()))
            out[key] = float(m.group(3))
    return out


class Server:
    def __init__(self, tmp, name: str, *flags, env=None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "redknot.cli", "serve", "--port", str(self.port), "--page-size", "16",
             "--max-num-seqs", "8", *(() if "--device" in flags else ("--kv-pages", "4000")), *flags],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait(self, timeout: float = 120) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(self.base + "/health", timeout=1)
                return self
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"server did not start: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def idle(base: str, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(base)
        if m.get("kv_pool_held_pages") == 0 and m.get("pd_leases") == 0 and m.get("num_requests_running") == 0:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    prefill = Server(tmp, "prefill", "--role", "prefill", "--pd-lease-s", "4")
    decode = Server(tmp, "decode", "--role", "decode", "--pd-pull-timeout-s", "20")
    # a prefill/decode pair over torch.distributed point-to-point (gloo on CPUs); the decode answers
    # 503 when a pull fails
    init = f"tcp://127.0.0.1:{free_port()}"
    # (its TCP path pauses between a handoff's header and its pages: the kill test kills it there, last)
    prefill_nccl = Server(tmp, "prefill-nccl", "--role", "prefill", "--pd-transport", "nccl", "--pd-nccl-init", init,
                          "--pd-nccl-rank", "0", env={"REDKNOT_PD_FAULT_PAUSE_S": "30"})
    failing = Server(tmp, "decode-nccl", "--role", "decode", "--pd-on-failure", "fail", "--pd-transport", "nccl",
                     "--pd-nccl-init", init, "--pd-nccl-rank", "1")
    servers = [prefill, decode, failing, prefill_nccl]
    router = None
    try:
        for s in servers:
            s.wait()
        url = None
        if ROUTER is not None:  # the real router, as users run it
            port = free_port()
            router = subprocess.Popen([ROUTER, "--vllm-pd-disaggregation", "--prefill", prefill.base, "--decode",
                                       decode.base, "--host", "127.0.0.1", "--port", str(port), "--policy",
                                       "round_robin"], stdout=open(tmp / "router.log", "w"), stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(url + "/health", timeout=1)
                    break
                except OSError:
                    if time.monotonic() > deadline or router.poll() is not None:
                        raise RuntimeError((tmp / "router.log").read_text()[-3000:])
                    time.sleep(0.3)
        yield type("PD", (), {"prefill": prefill, "decode": decode, "failing": failing,
                                "prefill_nccl": prefill_nccl, "router": url, "tmp": tmp})
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=15)
        for s in servers:
            s.stop()


def through_router(pd, path: str, body: dict) -> dict:
    """The PD flow: the router when it runs here, else its two legs by hand (the same requests)."""
    if pd.router is not None:
        status, out = post(pd.router + path, body)
        assert status == 200, out
        return out
    status, first = post(pd.prefill.base + path, {**body, "max_tokens": 1, "stream": False,
                                                   "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, first
    status, out = post(pd.decode.base + path, {**body, "kv_transfer_params": first["kv_transfer_params"]})
    assert status == 200, out
    return out


def body(method: str, documents=None, n: int = 8) -> dict:
    b = {"model": MODEL, "prompt": LONG, "max_tokens": n, "temperature": 0, "ignore_eos": True, "method": method}
    if documents is not None:
        b["documents"] = documents
        b["prompt"] = "Who founded Varna, and what does the mill grind?"
    return b


@pytest.mark.parametrize("method,documents", [("dense", None), ("headsparse", None), ("full_reuse", DOCS),
                                              ("cacheblend", DOCS), ("redknot", DOCS)])
def test_pd_path_equals_colocated(pd, method, documents):
    b = body(method, documents)
    status, colocated = post(pd.decode.base + "/v1/completions", b)  # no kv_transfer_params: computed here
    assert status == 200, colocated
    out = through_router(pd, "/v1/completions", b)
    assert out["choices"][0]["text"] == colocated["choices"][0]["text"]
    moved = out["usage"]["kv_transfer"]
    assert moved["bytes"] > 0 and moved["transport"] == "tcp"
    assert sum(moved["bytes_by_head_class"].values()) == moved["bytes"]
    if method == "headsparse":  # local heads hold their sink and window only: fewer bytes than dense
        assert moved["bytes_by_head_class"]["local"] > 0
        dense = through_router(pd, "/v1/completions", body("dense"))["usage"]["kv_transfer"]["bytes"]
        assert moved["bytes"] < dense
    assert idle(pd.decode.base) and idle(pd.prefill.base)


def test_chat_stream_through_router(pd):
    b = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 6, "temperature": 0,
         "ignore_eos": True, "method": "headsparse"}
    status, colocated = post(pd.decode.base + "/v1/chat/completions", b)
    assert status == 200
    out = through_router(pd, "/v1/chat/completions", b)
    assert out["choices"][0]["message"]["content"] == colocated["choices"][0]["message"]["content"]


def test_expired_lease_frees_pages_and_recomputes_or_fails(pd):
    b = body("dense", n=4)
    status, first = post(pd.prefill.base + "/v1/completions", {**b, "max_tokens": 1,
                                                                "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200
    assert metrics(pd.prefill.base)["pd_lease_pages"] > 0
    assert idle(pd.prefill.base, timeout=15)  # the 4 s lease expired: its pages are back
    assert metrics(pd.prefill.base)["pd_leases_expired_total"] >= 1
    status, out = post(pd.decode.base + "/v1/completions", {**b, "kv_transfer_params": first["kv_transfer_params"]})
    assert status == 200 and "kv_transfer" not in out["usage"]
    status, err = post(pd.failing.base + "/v1/completions", {**b, "kv_transfer_params": first["kv_transfer_params"]})
    assert status == 503 and err["error"]["code"] == "kv_transfer_failed"
    assert idle(pd.failing.base)


def test_plan_mismatch_is_rejected_and_recomputed(pd):
    b = body("dense", n=4)
    status, first = post(pd.prefill.base + "/v1/completions", {**b, "max_tokens": 1,
                                                                "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200
    before = metrics(pd.decode.base).get("pd_transfers_total[result=rejected][side=received]", 0)
    wrong = {**b, "method": "headsparse", "kv_transfer_params": first["kv_transfer_params"]}
    status, out = post(pd.decode.base + "/v1/completions", wrong)
    assert status == 200 and "kv_transfer" not in out["usage"]
    _, colocated = post(pd.decode.base + "/v1/completions", {**b, "method": "headsparse"})
    assert out["choices"][0]["text"] == colocated["choices"][0]["text"]
    assert metrics(pd.decode.base)["pd_transfers_total[result=rejected][side=received]"] == before + 1


def test_legs_go_to_the_right_role(pd):
    b = body("dense", n=2)
    status, err = post(pd.decode.base + "/v1/completions", {**b, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 400 and err["error"]["param"] == "kv_transfer_params"
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "x"}
    status, err = post(pd.prefill.base + "/v1/completions", {**b, "kv_transfer_params": params})
    assert status == 400 and err["error"]["param"] == "kv_transfer_params"


def test_nccl_transport_with_gloo(pd):
    b = body("headsparse")
    status, first = post(pd.prefill_nccl.base + "/v1/completions", {**b, "max_tokens": 1,
                                                                     "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200 and first["kv_transfer_params"]["transport"] == "nccl"
    status, out = post(pd.failing.base + "/v1/completions", {**b, "kv_transfer_params": first["kv_transfer_params"]})
    assert status == 200, out
    assert out["usage"]["kv_transfer"]["transport"] == "nccl" and out["usage"]["kv_transfer"]["bytes"] > 0
    _, colocated = post(pd.failing.base + "/v1/completions", b)
    assert out["choices"][0]["text"] == colocated["choices"][0]["text"]
    assert idle(pd.failing.base) and idle(pd.prefill_nccl.base)


def test_prefill_killed_mid_transfer_recomputes(pd):
    prefill = pd.prefill_nccl  # runs last: this kills it
    b = body("headsparse")
    try:
        status, first = post(prefill.base + "/v1/completions", {**b, "max_tokens": 1,
                                                                 "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 200 and first["kv_transfer_params"]["do_remote_prefill"] is True
        params = {**first["kv_transfer_params"], "transport": "tcp"}  # every KV server also serves TCP
        result = {}
        t = threading.Thread(target=lambda: result.update(
            out=post(pd.decode.base + "/v1/completions", {**b, "kv_transfer_params": params})))
        before = metrics(pd.decode.base).get("pd_recomputed_total", 0)
        t.start()
        deadline = time.monotonic() + 60
        while "pd: sending lease" not in prefill.log.read_text():  # its header is out: the transfer has begun
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(prefill.proc.pid, signal.SIGKILL)
        t.join(timeout=60)
    finally:
        prefill.stop()  # already gone
    status, out = result["out"]
    assert status == 200, out
    assert "kv_transfer" not in out["usage"]  # computed here
    _, colocated = post(pd.decode.base + "/v1/completions", b)
    assert out["choices"][0]["text"] == colocated["choices"][0]["text"]
    assert metrics(pd.decode.base)["pd_recomputed_total"] == before + 1
    assert idle(pd.decode.base)
