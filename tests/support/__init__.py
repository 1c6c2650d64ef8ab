"""Shared test support: bounded waits, in-process fakes and builders used by more than one test file."""
