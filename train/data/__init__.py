"""Interaction-log datasets: schema, Parquet reading, synthetic generation, conversion, checks."""
