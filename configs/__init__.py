"""The job configs shipped with genrec (installed as ``genrec.configs``; ``genrec.config.config_path``
finds them by name from any directory)."""
