"""The collector's processing, pure of I/O: walked spans -> assembled traces -> other engines'
spans made ours -> derived records (TTFT's parts, stalls, invariants) -> metric families. Imports
nothing else of the collector (tests/unit/test_layout.py)."""
