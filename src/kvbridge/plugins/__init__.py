"""Built-in transport plugins. Each is loaded through the ``kvbridge`` entry-point
group exactly like a third-party backend, and imports only ``kvbridge.core`` and
its own engine (lazily, when selected)."""
