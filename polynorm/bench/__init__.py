"""Benchmarks behind ``polynorm bench`` and the scripts in ``bench/``.

``common`` holds the timer, the result record and the JSON/table output;
``cpu``, ``gpu`` and ``interop`` each measure one part of the library.
"""
