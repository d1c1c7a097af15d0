"""Disaggregated prefill and decode in vLLM: which leg of a request an engine serves.

A P/D deployment sends the prompt to a prefill engine with ``kv_transfer_params.do_remote_decode``
(it computes the prompt, gives one token the proxy discards, and holds the KV blocks for the
decode side), then the same request to a decode engine with the ``kv_transfer_params`` the prefill
engine returned (``do_remote_prefill``, ``remote_request_id``: the prefill engine core's request id,
``remote_engine_id``: its KV connector's engine id). vLLM's proxies do so
(``toy_proxy_server.py``, among the tests of vLLM's repository); so does ``examples/pd_proxy.py``.

The front end's arrival hook (:mod:`engine_hooks.vllm.frontend`) puts the leg on ``llm.request``
(``llm.pd.*``, :mod:`otel_llm.semconv`), which the collector reads to join the two legs of one
request (:mod:`collector.pipeline.disagg`), by trace and by these ids, never by time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otel_llm import semconv as sc

PREFILL, DECODE, BOTH = sc.PdRole.PREFILL, sc.PdRole.DECODE, sc.PdRole.BOTH


def engine_connector(engine: Any) -> dict[str, str] | None:
    """An engine's KV connector and its engine id (``llm.pd.connector``, ``llm.pd.engine_id``),
    None for an engine without one (it serves every request whole: nothing to say)."""
    config = getattr(engine, "vllm_config", None)
    kv = getattr(config, "kv_transfer_config", None)
    connector = getattr(kv, "kv_connector", None)
    if not connector:
        return None
    out = {sc.PD_CONNECTOR: str(connector)}
    engine_id = getattr(kv, "engine_id", None)
    if engine_id:
        out[sc.PD_ENGINE_ID] = str(engine_id)
    return out


def leg_attributes(kv_params: Any, connector: Mapping[str, str]) -> dict[str, str]:
    """The ``llm.pd.*`` attributes of one request on an engine with a KV connector
    (``connector``: :func:`engine_connector`'s), from the ``kv_transfer_params`` it came with (None
    or not a mapping: a request served whole here, role ``both``)."""
    out = dict(connector)
    if not isinstance(kv_params, Mapping):
        out[sc.PD_ROLE] = BOTH
        return out
    if kv_params.get("do_remote_decode"):
        out[sc.PD_ROLE] = PREFILL
    elif kv_params.get("do_remote_prefill"):
        out[sc.PD_ROLE] = DECODE
    else:
        out[sc.PD_ROLE] = BOTH
    for key, attr in (("remote_request_id", sc.PD_PEER_REQUEST_ID), ("remote_engine_id", sc.PD_PEER_ENGINE_ID)):
        v = kv_params.get(key)
        if isinstance(v, str) and v:
            out[attr] = v
    return out
