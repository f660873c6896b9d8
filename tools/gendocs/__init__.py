"""Generators for the parts of ``docs/`` that mirror the code.

Each generator renders the text between two markers of one page::

    <!-- generated: NAME (python -m tools.gendocs) -->
    ...
    <!-- end generated: NAME -->

``python -m tools.gendocs`` rewrites every such region; ``--check`` only
reports the pages that are out of date (the test suite runs the same check).
"""
