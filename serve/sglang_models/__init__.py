"""The scheduler side of the SGLang engine: SGLang's out-of-tree model package for genrec
(``SGLANG_EXTERNAL_MODEL_PACKAGE`` points here; SGLang imports every module of it and registers
each ``EntryClass``).

* ``genrec_tower``: ``GenRecHSTU``, the model (the one module here that imports SGLang);
* ``codec``: the answer rows and constants both sides share (the front end,
  ``serve.sglang_engine``, reads them with it).
"""
