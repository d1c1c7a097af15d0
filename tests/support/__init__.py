"""What the tests share beyond conftest.py's fixtures: OTLP payloads built by hand and at the wire
level, a collector in its own process, a fake OpenAI-compatible server, the vLLM scenarios run in a
process of their own, the third-party load tools' drivers. Imported as ``support.<module>``
(tests/ is on the path: pytest puts the folder of tests/conftest.py there)."""
