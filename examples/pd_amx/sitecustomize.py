"""Put this folder on ``PYTHONPATH`` of a vLLM CPU server that moves KV caches with NIXL.

On a CPU with AMX, vLLM 0.32's CPU worker dies with "Illegal instruction" in
``cpu_attention_with_kv_cache`` on its first step after a NIXL KV load, unless the process asked
the kernel for AMX's tile state before NIXL initialised (``torch._C._cpu._init_amx()``; vLLM calls
it later, too late once NIXL's threads exist). Python runs this module at the start of every
process (the API server, its engine core and its worker, which inherit ``PYTHONPATH``), which is
early enough. On a CPU without AMX the call returns False and changes nothing. Not part of
otel-llm's tracing: a cure for a crash of the engine, needed with or without tracing.
"""

try:
    import torch

    torch._C._cpu._init_amx()
except Exception:  # not the CPU build of torch, or no such call: nothing to cure
    pass
