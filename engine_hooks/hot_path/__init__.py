"""The hot path: what runs on the engine's thread. The hook events declared once
(:mod:`.hook_events`), the bounded buffer they go into (:mod:`.recorder`), the one pass over a step's
outputs (:mod:`.batch_scan`), the GPU step timer (:mod:`.gpu_timer`) and the C accelerator that
does their per-step and per-chunk work (``csrc/``, built as ``_hotpath``). Imports no other stage."""
