"""The whole kvbridge conformance suite against this backend: this class is all it takes."""

from kvbridge.testing.conformance import BackendConformance


class TestZmqConformance(BackendConformance):
    backend = "zmq"
