"""Running the app with uvicorn: in the foreground (`kiln serve`) or on a thread (tests, notebooks).

On SIGTERM or Ctrl-C the services are shut down first, so every stream in flight ends with an error chunk and
`data: [DONE]` instead of being cut, and uvicorn then closes the connections, which are done by then.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette

log = logging.getLogger("kiln.serve")


class Server(uvicorn.Server):
    """A uvicorn server that ends the app's generations before it waits for connections to close."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                 graceful_seconds: float = 10.0, **options: Any):
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=graceful_seconds, **options)
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: Any) -> None:
        service = getattr(self.app.state, "service", None)
        if service is not None and not self.should_exit:
            threading.Thread(target=service.shutdown, name="kiln-shutdown", daemon=True).start()
        super().handle_exit(sig, frame)

    @property
    def port(self) -> int:
        """The port it listens on (the one the OS chose, for port 0), once started."""
        for server in self.servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.config.port

    def start_in_thread(self, timeout: float = 60.0) -> threading.Thread:
        """Serve on a daemon thread; returns once it accepts connections (stop with `stop()`)."""
        thread = threading.Thread(target=self.run, name="kiln-server", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not self.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see its log)")
            time.sleep(0.02)
        self._thread = thread
        return thread

    def stop(self, timeout: float = 30.0) -> None:
        self.handle_exit(0, None)
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(timeout)


__all__ = ["Server"]
