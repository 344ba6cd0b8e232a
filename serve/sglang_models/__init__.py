"""SGLang's out-of-tree model package for genrec (SGLANG_EXTERNAL_MODEL_PACKAGE points here).

SGLang imports every module of this package and registers its ``EntryClass``; the model
itself lives in ``serve.sglang_engine`` (the one module of serve/ that imports SGLang).
"""
