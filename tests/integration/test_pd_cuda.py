"""The cuda_ipc data path: a prefill and a decode server process on one GPU, the decode side
gathering the pages straight out of the prefill's pool (REDKNOT_TEST_DEVICE=cuda)."""

import os

import pytest
import torch

from test_pd import Server, body, idle, metrics, post

pytestmark = pytest.mark.skipif(os.environ.get("REDKNOT_TEST_DEVICE", "cpu") != "cuda" or not torch.cuda.is_available(),
                                reason="needs a CUDA device (REDKNOT_TEST_DEVICE=cuda)")


@pytest.mark.parametrize("method,documents", [("dense", None), ("headsparse", None),
                                              ("redknot", ["The merchant Ilsa Torv founded Varna in 1120. " * 8])])
def test_cuda_ipc_handoff_equals_colocated(tmp_path_factory, method, documents):
    tmp = tmp_path_factory.mktemp("pd-cuda")
    flags = ("--pd-transport", "cuda_ipc", "--gpu-memory-utilization", "0.2", "--device", "cuda")
    prefill = Server(tmp, "prefill", "--role", "prefill", *flags)
    decode = Server(tmp, "decode", "--role", "decode", *flags)
    try:
        prefill.wait()
        decode.wait()
        b = body(method, [d for d in documents] if documents else None)
        status, first = post(prefill.base + "/v1/completions", {**b, "max_tokens": 1,
                                                                 "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 200 and first["kv_transfer_params"]["transport"] == "cuda_ipc"
        status, out = post(decode.base + "/v1/completions", {**b, "kv_transfer_params": first["kv_transfer_params"]})
        assert status == 200, out
        assert out["usage"]["kv_transfer"]["transport"] == "cuda_ipc"
        _, colocated = post(decode.base + "/v1/completions", b)
        assert out["choices"][0]["text"] == colocated["choices"][0]["text"]
        assert idle(decode.base) and idle(prefill.base)
        assert metrics(prefill.base)["pd_leases_pulled_total"] == 1
    finally:
        prefill.stop()
        decode.stop()



