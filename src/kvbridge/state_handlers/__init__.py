"""Built-in state handlers (swa, nsa, mamba, dsv4_hisparse), registered through the
``kvbridge`` entry-point group like third-party handlers."""
