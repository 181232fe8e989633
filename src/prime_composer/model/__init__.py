"""Model resolution shared by every process: hub ids, local directories and built-in tiny models."""
