"""The ``rl`` launcher: resolve the config, start, watch and stop the processes."""
