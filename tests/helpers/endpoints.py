"""An explorer's recording endpoint (the serve API in process) for a test, and its client."""

from __future__ import annotations

import openai

from streamrft.infra.config import ExplorerConfig, ModelConfig
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.engines import make_engine
from streamrft.producers.serving.endpoint import RecordingEndpoint


def tiny_endpoint(run: str, version: int, max_tokens: int) -> RecordingEndpoint:
    """The endpoint of a tiny random model on the transformers engine, started, serving
    ``version`` with ``max_tokens`` for a request naming none (``stop()`` it)."""
    tok = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(), tok).eval()
    engine = make_engine("transformers", model, tok, ExplorerConfig())
    endpoint = RecordingEndpoint(engine, PromptRenderer(tok), run, "explorer-0")
    endpoint.start()
    endpoint.prepare(version=version, temperature=1.0, max_tokens=max_tokens)
    return endpoint


def client_of(endpoint: RecordingEndpoint, episode: str) -> openai.OpenAI:
    """The official client on one episode of ``endpoint``, no retries."""
    return openai.OpenAI(base_url=endpoint.base_url(episode), api_key="unused", max_retries=0)
