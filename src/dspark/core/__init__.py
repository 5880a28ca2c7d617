"""The bottom layer: what every other part of dspark may use and nothing in it uses them back.

``errors`` (the user-facing error types), ``io`` (atomic writes, JSON), ``sampling`` (the
probability and inverse-CDF conventions the drafters, the engine and the kernels share),
``types`` (the records that cross the target / drafter / engine seams), ``provenance`` (commit,
machine, date of a result) and ``progress`` (bars on long loops). The layer order is written in
docs/architecture.md.
"""
