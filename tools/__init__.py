"""Tools for tests, benchmarks and demos: a tiny model builder and a stand-in trajectory sink.

Nothing in the library, the runtime or the services imports these.
"""
