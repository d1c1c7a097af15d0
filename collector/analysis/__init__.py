"""Reading a run back, offline: client vs engine (compare), the report and its data, Perfetto
and Parquet exports, run profiles, other tools' client results, derivation from a trace file.
The running collector never imports it (tests/unit/test_layout.py)."""
