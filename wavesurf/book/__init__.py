"""The book wing: what exists for the notebooks and the Jupyter Book, not for the library.

``profiles`` (the run budgets), ``notebook`` (a notebook's checked parameters and its target),
``variants`` (the statistics variants a profile asks for, from one capture), ``speed_table`` (the
drafter experiment: one head per layer set and seed, floors, intervals) with ``table_sets`` (the
layer sets it trains) and ``verdicts`` (what it can say, in sentences), ``paper`` (the notebooks'
tables and glue), ``plots`` (one figure style), ``tables`` (HTML tables that fit the page) and
``reproduce`` (jupytext notebooks -> papermill -> the book). These modules import the library
(``wavesurf.stats``, ``wavesurf.drafter``, ``wavesurf.select``, ...); the library never imports
them (``tests/book/test_wing.py`` reads every import to hold that).
"""
