"""kvbridge-zmq: registers the ``zmq`` backend. Importing this module imports no engine."""

from kvbridge import BackendCapabilities, BackendSpec, hookimpl

CAPABILITIES = BackendCapabilities(
    memory_kinds=("dram",),
    native_notifications=False,
    # Bytes travel in messages and the receiver places them: the decode
    # process must be running (it is: its receiver thread does the writes).
    one_sided=False,
)


@hookimpl
def kvbridge_register_backends():
    return [
        BackendSpec(
            name="zmq",
            factory="kvbridge_zmq.backend:ZmqBackend",
            capabilities=CAPABILITIES,
            requires=("zmq",),
            description="portable: bytes over pyzmq, bounds-checked and placed by the receiver",
        )
    ]
