"""kvbridge under SGLang (0.5.23): state handlers for SGLang's pools, its transfer classes, its plugin.

- :mod:`.handlers` -- state handlers for SGLang's pool classes, registered by
  ``"module:QualName"`` through the ``kvbridge`` entry-point group (no SGLang import);
- :mod:`.hisparse` -- a HiSparse decode's host and device pools as one record, and its handler;
- :mod:`.crosscheck` -- kvbridge's description against SGLang's own ``KVArgs``;
- :mod:`.conn` -- ``BaseKVManager`` / ``BaseKVSender`` / ``BaseKVReceiver`` /
  ``BaseKVBootstrapServer`` over kvbridge's managers (imports SGLang);
- :mod:`.plugin` -- the ``sglang.srt.plugins`` entry point that makes SGLang use them;
- :mod:`.settings` -- the switch (``KVBRIDGE_SGLANG_BACKEND``) and settings file.

docs/integrations.md (section SGLang) has the launch lines and what is tested.
"""
