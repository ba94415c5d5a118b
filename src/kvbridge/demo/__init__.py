"""A host server with kvbridge inside, and ``kvbridge demo``, which runs a pair of them and checks them.

- :mod:`~kvbridge.demo.model`: a tiny hybrid model (full, sliding-window, Mamba, sparse and
  compressed attention, an MTP draft head), pure torch, tensor-parallel;
- :mod:`~kvbridge.demo.cache`: its caches, as kvbridge's pool classes, and their allocators;
- :mod:`~kvbridge.demo.generate`: chunked prefill and greedy decode, and the colocated reference;
- :mod:`~kvbridge.demo.server`: the host server (``--role prefill|decode --tp N`` + the transfer flags);
- :mod:`~kvbridge.demo.ranks`: lock-step control of a server's TP ranks;
- :mod:`~kvbridge.demo.router`, :mod:`~kvbridge.demo.client`: the front;
- :mod:`~kvbridge.demo.run`: ``kvbridge demo``.

``examples/host_server/`` shows how to run the pieces by hand. Importing this
package imports neither torch nor an engine (the CLI imports it for its flags).
"""

from .run import add_arguments, run_from_args

__all__ = ["add_arguments", "run_from_args"]
