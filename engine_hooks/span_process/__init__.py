"""The span process: the traced process's end of it (:mod:`.parent`: the sink, the stand-in
for the tracker that engine expanders see, the wire) and the exporter's own thread behind a bounded
queue (:mod:`.export_queue`). The child itself, which joins the stages, is
:mod:`engine_hooks.span_child`."""
