"""Coverage-guided fuzzing of the collector's C walk against protobuf's parser (atheris).

Run by ``tests/fuzz/run.sh`` (which builds the walk with AddressSanitizer, UBSan and libFuzzer's
coverage, and preloads atheris' sanitizer runtime), or by ``make fuzz``. Every input is decoded by
both: where protobuf refuses it the walk must defer (None); where protobuf takes it the walk must
give the same spans or defer. Inputs are mutated half the time by libFuzzer's byte mutator and half
by the OTLP-aware rewrites of ``tests/support/wire_mutator.py`` (unknown fields, padded varints, split
messages, bad UTF-8, deep nesting...), so both malformed and well-formed-but-unusual payloads reach
the walk. A sanitizer report, a Python exception or a disagreement stops the run (exit non-zero)
and leaves the input as crash-* in the working directory.

    python tests/fuzz/fuzz_walk.py [libFuzzer options] CORPUS_DIR...
"""

from __future__ import annotations

import importlib.util
import os
import random
import struct
import sys

import atheris

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

from support import wire_mutator  # noqa: E402

from collector.receivers import decode  # noqa: E402
from collector.receivers.decode import DecodeError, parse_request, walk_message  # noqa: E402

# the sanitized build (tests/fuzz/run.sh puts it in OTEL_LLM_FUZZ_EXT), in place of the installed one
_ext = os.environ.get("OTEL_LLM_FUZZ_EXT")
if _ext:
    spec = importlib.util.spec_from_file_location("collector.receivers._otlp_walk", _ext)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.set_schema(decode.wire_schema())
    decode._otlp_walk = mod
if decode._otlp_walk is None:
    sys.exit("fuzz_walk: the C walk is not built")


def _norm(spans):
    return [
        tuple(("f", struct.pack("<d", v)) if isinstance(v, float) else (type(v).__name__, v) for v in s) for s in spans
    ]


def TestOneInput(data: bytes) -> None:
    fast = decode.walk_bytes(data)
    try:
        slow = walk_message(parse_request(data))
    except DecodeError:
        if fast is not None:
            raise AssertionError("the C walk accepted a payload protobuf rejects") from None
        return
    if fast is not None:
        a = (fast.total, fast.rejected, fast.first_error, _norm(fast.spans))
        b = (slow.total, slow.rejected, slow.first_error, _norm(slow.spans))
        if a != b:
            raise AssertionError(f"the C walk and protobuf disagree:\n{a}\n{b}")


def CustomMutator(data: bytes, max_size: int, seed: int) -> bytes:
    rnd = random.Random(seed)
    if rnd.random() < 0.5:
        out = wire_mutator.mutate(data, rnd)
    else:
        out = atheris.Mutate(data, max_size)
    return out[:max_size]


if __name__ == "__main__":
    atheris.Setup(sys.argv, TestOneInput, custom_mutator=CustomMutator)
    atheris.Fuzz()
