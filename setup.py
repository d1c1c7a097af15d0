"""Only the optional C accelerators live here; everything else is in pyproject.toml.

* ``collector.receivers._otlp_walk`` walks OTLP protobuf payloads without building protobuf
  objects;
* ``engine_hooks.hot_path._hotpath`` reads an engine step's outputs (request ids, token counts, the
  rare fields) in one pass on the engine's thread;
* ``otel_llm.otlp._int_text`` writes integer arrays (token-event offsets) as OTLP/JSON text.

All are optional: without a C compiler the install goes on, and the collector uses protobuf's
parser and a Python walk, the hooks a Python scan, the JSON writer str() and join (same results,
slower).
"""

from glob import glob

from setuptools import Extension, setup

FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

SHARED = ["otel_llm/csrc/otel_llm_c.h"]  # what every accelerator includes

setup(
    ext_modules=[
        Extension(name, sources, depends=SHARED + headers, extra_compile_args=FLAGS, optional=True)
        for name, sources, headers in (
            ("collector.receivers._otlp_walk", ["collector/receivers/_otlp_walk.c"], []),
            (
                "engine_hooks.hot_path._hotpath",
                sorted(glob("engine_hooks/hot_path/csrc/*.c")),
                ["engine_hooks/hot_path/csrc/hotpath.h"],
            ),
            ("otel_llm.otlp._int_text", ["otel_llm/otlp/_int_text.c"], []),
        )
    ]
)
