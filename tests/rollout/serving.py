"""A real `rlctl serve` app (uvicorn, HTTP on 127.0.0.1) run in a thread of the test
process: started on a free port or a given one, stopped (the port refuses connections
afterwards), restartable on the same port. Bounded in time: start and stop wait at most
``LIMIT_S``."""
import copy
import threading
import time

import uvicorn

from rlctl.rollout.engines.protocol import TorchEngine, chunk_seed
from rlctl.rollout.engines.serve_app import build_app

LIMIT_S = 10.0


class CountingEngine(TorchEngine):
    """The torch engine, counting the generate calls it served."""
    calls = 0

    def generate(self, *args, **kwargs):
        self.calls += 1
        return super().generate(*args, **kwargs)


class ChunkedEngine(TorchEngine):
    """The torch engine cutting a batch into requests of ``size`` prompts, request j seeded
    ``chunk_seed(seed, j)``, as the server engine cuts it."""

    def __init__(self, model, pad_id, size):
        super().__init__(model, pad_id)
        self.size = size

    def generate(self, prompts, sampling, seed=None):
        return [c for j in range(0, len(prompts), self.size) for c in TorchEngine.generate(
            self, prompts[j:j + self.size], sampling, chunk_seed(seed, j // self.size))]


def tiny_app(model, pad_id, stops=()):
    """(app, engine) serving a copy of ``model`` (each server holds its own weights)."""
    engine = CountingEngine(copy.deepcopy(model), pad_id)
    return build_app(engine, "tiny", default_stops=stops), engine


class ServeThread:
    def __init__(self, app, port: int = 0):
        self.port = port
        self.start(app)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, app):
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + LIMIT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self):
        self.server.should_exit = True
        self.thread.join(LIMIT_S)
        assert not self.thread.is_alive(), "the test server did not stop"
