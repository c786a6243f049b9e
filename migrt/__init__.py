"""migrt: a runc-compatible OCI runtime wrapper that checkpoints and restores containers (GPU state too)."""

__version__ = "0.1.0"
