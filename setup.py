"""Only the optional C accelerator lives here; everything else is in pyproject.toml.

``collector.receivers._otlp_walk`` walks OTLP protobuf payloads without building protobuf
objects. It is optional: without a C compiler the install goes on and the collector uses
protobuf's parser and a Python walk (same results, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "collector.receivers._otlp_walk",
            ["collector/receivers/_otlp_walk.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
            optional=True,
        )
    ]
)
