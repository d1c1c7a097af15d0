"""What a caller's side records: the ``llm.client.request`` span both clients record
(``client_span``), the traced OpenAI-compatible client (``traced``) and the openai SDK's calls
traced without changing what they return (``openai_wrapper``).

``from otel_llm.client import instrument_openai, TracedClient`` is the public path."""

from .traced import TracedClient, instrument_openai

__all__ = ["TracedClient", "instrument_openai"]
