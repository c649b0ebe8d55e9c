"""Run the server in a background thread on a free local port (tests and benchmarks)."""

from __future__ import annotations

import socket
import threading
import time


class BackgroundServer:
    """``app_kw`` go to ``build_app`` (api_keys, limits, ...), ``server_kw`` to ``uvicorn_config``
    (timeout_keep_alive, limit_concurrency, read_timeout, max_connections,
    write_timeout, shutdown_timeout)."""

    def __init__(self, engine, model_name: str, host: str = "127.0.0.1", app_kw: dict | None = None,
                 server_kw: dict | None = None):
        import httpx
        import uvicorn

        from .app import build_app
        from .http import uvicorn_config

        self.engine = engine
        self._sock = socket.socket()
        self._sock.bind((host, 0))
        self.base = f"http://{host}:{self._sock.getsockname()[1]}"
        self.app = build_app(engine, model_name, **(app_kw or {}))
        self._server = uvicorn.Server(uvicorn_config(self.app, log_level="warning", **(server_kw or {})))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        deadline = time.time() + 30
        while True:
            try:
                if httpx.get(f"{self.base}/health", timeout=1, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise RuntimeError("the server did not come up within 30 s")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.engine.shutdown()
        self.app.state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._sock.close()
