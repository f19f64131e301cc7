"""Servers for the tests: one in a thread on a loopback port, and a tiny model worth serving."""

import socket
import threading
import time

import openai
import uvicorn
from transformers import LlamaConfig

import selfspec
from selfspec.serve.server import create_app
from tiny_models import COMMON, build, tiny_model, tiny_tokenizer

# Each message's words, then "w3" to start the answer: enough for the chat route on a tiny model.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}w3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_served(seed: int = 0) -> selfspec.SelfSpecModel:
    """A tiny random llama with a word tokenizer (w<i> is token i) and a chat template."""
    return selfspec.SelfSpecModel(tiny_model("llama", seed), tiny_tokenizer(CHAT_TEMPLATE), name="tiny-llama")


def save_tiny(path, positions: int = COMMON["max_position_embeddings"]):
    """tiny_served as a checkpoint that `selfspec serve --model PATH` loads; `positions` long."""
    build(LlamaConfig(**{**COMMON, "max_position_embeddings": positions})).save_pretrained(path)
    tiny_tokenizer(CHAT_TEMPLATE).save_pretrained(path)
    return path


class Running:
    """A server on a free loopback port, in a thread, until `close`."""

    def __init__(self, model, **options):
        self.port = free_port()
        self.app = create_app(model, **options)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = self.app.state.server.name

    @property
    def scheduler(self):
        return self.app.state.server.scheduler

    def client(self, key="unused"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


def slow_steps(scheduler, seconds: float) -> None:
    """Make every scheduler step take at least `seconds`, so that a tiny model's request lasts
    long enough to be abandoned or timed out mid-generation."""
    step = scheduler.step

    def slow():
        busy = step()
        if busy:
            time.sleep(seconds)
        return busy

    scheduler.step = slow


def wait_until(condition, seconds: float, message: str) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, message
        time.sleep(0.05)
