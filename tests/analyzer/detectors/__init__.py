"""Detector tests on small synthetic traces (tests/tracebuilder.py): for each detector a
positive case, a healthy look-alike that must stay quiet, and a trace without the data the
detector requires. No test here imports torch."""
