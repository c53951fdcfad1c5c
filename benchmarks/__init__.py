"""hybridsp's benchmarks: one module per question, grouped by subject, run with ``python -m benchmarks``.

``python -m benchmarks list`` names them (the table is ``benchmarks/_registry.py``); ``python -m
benchmarks run NAME [--quick]`` runs one; README.md says how, RESULTS.md what they found. Shared code
is in :mod:`benchmarks.common`; nothing here imports ``tests``.
"""
