"""Shared by router and Pylon: header names and the one header parser, limits, proto conversion,
addresses, the event-loop runner, label caches and the clock.

Modules are imported directly (``from stargate.wire.limits import U64_MAX``); this package imports
nothing so that pure layers can use ``limits`` without pulling in I/O.
"""
